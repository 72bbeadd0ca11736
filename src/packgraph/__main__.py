"""``python -m packgraph``: the same as the ``packgraph`` console script."""

import sys

from packgraph.cli import main

if __name__ == "__main__":
    sys.exit(main())
