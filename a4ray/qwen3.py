"""python -m a4ray.qwen3: Qwen3-30B-A3B pretraining with Pai-Megatron-Patch (seed 002's run), as a pipeline.

stage (HF checkpoint, Pai's datasets, pinned Pai-Megatron-Patch) -> convert (Pai's converter) -> preflight
-> train (examples/qwen3/run_mcore_qwen3.sh on every node: TP4 PP2 EP4, selective recompute).
"""

import sys

from a4ray.driver import main as driver


def main(argv: list[str] | None = None) -> int:
    return driver.main("qwen3", argv, description=__doc__)


if __name__ == "__main__":
    sys.exit(main())
