"""python -m a4ray.qwen3_next: the Qwen3-Next-80B-A3B-Instruct workflow, stage -> convert -> preflight -> train.

On an A4 Ray cluster (`ray job submit -- python -m a4ray.qwen3_next`): stage the HF checkpoint, Pai's
datasets and a pinned Pai-Megatron-Patch; convert with Pai's distributed converter; check every node;
pretrain (or `--set train.mode=sft`: SFT from the Alpaca JSON) with Pai's run_mcore_qwen3.sh on every node.
With no cluster: the same pipeline rehearsed on an embedded local cluster (jobs/qwen3_next_local.yaml).
"""

import sys

from a4ray.driver import main as driver


def main(argv: list[str] | None = None) -> int:
    return driver.main("qwen3_next", argv, description=__doc__)


if __name__ == "__main__":
    sys.exit(main())
