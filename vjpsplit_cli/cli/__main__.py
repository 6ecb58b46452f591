"""``python -m vjpsplit_cli.cli``: the command line."""

import sys

from . import main

sys.exit(main())
