"""``python -m ropekv``: the same command line as the ``ropekv`` script."""

import sys

from .cli.main import main

sys.exit(main())
