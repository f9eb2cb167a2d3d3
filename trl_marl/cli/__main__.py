"""`python -m trl_marl.cli`: the `trl-marl` command."""

import sys

from .command import main

sys.exit(main())
