"""python -m a4ray.swift_dpo: DPO of Qwen3-30B-A3B-Instruct-2507 with ms-swift (seed 004), as a pipeline.

stage (HF checkpoint) -> convert (`swift export --to_mcore`, for ms-swift < 3.12 only) -> preflight -> train
(`megatron rlhf --rlhf_type dpo` on every node, flags for `train.version`, MODELSCOPE_CACHE on the workspace).
"""

import sys

from a4ray.driver import main as driver


def main(argv: list[str] | None = None) -> int:
    return driver.main("swift_dpo", argv, description=__doc__)


if __name__ == "__main__":
    sys.exit(main())
