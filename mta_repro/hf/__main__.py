import sys

from mta_repro.hf.cli import main

sys.exit(main())
