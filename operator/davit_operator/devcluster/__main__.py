"""``python -m davit_operator.devcluster``: see :mod:`davit_operator.devcluster.cli`."""

import sys

from .cli import devcluster_main

if __name__ == "__main__":
    sys.exit(devcluster_main(sys.argv[1:]))
