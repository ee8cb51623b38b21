"""`python -m autopar` runs the command line."""

import sys

from autopar.cli import main

sys.exit(main())
