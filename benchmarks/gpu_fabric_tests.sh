#!/bin/bash
# The fabric tests' GPU proof in one call, on a machine with 2+ GPUs and no image prepared (no nccl-tests, no
# DeepEP): a4ray builds both on the nodes from their pinned sources, runs them through the gang, and runs them
# again (cache hits). Where the machine has no network, the sources come from local git mirrors holding the
# pinned commits (build/upstream/*.git, carried with the checkout); elsewhere leave SOURCES=github.
#   source .gpu/activate.sh && bash benchmarks/gpu_fabric_tests.sh        # OUT=dir for the outputs
# Steps (each bounded; one failing does not stop the others):
#   nccl      benchmarks/nccl_gang_vs_mpirun.py: nccl-tests built, 2 simulated nodes x 1 GPU through the gang,
#             then the same binaries under bare mpirun on the same GPUs (busbw, gang/bare)
#   deepep    python -m a4ray.deepep_test -f jobs/deepep_test_local.yaml: DeepEP built, intranode and
#             low-latency on 1 node x 2 GPUs
#   again     both once more: the builds are cache hits
set -u
OUT=${OUT:-/tmp/a4ray-fabric}
mkdir -p "$OUT"
if [ "${SOURCES:-mirror}" = mirror ]; then
  NCCL_SRC="git+file://$PWD/build/upstream/nccl-tests.git@da0b547b1b9c6e3b1d4c15578087874522ae3761"
  DEEPEP_SRC="git+file://$PWD/build/upstream/DeepEP.git@8a07e7e7ed57cfc63005f670d64d410cb30b061b"
  NCCL_SET=(--set "nccl.build.source=$NCCL_SRC"); DEEPEP_SET=(--set "deepep.build.source=$DEEPEP_SRC")
  BENCH_SET=(--source "$NCCL_SRC")
else
  NCCL_SET=(); DEEPEP_SET=(); BENCH_SET=()
fi

step() {
  local name=$1 limit=$2; shift 2
  echo "=== $name: $*"
  local t0=$SECONDS
  timeout "$limit" "$@" >"$OUT/$name.txt" 2>&1
  echo "=== $name: exit $? after $((SECONDS - t0)) s"
  tail -n 40 "$OUT/$name.txt"
}

{
  nvidia-smi --query-gpu=name,compute_cap,driver_version --format=csv
  /usr/local/cuda/bin/nvcc --version | tail -n 2
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
  python3 -m pip list 2>/dev/null | grep -i -E "nvidia-nccl|nvshmem|^torch |ninja"
  command -v mpirun mpicc ninja
  mpirun --version 2>&1 | head -n 1
  ls /usr/local/cuda/include/cccl/cuda/std/tuple
  python3 -c "import ctypes.util; print('libibverbs:', ctypes.util.find_library('ibverbs'))"
  nproc
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

# What decides how mpirun launches here (the 2 x H200 sandbox sets OMPI_MCA_plm=isolated: a4ray asks for rsh).
{ env | grep -i -E "^(ompi|orte|opal|pmix|prte|slurm|pbs|hydra)"; grep -v '^#' /etc/openmpi/openmpi-mca-params.conf 2>/dev/null \
  | grep .; } >"$OUT/mpi_env.txt" 2>&1

step nccl 300 python3 benchmarks/nccl_gang_vs_mpirun.py --nodes 2 --gpus-per-node 1 "${BENCH_SET[@]}" --out "$OUT/nccl"
step deepep 420 python3 -m a4ray.deepep_test -f jobs/deepep_test_local.yaml "${DEEPEP_SET[@]}" --result "$OUT/deepep.json"
step nccl_again 120 python3 -m a4ray.nccl_test -f jobs/nccl_test_local.yaml "${NCCL_SET[@]}" \
  --set "nccl.collectives=[all_reduce]" --set nccl.max_bytes=1G --result "$OUT/nccl_again.json"
step deepep_again 120 python3 -m a4ray.deepep_test -f jobs/deepep_test_local.yaml "${DEEPEP_SET[@]}" \
  --set "deepep.tests=[low_latency]" --result "$OUT/deepep_again.json"

# Every run's logs (node logs, build logs, the MPI hostfiles) and every output above, in one archive.
find .a4ray/runs -path '*/logs/*' \( -name '*.log' -o -name 'hostfile-*' \) -size -4M -print0 \
  | tar --null -czf "$OUT/runs.tgz" -T -
tar -czf "$OUT/../fabric-out.tgz" -C "$OUT" . && rm -rf "${OUT:?}"/* && mv "$OUT/../fabric-out.tgz" "$OUT/"
ls -la "$OUT"
