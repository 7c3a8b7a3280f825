import sys

from lmjax.cli import main

sys.exit(main())
