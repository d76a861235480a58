"""The backends' kernels: which piece each method runs on each platform (read from the traced
program or by counting the pieces' calls, so every platform is checked here), against float64
where a method computes something of its own."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from transformer_jax import backends, hardware, models, ops
from transformer_jax.backends import CpuBackend, KernelTable
from transformer_jax.backends.cpu import decode, matmul

CPU_UNITS, CPU_PLAIN = CpuBackend(bf16_units=True), CpuBackend(bf16_units=False)
GPU, TPU = backends.for_platform("gpu"), backends.for_platform("tpu")


def test_the_platform_is_asked_here_and_named():
  assert backends.platform() in backends.PLATFORMS
  assert backends.current().platform == backends.platform()
  if jax.default_backend() == "cpu":
    assert backends.current() == CpuBackend(bf16_units=hardware.has_bf16_units())
  with pytest.raises(ValueError, match="platform='cuda' must be one of 'cpu', 'gpu', 'tpu'"):
    backends.for_platform("cuda")


def test_accelerator_backends_do_not_read_the_cpus_flags(monkeypatch):
  def cpuinfo():
    raise AssertionError("read /proc/cpuinfo for an accelerator")

  monkeypatch.setattr(hardware, "has_bf16_units", cpuinfo)
  assert backends.for_platform("gpu") == GPU and backends.for_platform("tpu") == TPU


def _calls(monkeypatch, module, *names, counts=None):
  """Counts the calls of ``module``'s functions ``names`` (the functions still run) in ``counts``
  (default a new dict), which it returns."""
  counts = {} if counts is None else counts
  counts.update(dict.fromkeys(names, 0))
  for name in names:
    fn = getattr(module, name)

    def counted(*args, _fn=fn, _name=name, **kwargs):
      counts[_name] += 1
      return _fn(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
  return counts


def _einsum_projection(x, w, b, einsum):
  return jnp.einsum(einsum, x, w) + b


@pytest.mark.parametrize(
  "backend,dtype,piece",
  [
    (CPU_UNITS, jnp.bfloat16, "matmul"),
    (CPU_UNITS, jnp.float32, None),
    (CPU_PLAIN, jnp.bfloat16, None),
    (GPU, jnp.bfloat16, None),
    (TPU, jnp.bfloat16, None),
  ],
)
@pytest.mark.parametrize("merged", [False, True])
def test_projection_products(monkeypatch, backend, dtype, piece, merged):
  # bfloat16 on a CPU with bf16 units goes through matmul.matmul; everything else is the einsum
  # (merged: its contracted dims as one). The same numbers either way.
  calls = _calls(monkeypatch, matmul, "matmul")
  rng = np.random.default_rng(0)
  x, w, b = (rng.standard_normal(s).astype(np.float32) for s in ((2, 3, 4, 5), (4, 5, 6), (6,)))
  y = jax.eval_shape(
    lambda x, w, b: backend.project(
      x, w, b, einsum="BTNH,NHD->BTD", n_in=2, dtype=dtype, merged=merged
    ),
    x,
    w,
    b,
  )
  assert y.shape == (2, 3, 6) and y.dtype == dtype
  assert calls["matmul"] == (piece == "matmul")
  got = backend.project(x, w, b, einsum="BTNH,NHD->BTD", n_in=2, dtype=jnp.float32, merged=merged)
  want = np.einsum("btnh,nhd->btd", x.astype(np.float64), w.astype(np.float64)) + b
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
  "backend,dtype,rows,piece",
  [
    (CPU_UNITS, jnp.bfloat16, decode.SKINNY_ROWS, "weight_first"),  # a few rows: weight-first
    (CPU_PLAIN, jnp.float32, decode.SKINNY_ROWS, "weight_first"),  # in any dtype
    (CPU_UNITS, jnp.bfloat16, decode.SKINNY_ROWS + 1, "matmul"),
    (CPU_UNITS, jnp.float32, decode.SKINNY_ROWS + 1, None),
    (GPU, jnp.bfloat16, 1, None),
    (TPU, jnp.bfloat16, 1, None),
  ],
)
def test_vocabulary_head_pieces(monkeypatch, backend, dtype, rows, piece):
  calls = _calls(monkeypatch, matmul, "matmul", counts=_calls(monkeypatch, decode, "weight_first"))
  x = jax.ShapeDtypeStruct((1, rows, 8), jnp.float32)
  table = jax.ShapeDtypeStruct((50, 8), jnp.float32)
  logits = jax.eval_shape(functools.partial(backend.vocab_head, dtype=dtype), x, table)
  assert logits.shape == (1, rows, 50)
  assert {k for k, v in calls.items() if v} == ({piece} if piece else set())


@pytest.mark.parametrize("v,multiple", [(37, 16), (50, 8), (64, 16)])
def test_padded_attend_matches_float64(v, multiple):
  rng = np.random.default_rng(0)
  x = rng.standard_normal((2, 5, 12))
  table = rng.standard_normal((v, 12))
  g = rng.standard_normal((2, 5, v))  # the cotangent of the logits

  def f(x, table):
    return jnp.sum(backends.padded_attend(x, table, multiple) * g)

  out = backends.padded_attend(
    jnp.asarray(x, jnp.float32), jnp.asarray(table, jnp.float32), multiple
  )
  assert out.shape == (2, 5, v)
  np.testing.assert_allclose(np.asarray(out), x @ table.T, rtol=1e-5, atol=1e-5)
  dx, dtable = jax.grad(f, argnums=(0, 1))(
    jnp.asarray(x, jnp.float32), jnp.asarray(table, jnp.float32)
  )
  assert dtable.shape == (v, 12)
  np.testing.assert_allclose(np.asarray(dx), g @ table, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(
    np.asarray(dtable), np.einsum("btv,btd->vd", g, x), rtol=1e-5, atol=1e-5
  )


@pytest.mark.parametrize("platform", ["cpu", "gpu", "tpu"])
def test_the_table_pads_the_vocabulary_head_on_every_platform(platform):
  # 97 columns padded to 128 where pad_cols asks (before the CPU's own pieces: 18 rows would be
  # weight-first there); already aligned, or no table: unchanged.
  x = jax.ShapeDtypeStruct((2, 9, 8), jnp.float32)
  for v, pad, padded in ((97, 32, True), (96, 32, False), (97, 0, False)):
    backend = backends.for_platform(platform, KernelTable(pad_cols=pad))
    jaxpr = jax.make_jaxpr(functools.partial(backend.vocab_head, dtype=jnp.float32))(
      x, jax.ShapeDtypeStruct((v, 8), jnp.float32)
    )
    assert ("f32[128,8] = pad" in str(jaxpr)) == padded, (v, pad, jaxpr)


@pytest.mark.slow
def test_model_logits_are_unchanged_when_the_table_pads():
  config = models.get_config("gpt2-tiny", vocab_size=97)
  params = models.init(config, jax.random.key(0))
  tokens = jnp.asarray(np.random.default_rng(1).integers(0, 97, (2, 9)), jnp.int32)
  plain = nnx.merge(models.graphdef(config), params)(tokens)
  backend = backends.current(KernelTable(pad_cols=32))
  padded = nnx.merge(models.graphdef(config, None, backend), params)(tokens)
  assert padded.shape == plain.shape == (2, 9, 97)
  np.testing.assert_allclose(np.asarray(padded), np.asarray(plain), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
  "backend,dtype,packed",
  [
    (CPU_UNITS, jnp.bfloat16, True),
    (CPU_UNITS, jnp.float32, False),
    (CPU_PLAIN, jnp.bfloat16, False),
    (GPU, jnp.bfloat16, False),
  ],
)
@pytest.mark.parametrize("gated", [False, True])
def test_activation_saves_its_inputs_as_bits_where_products_do(
  monkeypatch, backend, dtype, packed, gated
):
  calls = _calls(monkeypatch, ops, "packed_activation")
  x = jnp.linspace(-3.0, 3.0, 12).reshape(2, 6)
  args = (x, x[::-1]) if gated else (x,)
  got = backend.activate("gelu", *args, dtype=dtype)
  assert calls["packed_activation"] == packed
  want = ops.gated("gelu", *args) if gated else ops.get_activation("gelu")(x)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)


def test_fused_loss_copies_x_row_major_on_cpu_only(monkeypatch):
  calls = _calls(monkeypatch, matmul, "transposed")
  x, w = jnp.ones((6, 4)), jnp.ones((10, 4))
  labels = jnp.arange(6) % 10

  def loss(backend):
    return jax.grad(
      lambda x, w: backend.linear_cross_entropy(x, w, labels, chunk_size=3)[0], argnums=(0, 1)
    )(x, w)

  got_gpu = loss(GPU)
  assert calls["transposed"] == 0
  got_cpu = loss(CPU_PLAIN)
  assert calls["transposed"] > 0
  for a, b in zip(got_cpu, got_gpu):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)


def test_attention_without_an_implementation_is_the_tables_choice():
  key = jax.random.split(jax.random.key(0), 3)
  q, kk, v = (jax.random.normal(k_, (2, 32, 4, 16), jnp.float32) for k_ in key)
  backend = backends.current()
  choice = backend.choose_attention(q, kk, v, causal=True)
  assert choice == ops.choose_implementation(q, kk, v, platform=backend.platform, causal=True)
  auto = backend.attention(q, kk, v, causal=True)
  assert jnp.array_equal(auto, backend.attention(q, kk, v, causal=True, implementation=choice))
  with pytest.raises(ValueError, match="implementation='flash' must be None, 'xla', 'chunked'"):
    backend.attention(q, kk, v, implementation="flash")


@pytest.mark.parametrize("backend,block", [(CPU_PLAIN, 128), (GPU, 512), (TPU, 512)])
def test_the_chunked_kernel_runs_in_the_backends_blocks(backend, block):
  q, kk, v = (
    jax.random.normal(k_, (1, 600, 2, 8), jnp.float32)
    for k_ in jax.random.split(jax.random.key(1), 3)
  )
  attend = jax.jit(functools.partial(backend.attention, causal=True, implementation="chunked"))
  by_block = jax.jit(
    functools.partial(
      ops.dot_product_attention, causal=True, implementation="chunked", block_q=block, block_k=block
    )
  )
  np.testing.assert_array_equal(np.asarray(attend(q, kk, v)), np.asarray(by_block(q, kk, v)))


def test_only_the_cpu_with_bf16_units_unrolls_and_accelerators_keep_gpus_rule():
  assert CPU_UNITS.unrolls_layers("bfloat16") and not CPU_UNITS.unrolls_layers("float32")
  assert not CPU_PLAIN.unrolls_layers("bfloat16")
  assert GPU.unrolls_layers("float32") and not TPU.unrolls_layers("bfloat16")


@pytest.mark.parametrize("setting,want", [(3, [3]), ("auto", [1])])
def test_microbatches_off_cpu_are_the_setting_or_one(setting, want):
  compiled = []
  m, step = GPU.microbatches(setting, lambda m: compiled.append(m) or f"step{m}", 12)
  assert compiled == want and (m, step) == (want[0], f"step{want[0]}")
  assert GPU.scratch_notice(10 << 30) is None and GPU.hold("step", {"a": 1}) == "step"
