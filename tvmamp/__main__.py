"""``python -m tvmamp`` runs the command line."""

import sys

from tvmamp.cli import main

sys.exit(main())
