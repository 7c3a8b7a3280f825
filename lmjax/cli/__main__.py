"""`python -m lmjax.cli`: the `lmjax` console script."""

import sys

from lmjax.cli import main

sys.exit(main())
