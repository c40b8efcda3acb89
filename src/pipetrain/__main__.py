"""`python -m pipetrain` runs the command-line interface."""

import sys

from pipetrain.cli.main import main

sys.exit(main())
