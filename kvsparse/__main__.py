"""``python -m kvsparse``: the ``kvsparse`` command (see kvsparse.cli)."""

import sys

from kvsparse.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
