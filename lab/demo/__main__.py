"""``python -m lab.demo`` from the repository root (``make demo``): the CPU demo."""

import sys

from lab.demo.cli import main

sys.exit(main())
