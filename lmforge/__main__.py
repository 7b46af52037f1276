"""`python -m lmforge ...` (what torchrun launches) is the same as the `lmforge` command."""

import sys

from lmforge.cli.main import main

sys.exit(main())
