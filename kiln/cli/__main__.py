"""`python -m kiln.cli ...` is the `kiln` command too (as `python -m kiln`)."""

import sys

from kiln.cli import main

sys.exit(main())
