#!/usr/bin/env bash
# Starts `tjax train --distributed` on every worker of an existing Cloud TPU VM slice, all at once
# (one process per worker; jax.distributed.initialize() finds the others through the TPU metadata).
# Creates nothing: the TPU VM and the shared run directory must exist (see README.md).
#
# Usage, from the repository root on your workstation (gcloud installed and logged in):
#   TPU_NAME=my-v5p-32 ZONE=us-east5-a RUN_DIR=/mnt/shared/runs/owt \
#     experiments/launch/tpu_pod.sh experiments/gpt2_small_owt.yaml data.path=/mnt/shared/owt-gpt2
#
# Environment:
#   TPU_NAME, ZONE  the slice (required)
#   PROJECT         its Google Cloud project (default: gcloud's configured project)
#   RUN_DIR         run directory on storage every worker mounts at this same path (required)
#   JAX_VERSION     JAX to install with its TPU runtime (default 0.10.2, libtpu from PyPI)
#   PYTHON          interpreter on the workers (default python3.11; installed with apt if missing)
#   REMOTE_DIR      where the code goes on each worker (default: transformer_jax in the home dir)
#   DETACH=1        start training in the background (nohup, log in ~/tjax_train.log on each worker)
#                   instead of streaming every worker's output until it ends
set -euo pipefail

: "${TPU_NAME:?set TPU_NAME to the TPU VM slice name}"
: "${ZONE:?set ZONE to the slice zone}"
: "${RUN_DIR:?set RUN_DIR to a run directory on storage that every worker mounts (NFS, gcsfuse)}"
if [[ $# -lt 1 ]]; then
  echo "usage: $0 CONFIG.yaml [key=value ...]" >&2
  exit 2
fi
JAX_VERSION=${JAX_VERSION:-0.10.2}
PYTHON=${PYTHON:-python3.11}
REMOTE_DIR=${REMOTE_DIR:-transformer_jax}
GCLOUD_TPU=(gcloud compute tpus tpu-vm)
TARGET=(--zone="$ZONE" --worker=all)
if [[ -n "${PROJECT:-}" ]]; then TARGET+=(--project="$PROJECT"); fi

cd "$(dirname "$0")/../.."

# 1. The code, as committed (HEAD), to every worker.
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
archive=$tmp/tjax.tar.gz
git archive --format=tar.gz -o "$archive" HEAD
"${GCLOUD_TPU[@]}" scp "$archive" "$TPU_NAME:tjax.tar.gz" "${TARGET[@]}"

# 2. One command for every worker: unpack, install, train (arguments quoted for the remote
# shell).
train_args=$(printf ' %q' "$@" "run_dir=$RUN_DIR")
remote=$(cat <<REMOTE
set -euo pipefail
if ! $PYTHON -c 'import ensurepip' 2>/dev/null; then
  sudo apt-get update -q && sudo apt-get install -y -q ${PYTHON}-venv
fi
mkdir -p $REMOTE_DIR && tar -xzf ~/tjax.tar.gz -C $REMOTE_DIR && cd $REMOTE_DIR
[[ -x .venv/bin/python ]] || $PYTHON -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e . "jax[tpu]==$JAX_VERSION"
REMOTE
)
if [[ "${DETACH:-0}" == 1 ]]; then
  remote+=$'\n'"nohup .venv/bin/tjax train$train_args --distributed --no-progress \
    > ~/tjax_train.log 2>&1 < /dev/null &"
  remote+=$'\n'"echo \"\$(hostname): training in the background, log in ~/tjax_train.log\""
else
  remote+=$'\n'".venv/bin/tjax train$train_args --distributed --no-progress"
fi
"${GCLOUD_TPU[@]}" ssh "$TPU_NAME" "${TARGET[@]}" --command="$remote"
