"""``python -m transports.bench``: the same as ``wbridge bench transport``."""

import sys

from .cli import main

sys.exit(main())
