"""Subcommands of the tvmamp command line, one module each."""
