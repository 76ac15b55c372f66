"""``python -m specjax ...``: the ``specjax`` command."""

import sys

from .cli import main

sys.exit(main())
