#!/usr/bin/env bash
# The device check: the benchmarks and the whole test suite on one GPU (or TPU) host that already
# has jax, flax, optax, orbax, torch and transformers installed (nothing is installed here: the
# project runs from this checkout through PYTHONPATH).
#
#   experiments/accelerator_check.sh OUTDIR [PART ...]
#
# PARTS, each under its own time limit (seconds, below), so one that hangs or runs long leaves the
# others their time. The default list (train levers llama tests) fits one 10-minute call with room
# to pack the results: at most 120 + 110 + 150 + 140 = 520 s of parts after a probe of about 15 s
# (jax's backend and the versions), under 9 minutes in all on one H100. The limits follow the H100
# runs in experiments/results/ (our GPT-2 small step compiles in 15-19 s, a lever variant's process
# takes about 25 s); torch.compile's compile time was not recorded, so the train and llama limits
# are estimates: a part stopped at its limit says so, and its log shows how far it got.
#   train      (120 s) tjax bench train: GPT-2 small, 16 x 1024, bfloat16, against torch.compile on
#              the same GPU, with the kernel-table levers of $TABLE (below; empty: none) as a side
#              "ours+table" in the same run, then 2 profiled steps per side (kernel time by kind)
#                                       (-> bench_train.json, traces/SIDE.trace.json.gz)
#   levers     (110 s) experiments/gpu_levers.py: the train step's variants of $LEVERS (default,
#              packed segments, packed segments with the conditionals left out of the CUDA graphs,
#              padded vocabulary), each in a process of its own, 5 timed steps each
#              (-> levers.json); $LEVERS_ARGS replaces its options, $LEVERS_LIMIT its limit
#   llama      (150 s) tjax bench train: tinyllama-1.1b (a LLaMA-style 1B: RoPE, GQA, SwiGLU,
#              RMSNorm, untied head), 2 x 2048, bfloat16, against transformers' LlamaForCausalLM
#              under torch.compile                                    (-> bench_train_llama.json)
#   tests      (140 s) the whole suite: pytest tests -n 14 on the accelerator (100 s), then
#              tests/parallel on 8 simulated CPU devices in their own process (40 s); each run is
#              interrupted at its limit, so its log still ends with the summary of what ran
#                                                          (-> tests.log, tests_parallel.log)
#   attention  ( 90 s) tjax bench attention: causal, 1k/4k/16k, every kernel and torch SDPA, 10
#              calls back to back per timing                        (-> bench_attention.json)
#   generate   (150 s) tjax bench generate: greedy, batch 1 and 8, float32 and bfloat16, against
#              transformers' generate                                (-> bench_generate.json)
#
# Before anything runs, every part name is checked (an unknown one: one line, exit 2), and the
# host must have an accelerator: jax's default backend is gpu or tpu, else one line and exit 3
# (ACCELERATOR_CHECK_ON_CPU=1 runs it anyway, for testing the script). Every part writes its log
# to OUTDIR/PART.log; the last lines printed are each part's summary. A part fails when its
# command exits non-zero (124: its time limit), leaves out the file it should write, or writes one
# without a measurement (a rival "left_out", a lever variant's "error"); the script then names the
# failed parts in its last line and exits 1.
#
# The one call on a device machine (its results in one file):
#   experiments/accelerator_check.sh /tmp/acc; tar czf "$OUT/acc.tgz" -C /tmp acc
set -uo pipefail
if (($# < 1)); then
  echo "usage: experiments/accelerator_check.sh OUTDIR [PART ...] (parts: see its header)" >&2
  exit 2
fi
OUTDIR=$1
shift
PARTS=${*:-train levers llama tests}
KNOWN="train levers llama tests attention generate"
declare -A LIMIT=([train]=120 [levers]=${LEVERS_LIMIT:-110} [llama]=150 [tests]=140
                  [attention]=90 [generate]=150)
for part in $PARTS; do
  if [[ " $KNOWN " != *" $part "* ]]; then
    echo "accelerator_check: unknown part '$part' (parts: $KNOWN); nothing was run" >&2
    exit 2
  fi
done

ROOT=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TJAX_COMPILATION_CACHE=0
PY=${PYTHON:-python3}
cd "$ROOT"

# One probe: the versions (for machine.txt), then jax's default backend on the last line.
probe=$(timeout 120 "$PY" - 2>/dev/null <<'PY'
import importlib
import jax
versions = []
for name in ("flax", "optax", "torch", "transformers"):
  try:
    versions.append(f"{name} {importlib.import_module(name).__version__}")
  except Exception as e:  # noqa: BLE001 - named in machine.txt; the part that needs it fails
    versions.append(f"{name} missing ({type(e).__name__})")
print("jax", jax.__version__, jax.devices()[0].device_kind, "|", " | ".join(versions))
print(jax.default_backend())
PY
)
backend=$(tail -n 1 <<< "$probe")
if [[ "$backend" != gpu && "$backend" != tpu ]]; then
  if [[ "${ACCELERATOR_CHECK_ON_CPU:-}" != 1 ]]; then
    echo "accelerator_check: no accelerator here (jax's backend: ${backend:-none, jax did not" \
         "start}); set ACCELERATOR_CHECK_ON_CPU=1 to run it anyway" >&2
    exit 3
  fi
  echo "accelerator_check: running on '${backend:-none}' (ACCELERATOR_CHECK_ON_CPU=1)" >&2
fi

mkdir -p "$OUTDIR"
# The kernel-table entries not yet on by default that the train part also times
# (backends.KernelTable).
TABLE=${TABLE-cudnn_packed_segments=16 pad_cols=128}
TABLE_ARGS=()
for entry in $TABLE; do TABLE_ARGS+=(--table "$entry"); done
LEVERS=default,packed_segments_16,packed_segments_16_host_cond,vocab_pad_128
TJAX=("$PY" -m transformer_jax.cli)

summary=()
failed=()
# run NAME LIMIT_S WANTS COMMAND...: the command's output to OUTDIR/NAME.log under a time limit
# (SIGINT first, so pytest and the benches can still print what they have); it fails on a
# non-zero exit or when WANTS (a file; "-" for none) was not written.
run() {
  local name=$1 limit=$2 wants=$3
  shift 3
  local start=$SECONDS
  timeout --signal=INT --kill-after=15 "$limit" "$@" > "$OUTDIR/$name.log" 2>&1
  local rc=$?
  local line="$name: exit $rc after $((SECONDS - start)) s (limit $limit s)"
  if ((rc == 124)); then line+=", stopped at its time limit"; fi
  if ((rc == 0)) && [[ "$wants" != - && ! -s "$wants" ]]; then
    rc=1
    line+=", but it wrote no $(basename "$wants")"
  fi
  summary+=("$line")
  if ((rc != 0)); then failed+=("$name"); fi
  tail -n 25 "$OUTDIR/$name.log"
}
# holds NAME FILE KEY: the part that wrote FILE fails when the JSON has KEY (a rival left out, a
# variant that did not run): its measurement is missing even though the command succeeded.
holds() {
  local name=$1 file=$2 key=$3
  if [[ -s "$file" ]] && grep -q "\"$key\":" "$file"; then
    summary[-1]+=", but $(basename "$file") has \"$key\" entries"
    if [[ " ${failed[*]} " != *" $name "* ]]; then failed+=("$name"); fi
  fi
}

{ echo "parts: $PARTS (backend: ${backend:-none})"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
  head -n -1 <<< "$probe"
  git -C "$ROOT" rev-parse HEAD 2>/dev/null; } > "$OUTDIR/machine.txt" 2>&1
cat "$OUTDIR/machine.txt"

for part in $PARTS; do
  limit=${LIMIT[$part]}
  case $part in
    train)
      # JAX and PyTorch share the GPU in one process: each gets part of its memory.
      XLA_PYTHON_CLIENT_MEM_FRACTION=0.45 run train "$limit" "$OUTDIR/bench_train.json" \
        "${TJAX[@]}" bench train --preset gpt2-small --batch-size 16 --seq-len 1024 \
        --dtype bfloat16 --steps 10 --warmup 3 --against torch.compile "${TABLE_ARGS[@]}" \
        --profile 2 --profile-dir "$OUTDIR/traces" --json "$OUTDIR/bench_train.json"
      holds train "$OUTDIR/bench_train.json" left_out ;;
    levers)
      # shellcheck disable=SC2086 - LEVERS_ARGS is a list of options
      run levers "$limit" "$OUTDIR/levers.json" "$PY" experiments/gpu_levers.py \
        ${LEVERS_ARGS:---variants $LEVERS --steps 5 --generate-batches=} \
        --json "$OUTDIR/levers.json"
      holds levers "$OUTDIR/levers.json" error ;;
    llama)
      XLA_PYTHON_CLIENT_MEM_FRACTION=0.45 run llama "$limit" "$OUTDIR/bench_train_llama.json" \
        "${TJAX[@]}" bench train --preset tinyllama-1.1b --batch-size 2 --seq-len 2048 \
        --dtype bfloat16 --steps 5 --warmup 2 --against torch.compile \
        --json "$OUTDIR/bench_train_llama.json"
      holds llama "$OUTDIR/bench_train_llama.json" left_out ;;
    tests)
      # Several workers share the accelerator: no worker may take most of its memory up front.
      # tests/parallel need 8 simulated CPU devices from the start: a process of their own.
      XLA_PYTHON_CLIENT_PREALLOCATE=false run tests $((limit - 40)) - "$PY" -m pytest tests \
        --ignore=tests/parallel -n 14 -rfEs --durations=15 -p no:cacheprovider
      JAX_PLATFORMS=cpu run tests_parallel 40 - "$PY" -m pytest tests/parallel -n 8 -rfEs \
        --durations=5 -p no:cacheprovider ;;
    attention)
      XLA_PYTHON_CLIENT_MEM_FRACTION=0.45 run attention "$limit" \
        "$OUTDIR/bench_attention.json" "${TJAX[@]}" bench attention \
        --lengths 1024,4096,16384 --batch-sizes 4,4,1 --dtype bfloat16 --reps 5 --inner 10 \
        --implementations xla,chunked,cudnn,auto --against torch \
        --json "$OUTDIR/bench_attention.json" ;;
    generate)
      XLA_PYTHON_CLIENT_MEM_FRACTION=0.45 run generate "$limit" "$OUTDIR/bench_generate.json" \
        "${TJAX[@]}" bench generate --batch-sizes 1,8 --dtypes float32,bfloat16 --reps 3 \
        --bf16-reps 3 --ttft-reps 2 --json "$OUTDIR/bench_generate.json" ;;
  esac
done
printf '%s\n' "${summary[@]}"
if ((${#failed[@]})); then
  echo "accelerator_check: failed: ${failed[*]} (logs in $OUTDIR)" >&2
  exit 1
fi
echo "accelerator_check: every part passed ($PARTS)"
