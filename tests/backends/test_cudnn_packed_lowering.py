"""cuDNN's packed-segment attention, lowered for CUDA from any host: what the program asks of
cuDNN (the numbers are checked on a GPU, in ``test_cudnn.py``).

jax's cuDNN wrapper asks the local GPU for its cuDNN version and compute capability while it
traces; here they are given as a Hopper GPU with cuDNN 9.10 would give them, and the program is
lowered (not compiled) for CUDA.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.cudnn import fused_attention_stablehlo as cudnn

from transformer_jax import backends, ops
from transformer_jax.backends import cudnn as cudnn_adapter

B, T, N, H = 2, 64, 4, 32


@pytest.fixture
def hopper(monkeypatch):
  monkeypatch.setattr(cudnn, "check_cudnn_version", lambda: 91000)
  monkeypatch.setattr(cudnn, "check_compute_capability", lambda capability: True)
  monkeypatch.setattr(cudnn, "is_cuda_compute_capability_equal", lambda capability: False)
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  monkeypatch.setattr(cudnn_adapter, "ragged_layout", lambda: True)


def _lowered(causal: bool, kv_heads: int = N, table_segments: int = 0) -> str:
  def grads(q, k, v, ids):
    def loss(q, k, v):
      out = cudnn_adapter.attention(
        q, k, v, causal=causal, q_segment_ids=ids, table_segments=table_segments
      )
      return jnp.sum(out.astype(jnp.float32))

    return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

  q = jax.ShapeDtypeStruct((B, T, N, H), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((B, T, kv_heads, H), jnp.bfloat16)
  ids = jax.ShapeDtypeStruct((B, T), jnp.int32)
  return jax.jit(grads).trace(q, kv, kv, ids).lower(lowering_platforms=("cuda",)).as_text()


def _calls(text: str) -> list[tuple[str, str, str]]:
  """``(custom call, mask type, packed sequences per row)`` of each cuDNN attention call."""
  out = []
  for line in text.splitlines():
    call = re.search(r"custom_call @(__cudnn\$fmha\w+)", line)
    if call:
      mask = re.search(r"mask_type\\22: \\22(\w+)\\22", line)
      seg = re.search(r"max_seg_per_batch\\22: (\d+)", line)
      out.append((call.group(1), mask.group(1) if mask else "", seg.group(1) if seg else "1"))
  return out


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_packed_segments_lower_to_both_cudnn_calls_behind_a_choice(hopper, causal):
  text = _lowered(causal, table_segments=4)
  calls = sorted(_calls(text))
  mask = "CAUSAL" if causal else "NO_MASK"
  packed = "PADDING_CAUSAL" if causal else "PADDING"
  # Forward and backward, each as the mask (a bias) and as 4 packed sequences per row, and a
  # choice between the two on the device for each.
  assert calls == sorted(
    [
      ("__cudnn$fmhaScaleBiasSoftmax", mask, "1"),
      ("__cudnn$fmhaSoftmax", packed, "4"),
      ("__cudnn$fmhaScaleBiasSoftmaxBackward", mask, "1"),
      ("__cudnn$fmhaSoftmaxBackward", packed, "4"),
    ]
  ), calls
  assert text.count("stablehlo.case") == 2


def test_without_the_table_or_with_gqa_segments_are_the_mask(hopper):
  assert all(c[0].startswith("__cudnn$fmhaScaleBias") for c in _calls(_lowered(True)))
  text = _lowered(True, kv_heads=2, table_segments=4)
  assert all(c[0].startswith("__cudnn$fmhaScaleBias") for c in _calls(text))
  assert "stablehlo.case" not in text


def test_segment_runs_of_a_lowered_program_are_static_shapes():
  # The packed call's arguments: [B, M] lengths and [B, M + 1] starts, whatever the data.
  lengths, starts, fits = jax.eval_shape(
    lambda ids: ops.segment_runs(ids, 4), jax.ShapeDtypeStruct((B, T), jnp.int32)
  )
  assert (lengths.shape, starts.shape, fits.shape) == ((B, 4), (B, 5), ())
  assert np.dtype(lengths.dtype) == np.int32 and np.dtype(starts.dtype) == np.int32


@pytest.mark.slow
def test_the_gpt_train_step_packs_every_layer(hopper):
  # The whole step (GPT task, AdamW) of a model built for a GPU with the lever in its kernel
  # table: each layer's attention, forward and backward, as the packed call and the mask behind a
  # choice.
  from transformer_jax import models
  from transformer_jax.bench.train import random_batch
  from transformer_jax.train import step as step_lib
  from transformer_jax.train import tasks as tasks_lib
  from transformer_jax.train.config import TrainConfig
  from transformer_jax.train.optim import make_optimizer

  backend = backends.for_platform("gpu", backends.KernelTable(cudnn_packed_segments=16))
  config = models.get_config("gpt2-tiny", dtype="bfloat16", dropout_rate=0.0, scan_layers=False)
  batch, _ = random_batch(config, 2, 64, 0)
  optimizer = make_optimizer(
    TrainConfig(steps=10, batch_size=2, seq_len=64, warmup_steps=0, schedule="constant")
  )
  state = step_lib.create_state(models.init(config, jax.random.key(0)), optimizer)
  step = jax.jit(
    step_lib.make_train_step(
      models.graphdef(config, None, backend), tasks_lib.GPTTask(), optimizer, seed=0
    )
  )
  text = (
    step.trace(state, {k: jnp.asarray(v) for k, v in batch.items()})
    .lower(lowering_platforms=("cuda",))
    .as_text()
  )
  calls = _calls(text)
  layers = config.num_layers
  assert sorted(c[0] for c in calls) == sorted(
    [
      "__cudnn$fmhaScaleBiasSoftmax",
      "__cudnn$fmhaSoftmax",
      "__cudnn$fmhaScaleBiasSoftmaxBackward",
      "__cudnn$fmhaSoftmaxBackward",
    ]
    * layers
  )
  assert {c[2] for c in calls if not c[0].startswith("__cudnn$fmhaScaleBias")} == {"16"}
  assert text.count("stablehlo.case") == 2 * layers
