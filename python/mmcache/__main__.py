"""``python -m mmcache``: the ``mmcache`` command."""

import sys

from mmcache.cli import main

if __name__ == "__main__":
    sys.exit(main())
