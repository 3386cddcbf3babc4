#!/usr/bin/env bash
# Runs `python -m looped.main --jax_distributed FLAGS` on every worker of a Cloud TPU VM slice.
#
#   launch/tpu_vm.sh --tpu=NAME --zone=ZONE [--project=P] [--repo_dir=DIR] [--dry_run] \
#       -- --config=configs/pretrain.py --workdir=/mnt/shared/run
#
# Every worker must already have the checkout at --repo_dir (relative: to the home directory
# there; default 'looped') installed with jax[tpu]. jax.distributed.initialize() finds the
# slice's workers by itself. The workdir must be the same directory on every worker (an NFS /
# Filestore or gcsfuse mount): looped writes it with plain file I/O, not gs:// URLs.
# Options may also come from the environment: TPU_NAME, TPU_ZONE, TPU_PROJECT, REPO_DIR,
# PYTHON (default python3) and DRY_RUN=1 (print the command, run nothing; needs no gcloud).
set -euo pipefail

usage() {
  sed -n '2,12s/^# \{0,1\}//p' "$0" >&2
  exit 2
}

# An argument as the shell reads it: bare when safe, else single-quoted.
quote() {
  if [[ $1 =~ ^[A-Za-z0-9_./=:,@%+-]+$ ]]; then printf '%s' "$1"; else printf '%s' "${1@Q}"; fi
}

join_quoted() {
  local out=() arg
  for arg in "$@"; do out+=("$(quote "$arg")"); done
  printf '%s' "${out[*]}"
}

tpu=${TPU_NAME:-} zone=${TPU_ZONE:-} project=${TPU_PROJECT:-} repo_dir=${REPO_DIR:-looped}
python=${PYTHON:-python3} dry_run=${DRY_RUN:-0}
while (($#)); do
  case $1 in
    --tpu=*) tpu=${1#*=} ;;
    --zone=*) zone=${1#*=} ;;
    --project=*) project=${1#*=} ;;
    --repo_dir=*) repo_dir=${1#*=} ;;
    --python=*) python=${1#*=} ;;
    --dry_run) dry_run=1 ;;
    --) shift; break ;;
    -h|--help) usage ;;
    *) echo "tpu_vm.sh: unknown option $1 (looped.main flags go after --)" >&2; usage ;;
  esac
  shift
done
[[ -n $tpu && -n $zone ]] || { echo "tpu_vm.sh: --tpu and --zone are required" >&2; usage; }
(($#)) || { echo "tpu_vm.sh: no looped.main flags after --" >&2; usage; }

remote="cd $(quote "$repo_dir") && $(join_quoted "$python" -m looped.main --jax_distributed "$@")"
cmd=(gcloud compute tpus tpu-vm ssh "$tpu" "--zone=$zone")
[[ -z $project ]] || cmd+=("--project=$project")
cmd+=(--worker=all "--command=$remote")

echo "tpu_vm.sh: on every worker: $remote"
echo "tpu_vm.sh: $(join_quoted "${cmd[@]}")"
if [[ $dry_run == 1 ]]; then
  echo "tpu_vm.sh: dry run, nothing run."
  exit 0
fi
exec "${cmd[@]}"
