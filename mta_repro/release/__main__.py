import sys

from mta_repro.release.cli import main

sys.exit(main(sys.argv[1:]))
