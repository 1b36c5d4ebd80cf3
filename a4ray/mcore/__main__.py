"""python -m a4ray.mcore: the Megatron trainer's rank program (run it under torchrun; see training.py)."""

import sys

from a4ray.mcore.training import main

sys.exit(main())
