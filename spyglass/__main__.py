"""`python -m spyglass ...` runs the same command line as the installed `spyglass` script."""

import sys

from spyglass.cli import main

if __name__ == "__main__":
    sys.exit(main())
