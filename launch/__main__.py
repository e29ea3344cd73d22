"""`python -m ssd.launch ...`: see ssd.launch.cli."""

import sys

from ssd.launch.cli import main

sys.exit(main())
