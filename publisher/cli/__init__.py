"""The command line: `hf-ao-publish` (commands.py parses and delegates; options.py holds the options its commands
share; jsonout.py writes --json; recipe_table.py renders `hf-ao-publish recipes`). No job logic lives here."""

from publisher.cli.commands import main

__all__ = ["main"]
