#!/usr/bin/env bash
# a4ray pod launcher: the command of every Ray container a4ray renders for KubeRay (head and A4 workers).
#
#   1. Source the gIB NCCL env (set_nccl_env.sh) when present and put gIB's lib64 first on
#      LD_LIBRARY_PATH, so the raylet and every Ray worker process it starts inherit them.
#   2. Read the node's physical topology from the GCE metadata server (instance/attributes/physical_host,
#      "/<block>/<subblock>/<host>"), with a timeout. Without it the node gets no topology labels, and
#      the gang ranks it after the labelled nodes, by IP.
#   3. exec KubeRay's generated `ray start` (KUBERAY_GEN_RAY_START_CMD: head address, ports, CPUs, GPUs
#      and memory from the container's limits, the group's Ray resources and labels) with the topology
#      labels merged into --labels. The pod template carries `ray.io/overwrite-container-cmd: "true"`,
#      so KubeRay runs this script as is instead of appending its own `ray start`.
#
# No sshd and no SSH keys: everything after this goes through Ray.
#
# Environment (the manifest sets the A4RAY_* ones from the job spec; defaults are for hand use):
#   KUBERAY_GEN_RAY_START_CMD  set by KubeRay (required)
#   A4RAY_GIB                  on | off | auto (default auto: use gIB where the script exists)
#   A4RAY_GIB_SCRIPT           default /usr/local/gib/scripts/set_nccl_env.sh
#   A4RAY_TOPOLOGY_KEYS        Ray label keys for block,subblock,host (default GKE's gce-topology-* keys)
#   A4RAY_METADATA_URL         default http://169.254.169.254/computeMetadata/v1/instance/attributes/physical_host
#   A4RAY_METADATA_TIMEOUT_S   default 5
#   A4RAY_PHYSICAL_HOST        use this "/<block>/<subblock>/<host>" instead of asking the metadata server
set -euo pipefail

log() { printf 'a4ray-launcher: %s\n' "$*" >&2; }
die() {
  log "error: $*"
  exit 1
}

gib_mode=${A4RAY_GIB:-auto}
gib_script=${A4RAY_GIB_SCRIPT:-/usr/local/gib/scripts/set_nccl_env.sh}
topology_keys=${A4RAY_TOPOLOGY_KEYS:-cloud.google.com/gce-topology-block,cloud.google.com/gce-topology-subblock,cloud.google.com/gce-topology-host}
# The metadata server's IP, not metadata.google.internal: no DNS needed this early in the pod's life.
metadata_url=${A4RAY_METADATA_URL:-http://169.254.169.254/computeMetadata/v1/instance/attributes/physical_host}
metadata_timeout=${A4RAY_METADATA_TIMEOUT_S:-5}

# "first" at the front of the colon list in variable $1, once.
prepend_path() {
  local name=$1 first=$2 current entry out
  current=${!name:-}
  out=$first
  local IFS=:
  for entry in $current; do
    [[ -n $entry && $entry != "$first" ]] && out+=":$entry"
  done
  export "$name=$out"
}

setup_gib() {
  case $gib_mode in
    off)
      log "gIB: off (A4RAY_GIB=off)"
      return
      ;;
    on | auto) ;;
    *) die "A4RAY_GIB must be on, off or auto, got '$gib_mode'" ;;
  esac
  if [[ ! -f $gib_script ]]; then
    [[ $gib_mode == on ]] && die "A4RAY_GIB=on but $gib_script does not exist: is the gIB volume mounted at $(dirname "$(dirname "$gib_script")")?"
    log "gIB: $gib_script not found; Ray starts without the gIB NCCL env (A4RAY_GIB=auto)"
    return
  fi
  # A third-party script: it may read unset variables, and must not stop this one on its own errors.
  set +eu
  # shellcheck source=/dev/null
  source "$gib_script"
  local status=$?
  set -eu
  if ((status != 0)); then
    [[ $gib_mode == on ]] && die "sourcing $gib_script failed (exit $status)"
    log "gIB: sourcing $gib_script failed (exit $status); continuing without it (A4RAY_GIB=auto)"
    return
  fi
  local lib_dir
  lib_dir="$(dirname "$(dirname "$gib_script")")/lib64"
  prepend_path LD_LIBRARY_PATH "$lib_dir"
  log "gIB: sourced $gib_script (NCCL_NET=${NCCL_NET:-unset}); LD_LIBRARY_PATH starts with $lib_dir"
}

# Prints the node's physical_host, or nothing (with a note on stderr) when it cannot be had.
physical_host() {
  if [[ -n ${A4RAY_PHYSICAL_HOST:-} ]]; then
    printf '%s' "$A4RAY_PHYSICAL_HOST"
    return
  fi
  local value
  if ! value=$(curl --silent --show-error --fail --connect-timeout "$metadata_timeout" \
    --max-time "$metadata_timeout" -H 'Metadata-Flavor: Google' "$metadata_url" 2>&1); then
    log "topology: no physical_host from $metadata_url ($value); the node gets no topology labels and ranks after labelled nodes"
    return
  fi
  printf '%s' "$value"
}

label_value_ok() { [[ $1 =~ ^[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$ ]]; }

# "key=value,..." Ray labels for the node's block, subblock and host, or nothing.
topology_labels() {
  local location=$1 block subblock host extra
  [[ -n $location ]] || return 0
  IFS=/ read -r _ block subblock host extra <<<"$location"
  if [[ -n ${extra:-} ]] || ! label_value_ok "${block:-}" || ! label_value_ok "${subblock:-}" || ! label_value_ok "${host:-}"; then
    log "topology: physical_host '$location' is not /<block>/<subblock>/<host> of label-safe names; no topology labels"
    return 0
  fi
  local keys
  IFS=, read -r -a keys <<<"$topology_keys"
  ((${#keys[@]} == 3)) || die "A4RAY_TOPOLOGY_KEYS needs 3 keys (block,subblock,host), got '$topology_keys'"
  printf '%s=%s,%s=%s,%s=%s' "${keys[0]}" "$block" "${keys[1]}" "$subblock" "${keys[2]}" "$host"
}

main() {
  [[ -n ${KUBERAY_GEN_RAY_START_CMD:-} ]] ||
    die "KUBERAY_GEN_RAY_START_CMD is not set: this script is the Ray container command of a KubeRay pod"
  setup_gib

  # KubeRay's command is shell text (e.g. --resources='{"a4-highgpu-8g":1}'), written by the operator
  # into this pod's spec: parse it with the shell's own quoting rules.
  eval "set -- $KUBERAY_GEN_RAY_START_CMD"
  [[ ${1:-} == ray && ${2:-} == start ]] || die "KUBERAY_GEN_RAY_START_CMD is not a 'ray start' command: $KUBERAY_GEN_RAY_START_CMD"
  local -a argv=()
  local group_labels="" role=worker
  while (($#)); do
    case $1 in
      --labels=*) group_labels=${1#--labels=} ;;
      --labels)
        group_labels=${2:-}
        shift
        ;;
      *)
        [[ $1 == --head ]] && role="head"
        argv+=("$1")
        ;;
    esac
    shift
  done

  local location topo labels
  location=$(physical_host)
  topo=$(topology_labels "$location")
  # The node's own topology wins over a group label of the same key.
  labels=$group_labels
  if [[ -n $topo ]]; then
    labels=${labels:+$labels,}$topo
    log "topology: $location -> $topo"
  fi
  [[ -n $labels ]] && argv+=("--labels=$labels")

  ulimit -n "${RAY_START_ULIMIT_OPEN_FILES:-65536}" 2>/dev/null || log "could not raise the open-files limit"
  log "starting the Ray $role: ${argv[*]}"
  exec "${argv[@]}"
}

main "$@"
