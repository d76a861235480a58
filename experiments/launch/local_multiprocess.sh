#!/usr/bin/env bash
# NUM_PROCESSES `tjax train` processes on this machine (default 2), DEVICES_PER_PROCESS simulated
# CPU devices each (default 4), joined by jax.distributed on 127.0.0.1 (gloo collectives): the
# multi-host code path without a cluster.
#
# Usage (paths relative to the repository root):
#   [NUM_PROCESSES=N] [DEVICES_PER_PROCESS=D] experiments/launch/local_multiprocess.sh \
#     [CONFIG.yaml [key=value ...]]
# Default: experiments/gpt_tiny.yaml for 20 steps into runs/gpt_tiny_2proc, without its learning bar
# (too few steps to reach it). A CONFIG without a run_dir=DIR override runs in a folder of its own,
# $RUN_LOG_DIR/NAME_Nproc (NAME: the config's file name, N: NUM_PROCESSES), never in the
# single-process run's folder (which a finished run would leave untouched). Starting the same
# run_dir again with another NUM_PROCESSES x DEVICES_PER_PROCESS resumes it on that topology.
# Process 0 prints to the terminal, process i > 0 logs to $RUN_LOG_DIR/process<i>.log.
# Environment: PYTHON (default .venv/bin/python when it exists), NUM_PROCESSES (2),
# DEVICES_PER_PROCESS (4), PORT (default: a free one), RUN_LOG_DIR (runs).
set -euo pipefail

cd "$(dirname "$0")/../.."
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
NUM_PROCESSES=${NUM_PROCESSES:-2}
DEVICES_PER_PROCESS=${DEVICES_PER_PROCESS:-4}
RUN_LOG_DIR=${RUN_LOG_DIR:-runs}
for name in NUM_PROCESSES DEVICES_PER_PROCESS; do
  if ! [[ ${!name} =~ ^[1-9][0-9]*$ ]]; then
    echo "local_multiprocess: $name=${!name} must be a whole number >= 1" >&2
    exit 2
  fi
done

if [[ $# -eq 0 ]]; then
  set -- experiments/gpt_tiny.yaml run_dir=runs/gpt_tiny_2proc train.steps=20 train.log_every=5 \
    train.eval_every=20 train.eval_batches=4 train.checkpoint_every=10 train.samples=0 \
    "bars={}"
fi
CONFIG=$1
shift
if [[ " $* " != *" run_dir="* ]]; then
  name=$(basename "$CONFIG")
  set -- "$@" "run_dir=$RUN_LOG_DIR/${name%.*}_${NUM_PROCESSES}proc"
  echo "local_multiprocess: ${*: -1} (give run_dir=DIR to choose)" >&2
fi

# The dataset is prepared once, by one process, before the job starts (a multi-process job expects
# data.path to exist on every host).
"$PYTHON" - "$CONFIG" "$@" <<'PY'
import sys
from transformer_jax.train import load_experiment
from transformer_jax.train.checks import ensure_dataset
ensure_dataset(load_experiment(sys.argv[1], sys.argv[2:]))
PY

if [[ -z "${PORT:-}" ]]; then
  PORT=$("$PYTHON" -c 'import socket
s = socket.socket()
s.bind(("127.0.0.1", 0))
print(s.getsockname()[1])')
fi
export JAX_PLATFORMS=cpu
export JAX_NUM_CPU_DEVICES=$DEVICES_PER_PROCESS
export JAX_CPU_COLLECTIVES_IMPLEMENTATION=gloo
mkdir -p "$RUN_LOG_DIR"

pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
}
trap cleanup EXIT INT TERM

for ((i = NUM_PROCESSES - 1; i >= 0; i--)); do
  cmd=("$PYTHON" -m transformer_jax.cli train "$CONFIG" "$@" --no-progress
       --coordinator-address "127.0.0.1:$PORT" --num-processes "$NUM_PROCESSES" --process-id "$i")
  if ((i == 0)); then
    "${cmd[@]}" &
  else
    "${cmd[@]}" > "$RUN_LOG_DIR/process$i.log" 2>&1 &
  fi
  pids+=("$!")
done

# The first process to fail takes the others down (they would wait for it at the next collective).
status=0
for _ in "${pids[@]}"; do
  rc=0
  wait -n || rc=$?
  if ((rc != 0)); then
    if ((status == 0)); then status=$rc; fi
    cleanup
  fi
done
pids=()
if ((status != 0)); then
  echo "local_multiprocess: a process failed (exit $status); see $RUN_LOG_DIR/process*.log" >&2
fi
exit "$status"
