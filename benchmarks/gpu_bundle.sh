#!/usr/bin/env bash
# (For the benchmarks' GPU runs on a machine with no network; see benchmarks/README.md.)
# Build .gpu/ in the current repo: what a GPU machine (Python 3.12, no network) needs beyond its image
# to run a4ray with Ray. The Ray wheel (~80 MB) is too big to send along whole (64 MiB limit), so it is unpacked,
# stripped of parts a4ray never imports (Java jars, source maps, rllib/tune/serve/data) and xz-packed (~29 MB).
# Usage:  bash benchmarks/gpu_bundle.sh [extra-wheel-spec ...]     (e.g. megatron-core==0.19.2)
# Then send .gpu along with the working tree to the GPU machine, and start the command there with
#   source .gpu/activate.sh && <your command>
set -euo pipefail
RAY_VERSION=${RAY_VERSION:-2.60.0}
root=$(git rev-parse --show-toplevel)
cd "$root"
grep -qxF '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
rm -rf .gpu && mkdir -p .gpu/whl
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
dl() { python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform manylinux_2_24_x86_64 -d "$1" "${@:2}"; }
dl "$tmp" "ray==$RAY_VERSION"
mkdir "$tmp/ray" && (cd "$tmp/ray" && unzip -q "$tmp"/ray-*.whl)
rm -rf "$tmp"/ray/ray/jars "$tmp"/ray/ray/rllib "$tmp"/ray/ray/tune "$tmp"/ray/ray/serve "$tmp"/ray/ray/data
find "$tmp/ray" -name '*.map' -delete
tar -cf - -C "$tmp/ray" . | xz -T0 -6 > .gpu/ray.tar.xz
# Ray's and a4ray's pure dependencies that the GPU image lacks (it has torch, numpy, pyyaml, requests,
# huggingface-hub, grpcio, protobuf, msgpack, aiohttp, click, filelock, packaging, psutil).
dl .gpu/whl jsonschema referencing rpds-py jsonschema-specifications pydantic pydantic-core annotated-types typing-inspection "$@"
cat > .gpu/activate.sh <<'ACT'
# sourced on the GPU machine: unpack once per machine, then put it on PYTHONPATH
if [ ! -f ${TMPDIR:-/tmp}/a4ray-site/.ok ]; then
  mkdir -p ${TMPDIR:-/tmp}/a4ray-site && tar -xJf .gpu/ray.tar.xz -C ${TMPDIR:-/tmp}/a4ray-site \
  && python3 -m pip install -q --no-index --no-deps --no-compile --target ${TMPDIR:-/tmp}/a4ray-site .gpu/whl/*.whl \
  && touch ${TMPDIR:-/tmp}/a4ray-site/.ok
fi
export PYTHONPATH=${TMPDIR:-/tmp}/a4ray-site:$PWD${PYTHONPATH:+:$PYTHONPATH} PATH=${TMPDIR:-/tmp}/a4ray-site/bin:$PATH  # bin: console scripts of the wheels (py-spy)
# shared-host safety on multi-GPU machines: never enable NVLink multicast
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
ACT
du -sh .gpu; ls .gpu/whl
