"""The command line: flags, valid values, --help, and the rules of --resume."""
