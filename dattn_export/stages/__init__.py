"""One module per command; `cli.py` only parses options and renders what these return."""
