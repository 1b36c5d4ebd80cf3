#!/usr/bin/env bash
# The GPU proofs, in one call, each GPU one simulated node of an embedded cluster (on a 1-GPU machine: one
# simulated node, and no traffic between nodes, which needs a GPU per node):
#   ddp        the DDP test over NCCL                                    (python -m a4ray.ddp_test)
#   nccl       all_reduce busbw through the gang vs torchrun (2+ GPUs)  (benchmarks/nccl_gang_vs_torchrun.py)
#   qwen3      the Qwen3-MoE rehearsal: stage, native convert, Megatron trainer over NCCL in bf16, checkpoints
#              every 10 iterations, each loaded back and compared       (python -m a4ray.qwen3)
#   resume     the same run asked for 40 iterations: it resumes from iteration 30's checkpoint
#   killed     (2+ GPUs) the Qwen3-MoE rehearsal, expert parallel across the 2 nodes, with rank 1 SIGKILLed after
#              the first checkpoint: the restart policy relaunches the gang, which resumes from the newest one
#   step_time  (2+ GPUs) Megatron step time through the gang against bare torchrun (benchmarks/megatron_step.py)
#   doctor     (2+ GPUs) the doctor's network check across the nodes: NCCL's transport and the busbw verdict
#   qwen3_next the Qwen3-Next rehearsal: Qwen3-Next-tiny itself, converted (logits verified), 30 iterations on
#              the gated-delta-rule path that is right on this GPU (the trainer's log says which and why)
#   next_resume the same asked for 40 iterations: it resumes from iteration 30's checkpoint
#   next_kernels FLA's forward against megatron-core's torch reference (and transformers) on this GPU, from
#              the rehearsal's conversion, and what FLA's gated backward does here (benchmarks/qwen3_next_kernels.py)
#   next_step  the small Qwen3-Next's Megatron step time, gang and torchrun (benchmarks/megatron_step.py)
#   carried    megatron-core here (0.19.x) from what 0.16.1 made on a CPU (.gpu-carry/, when carried): training
#              from its converted checkpoint, and continuing its own trained checkpoint (fp32, as saved)
# Logs and result JSON go to $OUT (or /tmp/a4ray-gpu-proof); ONLY="qwen3 resume" runs just those. Needs Ray:
# `source .gpu/activate.sh` first (bash benchmarks/gpu_bundle.sh megatron-core==0.19.2 builds .gpu/).
set -uo pipefail
out=${OUT:-/tmp/a4ray-gpu-proof}
mkdir -p "$out"
export RAY_TMPDIR=${RAY_TMPDIR:-/tmp/r} PYTHONUNBUFFERED=1
nvidia-smi -L | tee "$out/gpus.txt"
echo "NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-unset}" | tee -a "$out/gpus.txt"
python -c "import torch, megatron.core; print('torch', torch.__version__, 'megatron-core', megatron.core.__version__)" \
  | tee -a "$out/gpus.txt"

want() {  # name: this step runs (ONLY is unset, or names it)
  [ -z "${ONLY:-}" ] || [[ " $ONLY " == *" $1 "* ]]
}
step() {  # name, command...: run it, keep its log, show its tail
  local name=$1; shift
  want "$name" || return 0
  echo "=== $name: $*"
  local t0=$SECONDS
  "$@" > "$out/$name.log" 2>&1
  local rc=$?
  grep -vE '^\[n[0-9]+( r[0-9]+)?\] ' "$out/$name.log" | grep -vE '^(┃|│|┏|┡|└)' | tail -n 12
  echo "=== $name: exit $rc in $((SECONDS - t0))s"
}
kill_rank_1_after_first_checkpoint() {  # save dir: SIGKILL rank 1's trainer once iter_0000010 exists
  local save=$1 pid
  for _ in $(seq 3000); do
    if [ -d "$save/iter_0000010" ]; then
      for pid in $(pgrep -f "a4ray.mcore .*$save"); do
        if tr '\0' '\n' < "/proc/$pid/environ" 2>/dev/null | grep -qx 'RANK=1'; then
          kill -9 "$pid" && echo "killed rank 1 (pid $pid) after $save/iter_0000010" && return
        fi
      done
    fi
    sleep 0.1
  done
}
iterations() {  # name: the first and last iteration lines of its log
  [ -f "$out/$1.log" ] || return 0
  grep -E 'iteration +[0-9]+/' "$out/$1.log" | head -n 1 | cut -c1-330
  grep -E 'iteration +[0-9]+/' "$out/$1.log" | tail -n 1 | cut -c1-330
}

gpus=$(nvidia-smi -L | grep -c '^GPU ')
nodes=$(( gpus >= 2 ? 2 : 1 ))
ws=/tmp/a4ray-ws
shape=(--local-nodes "$nodes" --gpus-per-node 1 --set "storage.local_workspace=$ws")
step ddp python -m a4ray.ddp_test "${shape[@]}" --result "$out/ddp.json"
if [ "$nodes" -ge 2 ]; then
  step nccl python benchmarks/nccl_gang_vs_torchrun.py --nodes 2 --gpus-per-node 1 -b 1G -e 8G
else
  echo "=== nccl: not run: busbw between simulated nodes needs one GPU per node, this machine has $gpus"
fi
megatron=(--set "train.megatron.parallel.ep=$nodes" --set train.megatron.check_save=true)
step qwen3 python -m a4ray.qwen3 "${shape[@]}" "${megatron[@]}" --result "$out/qwen3.json"
iterations qwen3
grep -E 'check-save|loaded model weights|distributed optimizer' "$out/qwen3.log" 2>/dev/null | head -n 4 | cut -c1-250
step resume python -m a4ray.qwen3 "${shape[@]}" "${megatron[@]}" --set train.iterations=40 --result "$out/resume.json"
grep -E 'resuming from checkpoint' "$out/resume.log" 2>/dev/null | head -n 1 | cut -c1-250
iterations resume
if [ "$nodes" -ge 2 ]; then
  killed_ws=/tmp/a4ray-ws-killed
  if want killed; then
    kill_rank_1_after_first_checkpoint "$killed_ws/logs/output_megatron_qwen3_pretrain/checkpoint" > "$out/killer.txt" &
  fi
  step killed python -m a4ray.qwen3 --local-nodes 2 --gpus-per-node 1 --set "storage.local_workspace=$killed_ws" \
    --set train.megatron.parallel.ep=2 --set restart.max_restarts=1 --set restart.backoff_s=1 --result "$out/killed.json"
  wait
  cat "$out/killer.txt" 2>/dev/null
  grep -E 'relaunching on a new gang|resuming from checkpoint' "$out/killed.log" 2>/dev/null | head -n 3 | cut -c1-250
  iterations killed
  step step_time python benchmarks/megatron_step.py --nodes 2 --gpus-per-node 1 --rounds 3 --iters 30 --dir /tmp/mbench
  step doctor python -m a4ray.cli doctor --local-nodes 2 --gpus-per-node 1 --set "storage.local_workspace=$ws" \
    --result "$out/doctor.json"
  grep -E 'network|NET/|transport' "$out/doctor.log" 2>/dev/null | head -n 6 | cut -c1-250
else
  echo "=== killed, step_time, doctor: not run: they need one GPU per node and 2 nodes, this machine has $gpus"
fi
step qwen3_next python -m a4ray.qwen3_next "${shape[@]}" "${megatron[@]}" --result "$out/qwen3_next.json"
grep -E 'convert: verify|a4ray.mcore: (model|gated delta rule)' "$out/qwen3_next.log" 2>/dev/null | head -n 3 | cut -c1-400
iterations qwen3_next
step next_resume python -m a4ray.qwen3_next "${shape[@]}" "${megatron[@]}" --set train.iterations=40 \
  --result "$out/next_resume.json"
grep -E 'resuming from checkpoint' "$out/next_resume.log" 2>/dev/null | head -n 1 | cut -c1-250
iterations next_resume
step next_kernels python benchmarks/qwen3_next_kernels.py "$ws/ckpts/huggingface/Qwen3-Next-tiny-to-mcore/latest" \
  "$ws/ckpts/huggingface/Qwen3-Next-tiny" --out "$out/next_kernels.json"
step next_step python benchmarks/megatron_step.py --nodes 1 --gpus-per-node 1 --family next --size small \
  --rounds "${NEXT_ROUNDS:-2}" --iters 20 --dir /tmp/nbench

carry=.gpu-carry/.a4ray
if [ -d "$carry" ]; then
  data=$carry/datasets/qwen-mmap/mmap_qwen3_datasets_text_document
  model=$carry/ckpts/huggingface/Qwen3-MoE-tiny
  rm -rf /tmp/carried && mkdir -p /tmp/carried && cp -r $carry/logs/output_megatron_qwen3_pretrain/checkpoint /tmp/carried/resumed
  args=(--model "$model" --data-path "$data" --seq-length 64 --micro-batch-size 4 --global-batch-size 4 --lr 3e-3
        --min-lr 3e-4 --lr-warmup-iters 3 --save-interval 10 --check-save)
  step carried_convert python -m torch.distributed.run --nproc-per-node 1 -m a4ray.mcore "${args[@]}" \
    --load "$carry/ckpts/huggingface/Qwen3-MoE-tiny-to-mcore/latest" --save /tmp/carried/fresh --train-iters 20
  grep -E 'loaded model weights|check-save' "$out/carried_convert.log" 2>/dev/null | head -n 2 | cut -c1-250
  iterations carried_convert
  step carried_resume python -m torch.distributed.run --nproc-per-node 1 -m a4ray.mcore "${args[@]}" \
    --save /tmp/carried/resumed --train-iters 40 --precision fp32
  grep -E 'resuming from checkpoint|check-save' "$out/carried_resume.log" 2>/dev/null | head -n 2 | cut -c1-250
  iterations carried_resume
fi
