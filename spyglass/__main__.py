"""`python -m spyglass ...` runs the same command line as the installed `spyglass` script: an entry point, on the
top floor with the command line it starts (cli/; nothing imports this module)."""

import sys

from cli.main import main

if __name__ == "__main__":
    sys.exit(main())
