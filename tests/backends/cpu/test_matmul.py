"""cpu.matmul.matmul: values and gradients against float64 NumPy, and the compiled dots' layouts."""

import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax.backends.cpu import matmul
from tests.backends import only_on

BF16_EPS = 2.0**-8  # bfloat16's unit roundoff


def _bf16(a):
  """``a`` rounded to bfloat16, back in float64 (what the kernel multiplies)."""
  return np.asarray(jnp.asarray(a, jnp.bfloat16), np.float64)


def _inputs(seed, m=24, k=40, n=16, transpose_w=False):
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((2, m // 2, k)).astype(np.float32)
  w = (rng.standard_normal((n, k) if transpose_w else (k, n)) / np.sqrt(k)).astype(np.float32)
  c = rng.standard_normal((2, m // 2, n)).astype(np.float32)  # d(loss)/d(y)
  return x, w, c


def _rel(a, b):
  return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))


@pytest.mark.parametrize("transpose_w", [False, True])
def test_bf16_matmul_and_gradients_match_float64(transpose_w):
  x, w, c = _inputs(0, transpose_w=transpose_w)

  def loss(x, w):
    y = matmul.matmul(x, w, dtype=jnp.bfloat16, out_dtype=jnp.float32, transpose_w=transpose_w)
    return jnp.sum(y * c), y

  (_, y), (dx, dw) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(x, w)
  chex.assert_shape(y, (2, 12, 16))
  chex.assert_type([y, dx, dw], [jnp.float32, jnp.float32, jnp.float32])

  xb, wb, cb = _bf16(x).reshape(24, 40), _bf16(w), _bf16(c).reshape(24, 16)
  w_kn = wb.T if transpose_w else wb
  y_ref = xb @ w_kn
  dx_ref = cb @ w_kn.T  # dy is taken in bfloat16, as the kernel does
  dw_ref = xb.T @ cb
  # The product of bfloat16 operands, accumulated in float32: only float32 rounding.
  assert _rel(y.reshape(24, 16), y_ref) < 1e-5
  # x's gradient comes back in bfloat16 (x's compute dtype), then float32: one bf16 rounding.
  assert _rel(dx.reshape(24, 40), dx_ref) < BF16_EPS
  # w's gradient goes from the float32 accumulator straight to w's float32: no bf16 rounding.
  assert _rel(dw, dw_ref.T if transpose_w else dw_ref) < 1e-5


@pytest.mark.parametrize("transpose_w", [False, True])
def test_bias_is_added_in_float32_and_its_gradient_is_the_column_sums(transpose_w):
  x, w, c = _inputs(2, transpose_w=transpose_w)
  b = np.random.default_rng(3).standard_normal(16).astype(np.float32)

  def loss(x, w, b):
    y = matmul.matmul(x, w, dtype=jnp.bfloat16, transpose_w=transpose_w, bias=b)
    return jnp.sum(y.astype(jnp.float32) * c), y

  (_, y), (dx, dw, db) = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(x, w, b)
  chex.assert_type([y, db], [jnp.bfloat16, jnp.float32])
  xb, wb, cb = _bf16(x).reshape(24, 40), _bf16(w), _bf16(c).reshape(24, 16)
  y_ref = xb @ (wb.T if transpose_w else wb) + b  # one rounding, after the bias
  assert _rel(np.asarray(y, np.float64).reshape(24, 16), y_ref) < BF16_EPS
  assert _rel(db, cb.sum(0)) < 1e-6  # column sums of the bf16 output gradient
  with pytest.raises(ValueError, match=r"bias.shape=\(3,\)"):
    matmul.matmul(x, w, dtype=jnp.bfloat16, transpose_w=transpose_w, bias=b[:3])


def test_a_transposed_float32_result_runs_and_matches_float64():
  """``matmul(..., out_dtype=float32).T``, and its gradient: on a CPU with bf16 units, XLA:CPU
  folded such a transpose into the bfloat16 product and the program failed when it ran."""
  x, w, c = _inputs(3)
  x2, c2 = x.reshape(-1, x.shape[-1]), c.reshape(-1, c.shape[-1])

  def f(x, w):
    return matmul.matmul(x, w, dtype=jnp.bfloat16, out_dtype=jnp.float32).T

  y_T = jax.jit(f)(x2, w)
  dw = jax.jit(jax.grad(lambda w: jnp.sum(f(x2, w) * c2.T)))(w)
  chex.assert_shape(y_T, (w.shape[1], x2.shape[0]))
  chex.assert_shape(dw, w.shape)
  assert _rel(y_T, (_bf16(x2) @ _bf16(w)).T) < 1e-6
  assert _rel(dw, _bf16(x2).T @ _bf16(c2)) < 1e-6


def test_float32_matmul_matches_float64():
  x, w, c = _inputs(1)
  loss = lambda x, w: jnp.sum(matmul.matmul(x, w, dtype=jnp.float32) * c)  # noqa: E731
  dx, dw = jax.grad(loss, argnums=(0, 1))(x, w)
  x64, w64, c64 = (np.asarray(a, np.float64) for a in (x, w, c))
  np.testing.assert_allclose(
    matmul.matmul(x, w, dtype=jnp.float32), x64 @ w64, rtol=1e-5, atol=1e-5
  )
  np.testing.assert_allclose(dx, c64 @ w64.T, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(dw, np.einsum("btk,btn->kn", x64, c64), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("shape", [(6, 4), (4, 6), (7, 10), (10, 7), (13, 17), (1, 5)])
def test_transposed_is_the_transpose(shape):
  # Even and odd sizes, a prime pair (no small factor: the plain transpose) and a single row.
  a = jnp.arange(np.prod(shape), dtype=jnp.float32).reshape(shape)
  np.testing.assert_array_equal(matmul.transposed(a), np.asarray(a).T)


def test_shape_errors_name_the_shapes():
  x = jnp.ones((3, 5))
  with pytest.raises(ValueError, match=r"x.shape=\(3, 5\).*w.shape=\(4, 2\)"):
    matmul.matmul(x, jnp.ones((4, 2)), dtype=jnp.float32)
  with pytest.raises(ValueError, match=r"\[N, K\]"):
    matmul.matmul(x, jnp.ones((5, 2)), dtype=jnp.float32, transpose_w=True)


def _dots(hlo: str) -> list[tuple[str, list[str], str]]:
  """Each dot in a compiled module: (its line, its operands' types, the caller fusion's line)."""
  comps, current = {}, None
  for line in hlo.splitlines():
    if m := re.match(r"^(?:ENTRY )?%(\S+) .*\{$", line):
      current = m.group(1)
      comps[current] = []
    elif current:
      comps[current].append(line)
  found = []
  for name, lines in comps.items():
    types = {
      m.group(1): m.group(2) for l in lines if (m := re.match(r"\s*(?:ROOT )?%(\S+) = (\S+) ", l))
    }
    for line in lines:
      if " dot(" in line:
        operands = re.search(r" dot\(([^)]*)\)", line).group(1).replace("%", "").split(", ")
        callers = [
          l
          for ls in comps.values()
          for l in ls
          if re.search(rf"calls=%{re.escape(name)}(,|\s|$)", l)
        ]
        found.append((line, [types[o] for o in operands], callers[0] if callers else ""))
  return found


def assert_bf16_dots_in_library_kernel(hlo: str, count: int) -> None:
  """``count`` dots in the compiled module, each with bfloat16 operands inside a YNNPACK fusion."""
  dots = _dots(hlo)
  assert len(dots) == count, [d[0] for d in dots]
  for line, types, caller in dots:
    assert all(t.startswith("bf16[") for t in types), (line, types)
    assert "__ynn_fusion" in caller, (line, caller)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's dot lowering")
@pytest.mark.parametrize("transpose_w,with_bias", [(False, False), (True, False), (False, True)])
def test_every_bf16_dot_stays_bf16_in_the_library_kernel(transpose_w, with_bias):
  # The point of cpu.matmul: the forward dot and both backward dots take bfloat16 operands into
  # XLA:CPU's library kernel (YNNPACK). An upcast shows as float32 operands; a transposed operand
  # folded back into a dot shows as a dot outside the library fusion (and fails at run time).
  m, k, n = 64, 48, 32
  x = jnp.ones((m, k), jnp.float32)
  w = jnp.ones((n, k) if transpose_w else (k, n), jnp.float32)

  b = jnp.zeros((n,), jnp.float32) if with_bias else None

  def loss(x, w, b):
    return jnp.sum(
      matmul.matmul(
        x, w, dtype=jnp.bfloat16, out_dtype=jnp.float32, transpose_w=transpose_w, bias=b
      )
    )

  # The value keeps the forward dot; the bias adds the dot of its gradient.
  grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
  assert_bf16_dots_in_library_kernel(grad.lower(x, w, b).compile().as_text(), 3 + with_bias)
  value, (dx, dw, db) = grad(x, w, b)  # runs: no dot was left to a kernel without bfloat16 support
  assert float(value) == m * k * n
  np.testing.assert_allclose(dx, np.full((m, k), n), rtol=1e-6)
  np.testing.assert_allclose(dw, np.full(w.shape, m), rtol=1e-6)
  if with_bias:
    np.testing.assert_allclose(db, np.full((n,), m), rtol=1e-6)


@only_on("cpu", "XLA:CPU's compiled scan (bf16 residuals as bits)")
def test_scanned_layers_stack_bf16_residuals_in_place_as_bits():
  """A scan over layers stacks each layer's saved ``x^T`` ([K, M] = [16, 24], stacked [3, 16, 24]).
  As bfloat16, XLA:CPU would update the stack in float32, converting all of it at every layer;
  saved as uint16 bits (``ops.residuals``) the update is in place. Same gradients either way."""
  from transformer_jax.ops import residuals

  ws = jnp.asarray(np.random.default_rng(0).standard_normal((3, 16, 40)), jnp.float32)
  x = jnp.asarray(np.random.default_rng(1).standard_normal((24, 16)), jnp.bfloat16)

  def loss(ws, x):
    def layer(h, w):
      return matmul.matmul(h, w, dtype=jnp.bfloat16)[:, :16], None

    return jnp.sum(jax.lax.scan(layer, x, ws)[0].astype(jnp.float32) ** 2)

  hlo = jax.jit(jax.grad(loss)).lower(ws, x).compile().as_text()
  assert not re.search(r"f32\[3,16,24\]\{[^}]*\} dynamic-update-slice\(", hlo)
  assert re.search(r"u16\[3,16,24\]\{[^}]*\} dynamic-update-slice\(", hlo)
  x16 = jnp.asarray([1.5, -0.0, jnp.inf, jnp.nan, 3e-39], jnp.bfloat16)
  back = residuals.unpacked(residuals.packed(x16))
  assert back.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(back).view(np.uint16), np.asarray(x16).view(np.uint16))
  assert residuals.packed(ws) is ws
