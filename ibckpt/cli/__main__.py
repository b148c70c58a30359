"""`python -m ibckpt.cli`: the same command line as the `ibckpt` console script."""

import sys

from ibckpt.cli import main

sys.exit(main())
