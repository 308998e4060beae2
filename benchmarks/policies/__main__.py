"""``python -m benchmarks.policies``: the adaptive policies against fixed drafter / length pairs."""

import sys

from .bench import main

sys.exit(main())
