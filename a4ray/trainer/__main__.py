"""python -m a4ray.trainer: the built-in trainer (run it under torchrun; see a4ray.trainer.loop)."""

import sys

from a4ray.trainer.loop import main

sys.exit(main())
