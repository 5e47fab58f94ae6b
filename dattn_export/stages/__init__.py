"""One module per command; `cli/` (a module per command) only parses options and renders what these return."""
