#!/usr/bin/env bash
# The A4 shape in miniature on GPUs: 2 simulated nodes x 2 GPUs, NCCL, expert parallelism across the nodes
# (needs 4 GPUs; with 2, 2 nodes x 1 GPU). Each step's log and JSON go to $OUT; ONLY="killed dead_rank" runs those.
#   killed      the Qwen3-Next rehearsal (stage, native convert, Megatron trainer), rank 1 SIGKILLed after
#               checkpoint 10: the gang stops, relaunches and resumes from 10 to 30 (benchmarks/rank_kill.py)
#   killed_save the same rehearsal again (staging and conversion cached), rank 1 SIGKILLed while a checkpoint is
#               being written: the partial one is skipped, naming it, and the relaunch resumes from the one before
#   dead_rank   benchmarks/resilience.py's dead rank on NCCL: kill -> death seen, every process gone, new gang,
#               first iteration; and the same kill under bare torchrun (capped: its peers block in NCCL)
#   hang        benchmarks/hang_verdicts.py: a plain NCCL program whose culprit skips an all-reduce, at each local
#               rank position, and frozen: the verdict names only the culprit, on evidence (or is undetermined)
#   straggler   benchmarks/straggler_ep.py: the Megatron trainer with EP across the nodes, one rank duty-cycled
#   step_time   benchmarks/megatron_step.py on 2 nodes x 1 GPU, 6 rounds: the gang / torchrun ratio and its spread
# Needs Ray: `source .gpu/activate.sh` first (bash benchmarks/gpu_bundle.sh megatron-core==0.19.2
# flash-linear-attention==0.6.0 fla-core==0.6.0 builds .gpu/).
set -uo pipefail
out=${OUT:-/tmp/a4ray-gpu-shape}
mkdir -p "$out"
export RAY_TMPDIR=${RAY_TMPDIR:-/tmp/r} PYTHONUNBUFFERED=1
nvidia-smi -L | tee "$out/gpus.txt"
python -c "import torch; print('torch', torch.__version__, 'nccl', torch.cuda.nccl.version())" | tee -a "$out/gpus.txt"
gpus=$(nvidia-smi -L | grep -c '^GPU ')
g=$(( gpus >= 4 ? 2 : 1 ))
want() { [ -z "${ONLY:-}" ] || [[ " $ONLY " == *" $1 "* ]]; }
step() {  # name, command...: run it, keep its log, show what is not a rank's line
  local name=$1; shift
  want "$name" || return 0
  echo "=== $name: $*"
  local t0=$SECONDS
  "$@" > "$out/$name.log" 2>&1
  local rc=$?
  grep -vE '^\[n[0-9]+( r[0-9]+)?\] ' "$out/$name.log" | grep -vE '^(┃|│|┏|┡|└)' | tail -n "${TAIL:-14}" | cut -c1-400
  echo "=== $name: exit $rc in $((SECONDS - t0))s"
}
work=/tmp/a4ray-kill
step killed python benchmarks/rank_kill.py --when after --nodes 2 --gpus-per-node $g --dir $work
grep -hE 'gpus=|GPUs .* (free|still)' "$out/killed.log" $work/.a4ray/runs/*/logs/train/node-*.log 2>/dev/null | sort -u | head -n 8 | cut -c1-200
step killed_save python benchmarks/rank_kill.py --when during --nodes 2 --gpus-per-node $g --dir $work
step dead_rank python benchmarks/resilience.py --only dead_rank --gpus-per-node $g --step-s 0.3 --torchrun-cap-s ${CAP:-45}
[ -f benchmarks/hang_verdicts.py ] && step hang python benchmarks/hang_verdicts.py --gpus-per-node $g
[ -f benchmarks/straggler_ep.py ] && step straggler python benchmarks/straggler_ep.py --gpus-per-node $g
step step_time python benchmarks/megatron_step.py --nodes 2 --gpus-per-node 1 --rounds ${ROUNDS:-6} --iters 20 --dir /tmp/mbench
echo "=== leftovers: $(pgrep -fc 'a4ray.mcore|a4ray.runtime.ranks' || true) a4ray processes; GPU memory:"
nvidia-smi --query-gpu=index,memory.used --format=csv,noheader
