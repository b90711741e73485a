import sys

from mta_repro.eval.run import main

sys.exit(main())
