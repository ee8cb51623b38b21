"""`python -m autopar` runs the command line."""

import sys

from autopar.cli import main

if __name__ == "__main__":  # spawned ranks re-import this module: run only in the parent
    sys.exit(main())
