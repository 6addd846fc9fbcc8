"""``python -m davit_tools.devcluster``: see :mod:`davit_tools.devcluster.cli`."""

import sys

from .cli import devcluster_main

if __name__ == "__main__":
    sys.exit(devcluster_main(sys.argv[1:]))
