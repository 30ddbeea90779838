"""`python -m publisher.cli`: the same command as `hf-ao-publish`."""

from publisher.cli.commands import main

if __name__ == "__main__":
    main()
