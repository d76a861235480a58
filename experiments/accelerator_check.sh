#!/usr/bin/env bash
# The device check: the suite's accelerator-relevant tests and the benchmarks, on one GPU (or TPU)
# host that already has jax, flax, optax, orbax, torch and transformers installed (nothing is
# installed here: the project runs from this checkout through PYTHONPATH).
#
#   experiments/accelerator_check.sh OUTDIR [PART ...]
#
# PARTS (default: train attention generate tests, in this order, about 7.5 minutes on one H100;
# each part runs under its own time limit, so one that hangs or runs long leaves the others their
# time):
#   train      tjax bench train: GPT-2 small, 16 x 1024, bfloat16, against PyTorch eager and
#              torch.compile on the same GPU, with the kernel-table levers of $TABLE (below; empty:
#              none) as a side "ours+table" in the same run, then 3 profiled steps per side (kernel
#              time by kind)                (-> bench_train.json, traces/SIDE.trace.json.gz)
#   attention  tjax bench attention: causal, 1k/4k/16k, every kernel and torch SDPA, 10 calls
#              back to back per timing (a 1k call's kernels are shorter than its launch and wait)
#                                                                          (-> bench_attention.json)
#   generate   tjax bench generate: greedy, batch 1 and 8, float32 and bfloat16, against
#              transformers' generate                                    (-> bench_generate.json)
#   tests      pytest tests/ops tests/layers tests/models tests/test_runtime.py    (-> tests.log)
#   levers     experiments/gpu_levers.py: the train step's and generation's levers, each variant
#              in a process of its own (not in the default list: about 4 minutes) (-> levers.json);
#              $LEVERS_ARGS replaces its options (default: the train step's variants in $LEVERS
#              below, no generation), $LEVERS_LIMIT its time limit (330 s)
# Every part writes its log to OUTDIR/PART.log; the last lines printed are each part's summary.
# Where only a few files come back from the machine, pack the folder:
#   experiments/accelerator_check.sh /tmp/acc; tar czf "$OUT/acc.tgz" -C /tmp acc
set -uo pipefail
OUT=${1:?usage: experiments/accelerator_check.sh OUTDIR [train|attention|generate|tests|levers ...]}
shift
PARTS=${*:-train attention generate tests}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$OUT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TJAX_COMPILATION_CACHE=0
PY=${PYTHON:-python3}
# The kernel-table entries not yet on by default that the train part also times
# (backends.KernelTable).
TABLE=${TABLE-cudnn_packed_segments=16 pad_cols=128}
TABLE_ARGS=()
for entry in $TABLE; do TABLE_ARGS+=(--table "$entry"); done
LEVERS=default,packed_segments_16,packed_segments_16_host_cond,vocab_pad_128,command_buffer_off
TJAX=("$PY" -m transformer_jax.cli)
cd "$ROOT"

summary=()
run() {  # run NAME LIMIT_S COMMAND...: the command's output to OUT/NAME.log, its status summed up
  local name=$1 limit=$2
  shift 2
  local start=$SECONDS
  timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  summary+=("$name: exit $rc after $((SECONDS - start)) s")
  tail -n 25 "$OUT/$name.log"
}

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
  "$PY" -c "import jax, flax, optax, torch, transformers; print('jax', jax.__version__, \
jax.devices()[0].device_kind, '| flax', flax.__version__, '| optax', optax.__version__, \
'| torch', torch.__version__, '| transformers', transformers.__version__)"
  git -C "$ROOT" rev-parse HEAD 2>/dev/null; } > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"

for part in $PARTS; do
  case $part in
    tests)
      # Several workers share the GPU: no worker may take most of its memory up front.
      XLA_PYTHON_CLIENT_PREALLOCATE=false run tests 200 "$PY" -m pytest tests/ops tests/layers \
        tests/models tests/test_runtime.py -n 12 -p no:cacheprovider ;;
    levers)
      # shellcheck disable=SC2086 - LEVERS_ARGS is a list of options
      run levers "${LEVERS_LIMIT:-330}" "$PY" experiments/gpu_levers.py \
        ${LEVERS_ARGS:---variants $LEVERS --generate-batches=} \
        --json "$OUT/levers.json" ;;
    train)
      # JAX and PyTorch share the GPU in one process: each gets part of its memory.
      XLA_PYTHON_CLIENT_MEM_FRACTION=0.45 run train 300 "${TJAX[@]}" bench train \
        --preset gpt2-small --batch-size 16 --seq-len 1024 --dtype bfloat16 --steps 10 \
        --warmup 3 --against torch,torch.compile "${TABLE_ARGS[@]}" --profile 3 \
        --profile-dir "$OUT/traces" --json "$OUT/bench_train.json" ;;
    attention)
      XLA_PYTHON_CLIENT_MEM_FRACTION=0.45 run attention 90 "${TJAX[@]}" bench attention \
        --lengths 1024,4096,16384 --batch-sizes 4,4,1 --dtype bfloat16 --reps 5 --inner 10 \
        --implementations xla,chunked,cudnn,auto --against torch \
        --json "$OUT/bench_attention.json" ;;
    generate)
      XLA_PYTHON_CLIENT_MEM_FRACTION=0.45 run generate 150 "${TJAX[@]}" bench generate \
        --batch-sizes 1,8 --dtypes float32,bfloat16 --reps 3 --bf16-reps 3 --ttft-reps 2 \
        --json "$OUT/bench_generate.json" ;;
    *) echo "unknown part: $part" >&2; exit 2 ;;
  esac
done
printf '%s\n' "${summary[@]}"
