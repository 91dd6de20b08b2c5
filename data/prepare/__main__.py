"""``python -m data.prepare``: the command is data/prepare/cli.py."""

import sys

from data.prepare.cli import main

if __name__ == "__main__":
    sys.exit(main())
