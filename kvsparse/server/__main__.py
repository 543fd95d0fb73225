"""``python -m kvsparse.server``: one server process (see `kvsparse.server.server.main`)."""

import sys

from kvsparse.server.server import main

if __name__ == "__main__":
    sys.exit(main())
