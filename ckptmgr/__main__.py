"""``python -m ckptmgr``: the ``ckptmgr`` command line."""

import sys

from .cli import main

sys.exit(main())
