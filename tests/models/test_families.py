"""Every family: jit, forward, backward, pure-function form, scan == unroll, remat, dropout."""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from transformer_jax import models
from tests.models.conftest import VOCAB, forward, jit_forward, params_for, tiny
from tests.backends import only_on

FAMILIES = [
  "gpt2-tiny",
  "llama-tiny",
  "qwen3-tiny",
  "gpt-alibi-tiny",
  "bert-tiny",
  "transformer-tiny",
  "t5-tiny",
]


@pytest.mark.slow
@pytest.mark.parametrize("name", FAMILIES)
def test_tiny_preset_jits_forward_and_backward(name, tokens):
  config = tiny(name)
  graphdef, params = models.graphdef(config), params_for(config)

  @jax.jit
  def loss_fn(params, tokens):
    logits = forward(nnx.merge(graphdef, params), config, tokens)
    return jnp.mean(jax.nn.log_softmax(logits)[..., 0])

  loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
  assert np.isfinite(float(loss))
  leaves = jax.tree.leaves(grads)
  assert all(np.isfinite(np.asarray(g)).all() for g in leaves)
  # Every parameter gets a gradient signal (no dead branches), except pieces the forward
  # never touches: NSP/pooler heads for BERT's MLM output.
  norms = {
    jax.tree_util.keystr(p): float(np.abs(np.asarray(g)).sum())
    for p, g in jax.tree_util.tree_leaves_with_path(grads)
  }
  unused = ("pooler", "nsp")
  dead = [k for k, v in norms.items() if v == 0.0 and not any(u in k for u in unused)]
  assert not dead, dead
  assert jit_forward(config)(params, tokens).shape[-1] == VOCAB


@pytest.mark.slow
@pytest.mark.parametrize("name", FAMILIES)
def test_pure_function_form_equals_module(name, tokens):
  config = tiny(name)
  params = models.init(config, jax.random.key(3))
  module = nnx.merge(models.graphdef(config), params)
  expected = forward(module, config, tokens)
  match config:
    case models.BERTConfig():
      got = jax.jit(
        lambda p, t: models.apply(config, p, t, jnp.zeros_like(t), jnp.ones_like(t)).mlm_logits
      )(params, tokens)
    case models.Seq2SeqConfig():
      got = jax.jit(lambda p, t: models.apply(config, p, t, t[:, ::-1]))(params, tokens)
    case _:
      got = jax.jit(lambda p, t: models.apply(config, p, t))(params, tokens)
  np.testing.assert_allclose(got, expected, atol=1e-5, rtol=1e-5)
  # init is a function of the key: same key, same params; different key, different params.
  again = models.init(config, jax.random.key(3))
  other = models.init(config, jax.random.key(4))
  same = jax.tree.leaves(jax.tree.map(lambda a, b: bool((a == b).all()), params, again))
  assert all(same)
  assert not all(jax.tree.leaves(jax.tree.map(lambda a, b: bool((a == b).all()), params, other)))


@pytest.mark.slow
def test_pure_function_form_vmaps_over_params(tokens):
  config = tiny("gpt2-tiny")
  keys = jax.random.split(jax.random.key(0), 2)
  stacked = jax.vmap(lambda k: models.init(config, k))(keys)
  out = jax.jit(jax.vmap(lambda p: models.apply(config, p, tokens)))(stacked)
  for i in range(2):
    single = jit_forward(config)(models.init(config, keys[i]), tokens)
    np.testing.assert_allclose(out[i], single, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("name", FAMILIES)
def test_scanned_stack_equals_unrolled_stack(name, tokens):
  scanned = tiny(name, scan_layers=True)
  unrolled = dataclasses.replace(scanned, scan_layers=False)
  params = params_for(scanned)
  a = jit_forward(scanned)(params, tokens)
  b = jit_forward(unrolled)(params, tokens)
  np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_auto_unrolls_only_bfloat16_cpu_products_of_a_few_layers():
  from transformer_jax.backends import CpuBackend
  from transformer_jax.layers import Stack

  for native in (True, False):
    backend = CpuBackend(bf16_units=native)

    def stacks(config):
      model = models.abstract(config, None, backend)
      return [m.unroll for _, m in nnx.iter_graph(model) if isinstance(m, Stack)]

    for name in ("gpt2-tiny", "bert-tiny", "t5-tiny"):
      bf16 = tiny(name, dtype="bfloat16")
      assert bf16.scan_layers == "auto"
      assert stacks(bf16) == [native] * len(stacks(bf16)) and stacks(bf16)
      assert stacks(tiny(name)) == [False] * len(stacks(bf16))  # float32: scanned
      assert stacks(dataclasses.replace(bf16, scan_layers=True)) == [False] * len(stacks(bf16))
      assert stacks(dataclasses.replace(bf16, scan_layers=False)) == [True] * len(stacks(bf16))
    deep = tiny("gpt2-tiny", dtype="bfloat16", num_layers=models.config.UNROLL_MAX_LAYERS + 1)
    assert not models.unrolls_layers(deep, backend)
    t5 = tiny("t5-tiny", dtype="bfloat16", num_encoder_layers=6, num_decoder_layers=7)
    assert not models.unrolls_layers(t5, backend)  # encoder and decoder count together
    assert models.unrolls_layers(dataclasses.replace(t5, num_decoder_layers=6), backend) == native


def test_auto_unrolls_a_few_layers_on_gpus_and_scans_on_tpus():
  from transformer_jax import backends

  gpu, tpu = backends.for_platform("gpu"), backends.for_platform("tpu")
  for name in ("gpt2-tiny", "bert-tiny", "t5-tiny"):
    for dtype in ("float32", "bfloat16"):
      config = tiny(name, dtype=dtype)
      assert models.unrolls_layers(config, gpu)
      assert not models.unrolls_layers(config, tpu)
      assert not models.unrolls_layers(dataclasses.replace(config, scan_layers=True), gpu)
  deep = tiny("gpt2-tiny", num_layers=models.config.UNROLL_MAX_LAYERS + 1)
  assert not models.unrolls_layers(deep, gpu)


@pytest.mark.slow
@pytest.mark.parametrize("remat", ["full", "dots"])
def test_remat_gives_same_loss_and_gradients(remat, tokens):
  base = tiny("llama-tiny")
  other = dataclasses.replace(base, remat=remat)
  params = models.init(base, jax.random.key(1))

  def loss(config):
    return lambda p: jnp.mean(models.apply(config, p, tokens) ** 2)

  la, ga = jax.jit(jax.value_and_grad(loss(base)))(params)
  lb, gb = jax.jit(jax.value_and_grad(loss(other)))(params)
  np.testing.assert_allclose(la, lb, rtol=1e-6)
  jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, atol=1e-6, rtol=1e-5), ga, gb)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt2-tiny", "bert-tiny", "t5-tiny", "transformer-tiny"])
def test_dropout_active_only_with_rng_and_deterministic_per_key(name, tokens):
  config = tiny(name, dropout_rate=0.3)
  params, fn = params_for(config), jit_forward(config)
  plain = fn(params, tokens)
  np.testing.assert_array_equal(plain, fn(params, tokens))
  k = jax.random.key(5)
  a = fn(params, tokens, k)
  b = fn(params, tokens, k)
  c = fn(params, tokens, jax.random.key(6))
  np.testing.assert_array_equal(a, b)
  assert not np.allclose(a, plain) and not np.allclose(a, c)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bfloat16"])
def test_bf16_compute_stays_close_to_fp32(dtype, tokens):
  base = tiny("llama-tiny")
  low = dataclasses.replace(base, dtype=dtype)
  params = params_for(base)
  a = jit_forward(base)(params, tokens)
  b = jit_forward(low)(params, tokens)
  assert b.dtype == jnp.float32  # logits come back in float32
  np.testing.assert_allclose(a, b, atol=0.05)


def test_bert_heads_shapes_and_classification():
  # Shapes only (the heads' values are checked against NumPy in tests/train/test_classify_task.py):
  # traced abstractly, with nothing compiled.
  config = tiny("bert-tiny", num_labels=3)
  model = models.abstract(config)
  tokens = jax.ShapeDtypeStruct((4, 9), jnp.int32)
  out = nnx.eval_shape(lambda m, t: m(t, jnp.zeros_like(t), jnp.ones_like(t)), model, tokens)
  assert out.mlm_logits.shape == (4, 9, VOCAB) and out.nsp_logits.shape == (4, 2)
  assert nnx.eval_shape(lambda m, t: m.classify(t), model, tokens).shape == (4, 3)
  with pytest.raises(ValueError, match="num_labels"):
    nnx.eval_shape(lambda m, t: m.classify(t), models.abstract(tiny("bert-tiny")), tokens)


@pytest.mark.slow
def test_seq2seq_encode_decode_equal_call(tokens):
  config = tiny("t5-tiny")
  graphdef, params = models.graphdef(config), params_for(config)
  src, tgt = tokens, tokens[:, :5]
  # Each entry point compiled on its own (one program for all three could share the encoder).
  enc = jax.jit(lambda p, s: nnx.merge(graphdef, p).encode(s))(params, src)
  dec = jax.jit(lambda p, t, e: nnx.merge(graphdef, p).decode(t, e))(params, tgt, enc)
  call = jax.jit(lambda p, s, t: nnx.merge(graphdef, p)(s, t))(params, src, tgt)
  np.testing.assert_allclose(dec, call, atol=1e-6)
  assert enc.shape == (*src.shape, config.d_model)


@pytest.mark.parametrize("name", ["gpt2-tiny", "bert-tiny", "t5-tiny"])
def test_out_of_range_token_is_a_clear_error(name, tokens):
  config = tiny(name)
  model = models.create(config)
  bad = tokens.at[1, 4].set(VOCAB + 3)
  with pytest.raises(ValueError, match=rf"\[1, 4\] = {VOCAB + 3} is outside the vocabulary"):
    forward(model, config, bad)


def test_too_long_input_for_learned_positions_is_a_clear_error():
  config = tiny("gpt2-tiny", max_len=8)
  tokens = jnp.zeros((1, 9), jnp.int32)
  with pytest.raises(ValueError, match="length 9, more than max_len=8"):
    models.create(config)(tokens)


def test_mismatched_mask_shape_is_a_clear_error(tokens):
  model = models.create(tiny("bert-tiny"))
  with pytest.raises(ValueError, match=r"attention_mask.shape=\(2, 5\) must equal tokens.shape"):
    model(tokens, None, jnp.ones((2, 5)))


@pytest.mark.slow
@only_on("cpu", "XLA:CPU's bfloat16 products (backends.cpu.matmul)")
@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny", "bert-tiny", "t5-tiny"])
def test_bf16_cpu_matmuls_compute_what_xla_einsums_do(name, tokens, monkeypatch):
  # bfloat16 on a CPU with bfloat16 units sends every projection and the tied head through
  # backends.cpu.matmul.matmul (bfloat16 dots in the layouts XLA:CPU keeps, its own backward).
  # Forced on here (a CPU backend with bf16 units), whatever this CPU has: the loss and every
  # gradient match the plain einsum path (which XLA upcasts to float32 dots) to bfloat16 rounding,
  # and the program runs (a dot left in a layout XLA cannot run in bfloat16 fails at run time).
  from transformer_jax.backends import CpuBackend
  from transformer_jax.backends.cpu import matmul
  from tests.backends.cpu.test_matmul import _dots

  # Unrolled on both sides (as "auto" runs it on bf16 units): scanned and unrolled layers round
  # bfloat16 differently (T5's unscaled logits by several percent).
  config = dataclasses.replace(tiny(name), dtype="bfloat16", scan_layers=False)
  params = params_for(tiny(name))

  def loss_and_grads(fast: bool):
    monkeypatch.setattr(matmul, "bf16_products_native", lambda dtype: fast)
    graphdef = models.graphdef(config, None, CpuBackend(bf16_units=fast))

    def loss_fn(params, tokens):
      logits = forward(nnx.merge(graphdef, params), config, tokens)
      return jnp.mean(jax.nn.log_softmax(logits.astype(jnp.float32))[..., 1])

    fn = jax.jit(jax.value_and_grad(loss_fn))
    return fn(params, tokens), fn.lower(params, tokens).compile().as_text()

  with jax.default_matmul_precision(None):  # JAX's own default (tests/conftest.py sets float32)
    (loss_xla, grads_xla), _ = loss_and_grads(False)
    (loss, grads), hlo = loss_and_grads(True)
  if jax.default_backend() == "cpu":  # (a GPU runs its gemms as library calls, not HLO dots)
    bf16_dots = [d for d in _dots(hlo) if all(t.startswith("bf16[") for t in d[1])]
    assert len(bf16_dots) >= 6, "the projections did not run as bfloat16 dots"
  assert abs(float(loss) - float(loss_xla)) < 1e-3 * abs(float(loss_xla))
  chex.assert_trees_all_equal_shapes_and_dtypes(grads, grads_xla)  # float32 master gradients
  top = max(float(np.linalg.norm(g)) for g in jax.tree.leaves(grads_xla))
  for (path, g_xla), g in zip(
    jax.tree_util.tree_leaves_with_path(grads_xla), jax.tree.leaves(grads)
  ):
    scale = float(np.linalg.norm(g_xla))
    if scale > 1e-6 * top:  # (a key bias's gradient is 0 up to rounding: no relative error)
      rel = float(np.linalg.norm(np.asarray(g) - np.asarray(g_xla))) / scale
      assert rel < 2e-2, (jax.tree_util.keystr(path), rel)


def _dot_precisions(jaxpr, out):
  """The ``precision`` of every dot_general in ``jaxpr`` and the jaxprs nested in it."""
  from jax.extend import core as jcore

  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      out.append(eqn.params["precision"])
    for value in eqn.params.values():
      for sub in value if isinstance(value, (list, tuple)) else [value]:
        if isinstance(sub, jcore.ClosedJaxpr):
          _dot_precisions(sub.jaxpr, out)
        elif isinstance(sub, jcore.Jaxpr):
          _dot_precisions(sub, out)
  return out


@pytest.mark.parametrize("impl,fast", [("xla", False), ("chunked", False), ("xla", True)])
@pytest.mark.parametrize("name", FAMILIES)
def test_matmul_precision_reaches_every_dot_forward_and_backward(
  name, impl, fast, tokens, monkeypatch
):
  # A GPU computes float32 dots in TensorFloat-32 unless told otherwise (errors ~1e-3 against
  # PyTorch); config.matmul_precision must reach every dot of the loss's gradient, the hand-written
  # backward passes (attention cores, backends.cpu.matmul.matmul) included, which JAX traces after
  # the forward has returned. Checked on the traced program, so it holds on any backend.
  from transformer_jax.backends import CpuBackend
  from transformer_jax.backends.cpu import matmul

  monkeypatch.setattr(matmul, "bf16_products_native", lambda dtype: fast)
  backend = CpuBackend(bf16_units=fast)
  base = dataclasses.replace(
    tiny(name), attention_impl=impl, dtype="bfloat16" if fast else "float32"
  )
  params = params_for(tiny(name))
  expected = {
    "float32": (jax.lax.Precision.HIGHEST,) * 2,
    "tensorfloat32": (jax.lax.Precision.HIGH,) * 2,
    "default": None,
  }
  # The other kernels differ from "xla" in their hand-written backward passes: "float32" shows them.
  values = list(expected) if (impl, fast) == ("xla", False) else ["float32"]
  for value in values:
    want = expected[value]
    config = dataclasses.replace(base, matmul_precision=value)
    graphdef = models.graphdef(config, None, backend)

    def loss_fn(params, tokens):
      logits = forward(nnx.merge(graphdef, params), config, tokens)
      return jnp.mean(jax.nn.log_softmax(logits.astype(jnp.float32))[..., 1])

    with jax.default_matmul_precision(None):  # JAX's default (tests/conftest.py sets float32)
      got = _dot_precisions(jax.make_jaxpr(jax.grad(loss_fn))(params, tokens).jaxpr, [])
    assert len(got) >= 12, len(got)
    # bfloat16 compute keeps JAX's own setting (the config's is about float32 products).
    assert set(got) == {None if fast else want}, (value, set(got))


def test_matmul_precision_is_checked():
  with pytest.raises(ValueError, match="matmul_precision='tf32' must be one of"):
    dataclasses.replace(tiny("gpt2-tiny"), matmul_precision="tf32")
