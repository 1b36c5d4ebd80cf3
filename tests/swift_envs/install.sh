#!/bin/bash
# Install ms-swift VERSION into .venv-swift/VERSION once (tests/test_swift_contract.py parses a4ray's commands
# with it): every package pinned in tests/swift_envs/ms-swift-VERSION.txt, --no-deps, so pip's resolver never
# runs (left free, it spent 9+ CPU-minutes on ms-swift 3.8.0 beside a4ray's torch). Done when the marker holds
# the requirement file it was installed from; a changed file reinstalls. Prints the time it took.
set -euo pipefail
version=$1
root=$(cd "$(dirname "$0")/../.." && pwd)
req=$root/tests/swift_envs/ms-swift-$version.txt
venv=$root/.venv-swift/$version
marker=$venv/.installed
[ -f "$req" ] || { echo "no $req" >&2; exit 2; }
mkdir -p "$root/.venv-swift"
exec 9>"$root/.venv-swift/.lock-$version"
flock 9  # one installer per version at a time (parallel test runs, make)
if [ -f "$marker" ] && cmp -s "$req" "$marker"; then exit 0; fi
start=$(date +%s)
rm -rf "$venv"
python3 -m venv "$venv"
# (pip warns about each package missing from this machine's local indexes: noise, left out)
timeout 900 "$venv/bin/pip" install -q --no-input --no-deps --disable-pip-version-check -r "$req" 2>&1 \
  | { grep -v "is ignored: it is neither a file nor a directory" || true; }
cp "$req" "$marker"
echo "ms-swift $version: installed into $venv in $(( $(date +%s) - start ))s ($(grep -c '==' "$req") pinned packages, --no-deps)"
