"""Builders, runners and format writers that the tests share; no test module imports another."""
