"""CLI subcommands (see turnopd/cli.py)."""
