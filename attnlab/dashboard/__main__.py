"""``python -m attnlab.dashboard PATH``."""

import sys

from attnlab.dashboard.cli import main

sys.exit(main())
