"""``python -m research.experiments``: see ``research.experiments.cli``."""

import sys

from .cli import main

sys.exit(main())
