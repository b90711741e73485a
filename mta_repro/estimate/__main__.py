"""``python -m mta_repro.estimate``: the command line of ``mta_repro.estimate.cli``."""

import sys

from mta_repro.estimate.cli import cli

sys.exit(cli(sys.argv[1:]))
