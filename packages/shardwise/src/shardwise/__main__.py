"""``python -m shardwise`` is the ``shardwise`` console script."""

from __future__ import annotations

import sys

from shardwise._session.info import main

if __name__ == "__main__":
    sys.exit(main())
