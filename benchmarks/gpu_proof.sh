#!/usr/bin/env bash
# The GPU proofs, in one call on a machine with 2 GPUs, each GPU one simulated node of an embedded cluster
# (on a 1-GPU machine: one simulated node, and no busbw comparison, which needs traffic between two GPUs):
#   1. the DDP test over NCCL                          (python -m a4ray.ddp_test)
#   2. all_reduce busbw through the gang vs torchrun   (benchmarks/nccl_gang_vs_torchrun.py)
#   3. the Qwen3-Next rehearsal's trainer over NCCL    (python -m a4ray.qwen3_next)
# Logs and result JSON go to $OUT (or /tmp/a4ray-gpu-proof). Needs Ray: `source .gpu/activate.sh` first
# (bash ../shared/tools/gpu-bundle.sh megatron-core==0.19.2 builds .gpu/).
set -uo pipefail
out=${OUT:-/tmp/a4ray-gpu-proof}
mkdir -p "$out"
export RAY_TMPDIR=${RAY_TMPDIR:-/tmp/r} PYTHONUNBUFFERED=1
nvidia-smi -L | tee "$out/gpus.txt"
echo "NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-unset}" | tee -a "$out/gpus.txt"

step() {  # name, command...: run it, keep its log, show its tail
  local name=$1; shift
  echo "=== $name: $*"
  local t0=$SECONDS
  "$@" > "$out/$name.log" 2>&1
  local rc=$?
  grep -vE '^\[n[0-9]+( r[0-9]+)?\] ' "$out/$name.log" | tail -n 25
  echo "=== $name: exit $rc in $((SECONDS - t0))s"
}

gpus=$(nvidia-smi -L | grep -c '^GPU ')
nodes=$(( gpus >= 2 ? 2 : 1 ))
step ddp python -m a4ray.ddp_test --local-nodes "$nodes" --gpus-per-node 1 --result "$out/ddp.json"
if [ "$nodes" -ge 2 ]; then
  step nccl python benchmarks/nccl_gang_vs_torchrun.py --nodes 2 --gpus-per-node 1 -b 1G -e 8G
else
  echo "=== nccl: not run: busbw between simulated nodes needs one GPU per node, this machine has $gpus"
fi
step rehearsal python -m a4ray.qwen3_next --local-nodes "$nodes" --gpus-per-node 1 --set storage.local_workspace=/tmp/a4ray-ws
grep -E 'iteration +[0-9]+/' "$out/rehearsal.log" | head -n 3
grep -E 'iteration +[0-9]+/' "$out/rehearsal.log" | tail -n 2
