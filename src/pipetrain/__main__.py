"""`python -m pipetrain` runs the command-line interface."""

import sys

from pipetrain.cli.main import main

if __name__ == "__main__":  # spawned ranks re-import this module as __mp_main__
    sys.exit(main())
