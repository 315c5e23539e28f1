"""``python -m dualpath.cli``: the same as the ``dualpath`` console script."""

import sys

from dualpath.cli import main

sys.exit(main())
