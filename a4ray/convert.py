"""python -m a4ray.convert -f SPEC: convert a Hugging Face checkpoint to Megatron-core, as `a4ray convert`.

Natively (Ray tasks over layer ranges: Qwen3, Qwen3-MoE, Qwen3-Next), with Pai-Megatron-Patch's converter
on every node, or with ms-swift; verified (logits and an exact round trip of every tensor) and cached: a
second run with the same input and options does nothing. `--dry-run` prints the plan.
"""

import sys

from a4ray.driver import main as driver


def main(argv: list[str] | None = None) -> int:
    return driver.main("convert", argv, description=__doc__)


if __name__ == "__main__":
    sys.exit(main())
