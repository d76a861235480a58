"""The CPU backend's decoding layout (``backends.cpu.decode``): projection kernels stored
``[out, in]`` and multiplied weight-first, the tied output projection weight-first for a few rows,
and the per-params reuse of the split layers."""

import gc
import glob
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from transformer_jax import backends, generate
from transformer_jax.backends import CpuBackend
from transformer_jax.backends.cpu import decode as cpu_decode
from transformer_jax.backends.cpu import matmul
from transformer_jax.backends.cpu.decode import SKINNY_ROWS, OutInKernel, OutInPieces
from transformer_jax.generate import decode
from transformer_jax.generate.stream import stream_generate
from transformer_jax.layers.dense import Embed, Projection
from tests.backends import only_on
from tests.generate.conftest import gpt_model, naive_greedy, random_prompts
from tests.backends.cpu.test_matmul import _dots, assert_bf16_dots_in_library_kernel

# Every einsum form the models' projections use: (einsum, x shape, kernel shape, bias shape).
FORMS = [
  ("BTD,DNH->BTNH", (3, 2, 8), (8, 4, 5), (4, 5)),  # query
  ("BSD,DKH->BSKH", (3, 2, 8), (8, 2, 5), None),  # key/value (GQA), no bias
  ("BTNH,NHD->BTD", (3, 2, 4, 5), (4, 5, 8), (8,)),  # attention output
  ("BTD,DF->BTF", (3, 2, 8), (8, 12), (12,)),  # MLP up/gate
  ("BTF,FD->BTD", (3, 2, 12), (12, 8), None),  # MLP down
]


def projection(einsum, kernel_shape, bias_shape, dtype=jnp.float32, backend=None):
  proj = Projection(
    einsum,
    kernel_shape,
    ("embed",) * len(kernel_shape),
    bias_shape=bias_shape,
    bias_axes=None if bias_shape is None else ("embed",) * len(bias_shape),
    init_std=1.0,
    dtype=dtype,
    param_dtype=jnp.float32,
    rngs=nnx.Rngs(0),
    backend=backend or CpuBackend(),
  )
  if bias_shape is not None:
    proj.bias[...] = jax.random.normal(jax.random.key(1), bias_shape)
  return proj


def in_decode_layout(proj: Projection, threads: int | None = None) -> None:
  """``proj``'s kernel replaced by its backend's decoding layout (as ``Stack.split_layers``)."""
  proj.kernel = proj.backend.decode_layout(
    proj.kernel, n_in=proj.contracted_dims(), dtype=proj.dtype, threads=threads
  )


@only_on("cpu", "the decoding layout (XLA:CPU's matrix-vector products)")
@pytest.mark.parametrize("einsum,x_shape,kernel_shape,bias_shape", FORMS)
def test_decode_layout_projection_equals_float64_reference(
  einsum, x_shape, kernel_shape, bias_shape
):
  proj = projection(einsum, kernel_shape, bias_shape)
  x = np.random.default_rng(0).standard_normal(x_shape).astype(np.float32)
  kernel = np.asarray(proj.kernel[...], np.float64)
  want = np.einsum(einsum, x.astype(np.float64), kernel)
  if bias_shape is not None:
    want = want + np.asarray(proj.bias[...], np.float64)
  in_decode_layout(proj)
  assert isinstance(proj.kernel, OutInKernel) and proj.backend.in_decode_layout(proj.kernel)
  x_letters, k_letters = einsum.split("->")[0].split(",")
  n_in = sum(c in x_letters for c in k_letters)
  # [in..., out...] -> [out..., in...]
  chex.assert_shape(proj.kernel[...], (*kernel_shape[n_in:], *kernel_shape[:n_in]))
  got = jax.jit(lambda x: proj(x))(x)
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
  kernel = proj.kernel
  in_decode_layout(proj)  # a second call leaves the layout as it is
  assert proj.kernel is kernel
  np.testing.assert_allclose(np.asarray(proj(x)), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("platform", ["gpu", "tpu"])
def test_decode_layout_is_the_cpu_backends_alone(platform):
  einsum, _, kernel_shape, bias_shape = FORMS[0]
  backend = backends.for_platform(platform)
  proj = projection(einsum, kernel_shape, bias_shape, backend=backend)
  in_decode_layout(proj)
  assert type(proj.kernel) is nnx.Param and not backend.in_decode_layout(proj.kernel)


@pytest.mark.parametrize("rows", [(1, 1), (8, 1), (2, 32), (4, 20)])  # the last is over SKINNY_ROWS
def test_embed_attend_equals_float64_reference_and_differentiates(rows):
  b, t = rows
  assert (b * t <= SKINNY_ROWS) == (rows != (4, 20))
  embed = Embed(50, 8, init_std=1.0, dtype=jnp.float32, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
  table = np.asarray(embed.embedding[...], np.float64)
  x = np.random.default_rng(1).standard_normal((b, t, 8)).astype(np.float32)
  np.testing.assert_allclose(
    np.asarray(embed.attend(x)), x.astype(np.float64) @ table.T, rtol=1e-5, atol=1e-5
  )
  # Gradients through the weight-first product (optimization barrier included) equal the
  # closed form of sum(w * x E^T): dE = w^T x, dx = w E.
  w = np.random.default_rng(2).standard_normal((b, t, 50)).astype(np.float32)
  graphdef, state = nnx.split(embed)

  def loss(state, x):
    return jnp.sum(nnx.merge(graphdef, state).attend(x) * w)

  d_state, d_x = jax.grad(loss, argnums=(0, 1))(state, x)
  w64 = w.astype(np.float64).reshape(-1, 50)
  np.testing.assert_allclose(
    np.asarray(d_state["embedding"][...]),
    w64.T @ x.astype(np.float64).reshape(-1, 8),
    rtol=1e-4,
    atol=1e-4,
  )
  np.testing.assert_allclose(np.asarray(d_x), (w64 @ table).reshape(b, t, 8), rtol=1e-4, atol=1e-4)


@pytest.mark.slow
@only_on("cpu", "the decoding layout (XLA:CPU's matrix-vector products)")
def test_split_layers_puts_every_projection_in_decode_layout_and_leaves_the_model_alone():
  model = gpt_model("llama-rope-gqa")
  layers = model.split_layers()
  assert len(layers) == model.config.num_layers
  kernels = [
    v
    for v in jax.tree.leaves(layers, is_leaf=lambda v: isinstance(v, nnx.Variable))
    if isinstance(v, OutInKernel)
  ]
  # query, key, value, out, and the gated MLP's gate, up and down: 7 per layer
  assert len(kernels) == 7 * model.config.num_layers
  for _, node in nnx.iter_graph(model):
    if isinstance(node, Projection):
      assert not isinstance(node.kernel, OutInKernel)


@pytest.mark.slow
def test_decode_layers_are_made_once_per_params_and_freed_with_them():
  model = gpt_model("gpt2-learned")
  prompts = random_prompts(3, [4, 7])
  graphdef, params = nnx.split(model)
  first = decode.decode_layers(graphdef, params)
  assert decode.decode_layers(graphdef, nnx.split(model)[1]) is first  # the same arrays
  # New weights (as after a training step): a new split, and generation follows the new weights.
  params2 = jax.tree.map(lambda a: a * 1.5, params)
  assert decode.decode_layers(graphdef, params2) is not first
  model2 = nnx.merge(graphdef, params2)
  got = np.asarray(generate.generate(model2, prompts, max_new_tokens=5))
  for row, prompt in enumerate(prompts):
    assert got[row].tolist() == naive_greedy(model2, prompt, 5)
  assert decode._DECODE_LAYERS[graphdef][1] is decode.decode_layers(graphdef, params2)
  del model2, params2
  gc.collect()
  assert graphdef not in decode._DECODE_LAYERS  # released with the weights it was made from


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's dot lowering")
@pytest.mark.parametrize("rows", [1, 2, 32])
def test_bf16_weight_first_sums_in_float32_in_the_library_kernel(rows, monkeypatch):
  # A bfloat16 prompt (2+ rows) multiplies weight-first in YNNPACK's bf16 kernel: XLA would upcast
  # both operands of a bfloat16-result dot to float32. One row (a decoding step) keeps that
  # float32 matrix-vector product on the upcast weights.
  monkeypatch.setattr(
    matmul, "bf16_products_native", lambda dtype: jnp.dtype(dtype) == jnp.bfloat16
  )
  k1, k2 = jax.random.split(jax.random.key(0))
  w = jax.random.normal(k1, (96, 64), jnp.float32).astype(jnp.bfloat16)
  x = jax.random.normal(k2, (rows, 64), jnp.float32).astype(jnp.bfloat16)
  f = jax.jit(cpu_decode.weight_first)
  hlo = f.lower(w, x).compile().as_text()
  if rows >= 2:
    assert_bf16_dots_in_library_kernel(hlo, 1)
  else:
    (dot,) = _dots(hlo)
    assert "__ynn_fusion" not in dot[2], dot
  got = f(w, x)
  chex.assert_shape(got, (rows, 96))
  chex.assert_type(got, jnp.bfloat16)
  x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
  want = x64 @ w64.T
  # A float32 sum rounded once to bfloat16: within half a bfloat16 ulp of the exact sum, plus the
  # float32 sum's own error.
  atol = 64 * 2.0**-24 * (np.abs(x64) @ np.abs(w64).T)
  assert np.all(np.abs(np.asarray(got, np.float64) - want) <= 2.0**-8 * np.abs(want) + atol)


def xla_gemv_blocks(rows, cols, tmp_path):
  """The block count in the name of the matrix-vector kernel XLA:CPU compiles for a float32
  ``W[rows, cols] @ x`` (one row of x), read from the compiled code."""
  out = tmp_path / f"dump_{rows}_{cols}"
  jax.jit(cpu_decode.weight_first).lower(jnp.ones((rows, cols)), jnp.ones((1, cols))).compile(
    compiler_options={"xla_dump_to": str(out)}
  )
  found = set()
  for path in glob.glob(str(out / "*.ll")):
    found |= {
      int(b)
      for r, c, b in re.findall(r"row_major_gemv_F32_\d+_\d+_(\d+)_(\d+)_(\d+)", open(path).read())
      if (int(r), int(c)) == (rows, cols)
    }
  assert len(found) == 1, f"no single row_major_gemv kernel for {rows}x{cols}: {found}"
  return found.pop()


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's own kernel")
@pytest.mark.parametrize(
  "rows,cols",
  [
    (680, 768),
    (700, 768),
    (768, 768),
    (1536, 768),
    (3072, 768),
    (768, 3072),
    (256, 3072),
    (6144, 768),
  ],
)
def test_gemv_blocks_is_how_xla_cpu_cuts_a_matrix_vector_product(rows, cols, tmp_path):
  # The rule decode_pieces relies on, checked against this jaxlib's compiled kernels: a change
  # in XLA shows up here, not as a slower decoding loop.
  assert cpu_decode.gemv_blocks(rows * cols * 4) == xla_gemv_blocks(rows, cols, tmp_path)


def test_decode_pieces_make_every_piece_share_evenly():
  # GPT-2 small on 2 threads: the MLP (9.4 MB, 5 blocks) in 3 pieces of 2 blocks, the 768 x 768
  # attention kernels (2 blocks) and a 64 MB kernel (8 blocks) whole.
  assert cpu_decode.decode_pieces(3072, 1, 768 * 4, 2) == 3
  assert cpu_decode.decode_pieces(768, 1, 3072 * 4, 2) == 3
  assert cpu_decode.decode_pieces(768, 1, 768 * 4, 2) == 1
  assert cpu_decode.decode_pieces(4096, 1, 4096 * 4, 2) == 1
  assert cpu_decode.decode_pieces(3072, 1, 768 * 4, 1) == 1  # one thread: nothing to share
  assert cpu_decode.decode_pieces(3072, 1, 768 * 4, 16) == 1  # more threads than blocks
  assert cpu_decode.decode_pieces(100, 1, 768 * 4, 2) == 1  # small: one block
  for lead, rest, row_bytes in [
    (3072, 1, 768 * 4),
    (768, 1, 3072 * 4),
    (12, 256, 768 * 4),
    (5120, 1, 1024 * 4),
    (2816, 1, 1024 * 4),
  ]:
    for threads in (2, 4):
      p = cpu_decode.decode_pieces(lead, rest, row_bytes, threads)
      blocks = cpu_decode.gemv_blocks(lead // p * rest * row_bytes)
      whole = cpu_decode.gemv_blocks(lead * rest * row_bytes)
      assert p == 1 and whole % threads or blocks % threads == 0, (lead, rest, threads, p)
      assert lead % p == 0 and (lead // p * rest) % cpu_decode.GEMV_TILE_ROWS == 0


@only_on("cpu", "the decoding layout (XLA:CPU's matrix-vector products)")
@pytest.mark.parametrize(
  "einsum,x_shape,kernel_shape,bias_shape",
  [
    ("BTF,FD->BTD", (1, 1, 3072), (3072, 768), (768,)),  # GPT-2 small's MLP down projection
    ("BTF,FD->BTD", (3, 2, 3072), (3072, 768), None),  # several rows
    ("BTD,DNH->BTNH", (1, 1, 768), (768, 12, 256), (12, 256)),  # cut along the heads
  ],
)
def test_decode_layout_in_pieces_equals_float64_reference(
  einsum, x_shape, kernel_shape, bias_shape
):
  proj = projection(einsum, kernel_shape, bias_shape)
  x = np.random.default_rng(0).standard_normal(x_shape).astype(np.float32)
  want = np.einsum(einsum, x.astype(np.float64), np.asarray(proj.kernel[...], np.float64))
  if bias_shape is not None:
    want = want + np.asarray(proj.bias[...], np.float64)
  in_decode_layout(proj, threads=2)
  assert isinstance(proj.kernel, OutInPieces)
  pieces = proj.kernel.get_value()
  assert len(pieces) == 3
  n_out = len(kernel_shape) - 1
  chex.assert_equal_shape(pieces)
  chex.assert_shape(pieces[0], (kernel_shape[1] // 3, *kernel_shape[2:], kernel_shape[0]))
  assert n_out == pieces[0].ndim - 1
  got = jax.jit(lambda x: proj(x))(x)
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4)
  # The pieces cut the outputs, not the sums: the same bits as the whole kernel.
  whole = projection(einsum, kernel_shape, bias_shape)
  in_decode_layout(whole, threads=1)
  assert type(whole.kernel) is OutInKernel
  np.testing.assert_array_equal(np.asarray(got), np.asarray(jax.jit(lambda x: whole(x))(x)))
  # bfloat16 compute keeps one kernel: the pieces are for XLA:CPU's float32 kernel
  proj16 = projection(einsum, kernel_shape, bias_shape)
  proj16.dtype = jnp.bfloat16
  in_decode_layout(proj16, threads=2)
  assert type(proj16.kernel) is OutInKernel


@pytest.mark.slow
@only_on("cpu", "the decoding layout (XLA:CPU's matrix-vector products)")
def test_generate_with_kernels_in_pieces_equals_naive_greedy(monkeypatch):
  # Blocks of 13 KiB cut the tiny model's 64 KiB MLP kernels into 5, which "2 threads" do not
  # share evenly: they go in 4 pieces of 2 blocks (the 16 KiB attention kernels stay whole).
  monkeypatch.setattr(cpu_decode, "GEMV_BLOCK_BYTES", 13 << 10)
  monkeypatch.setattr(cpu_decode, "gemv_threads", lambda: 2)
  model = gpt_model("gpt2-learned")
  graphdef, params = nnx.split(model)
  decode._layer_splitter.cache_clear()
  decode._DECODE_LAYERS.pop(graphdef, None)
  try:
    layers = decode.decode_layers(graphdef, params)
    cut = [
      v
      for v in jax.tree.leaves(layers, is_leaf=lambda v: isinstance(v, nnx.Variable))
      if isinstance(v, OutInPieces)
    ]
    assert [len(v.get_value()) for v in cut] == [4] * 4  # up and down, 2 layers
    prompts = random_prompts(5, [3, 6])
    got = np.asarray(generate.generate(model, prompts, max_new_tokens=5))
    for row, prompt in enumerate(prompts):
      assert got[row].tolist() == naive_greedy(model, prompt, 5)
    one = np.asarray(generate.generate(model, prompts[:1], max_new_tokens=5))  # one row
    assert one[0].tolist() == naive_greedy(model, prompts[0], 5)
    # tjax generate's streaming path reads the same split layers
    streamed = np.concatenate(
      list(stream_generate(model, prompts[:1], max_new_tokens=5, chunk_size=2)), axis=1
    )
    assert streamed[0].tolist() == one[0].tolist()
  finally:
    decode._layer_splitter.cache_clear()
    decode._DECODE_LAYERS.pop(graphdef, None)
