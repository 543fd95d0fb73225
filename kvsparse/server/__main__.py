"""``python -m kvsparse.server``: one server process (see `kvsparse.server.main.main`)."""

import sys

from kvsparse.server.main import main

if __name__ == "__main__":
    sys.exit(main())
