"""Tests for ``transformer_jax.ops.activations`` against float64 NumPy formulas."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import print_saved_residuals

from transformer_jax.backends.cpu import matmul
from transformer_jax.ops import (
  dropout,
  gated,
  geglu,
  gelu,
  gelu_tanh,
  get_activation,
  packed_activation,
  relu,
  silu,
  swiglu,
)
from tests.backends import only_on
from tests.xla_flags import OLDER_EMITTERS

X = np.linspace(-6.0, 6.0, 241)


def relu_ref(x):
  return np.maximum(np.asarray(x, np.float64), 0.0)


def gelu_ref(x):
  erf = np.vectorize(math.erf)
  x = np.asarray(x, np.float64)
  return 0.5 * x * (1.0 + erf(x / math.sqrt(2.0)))


def gelu_tanh_ref(x):
  x = np.asarray(x, np.float64)
  return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def silu_ref(x):
  x = np.asarray(x, np.float64)
  return x / (1.0 + np.exp(-x))


REFS = {"relu": relu_ref, "gelu": gelu_ref, "gelu_tanh": gelu_tanh_ref, "silu": silu_ref}
FUNCS = {"relu": relu, "gelu": gelu, "gelu_tanh": gelu_tanh, "silu": silu}


@pytest.mark.parametrize("name", sorted(REFS))
def test_activation_matches_reference(name):
  x = jnp.asarray(X, jnp.float32)
  got = jax.jit(FUNCS[name])(x)
  assert got.dtype == jnp.float32
  np.testing.assert_allclose(got, REFS[name](X), atol=1e-6, rtol=1e-6)


def test_gelu_exact_differs_from_tanh_approximation():
  x = jnp.asarray(X, jnp.float32)
  # The two differ by up to ~5e-4 here: well above the tolerance used above.
  assert np.max(np.abs(np.asarray(gelu(x)) - gelu_tanh_ref(X))) > 1e-4
  assert np.max(np.abs(np.asarray(gelu_tanh(x)) - gelu_ref(X))) > 1e-4


@pytest.mark.parametrize("name", sorted(REFS))
def test_activation_keeps_bf16_dtype(name):
  x = jnp.asarray(X, jnp.bfloat16)
  got = FUNCS[name](x)
  assert got.dtype == jnp.bfloat16
  np.testing.assert_allclose(
    np.asarray(got, np.float32), REFS[name](np.asarray(x, np.float32)), atol=2e-2, rtol=2e-2
  )


@pytest.mark.parametrize("name", sorted(REFS))
def test_get_activation_returns_named_function(name):
  x = jnp.asarray(X, jnp.float32)
  np.testing.assert_allclose(get_activation(name)(x), REFS[name](X), atol=1e-6, rtol=1e-6)


def test_get_activation_unknown_name_lists_names():
  with pytest.raises(ValueError) as info:
    get_activation("swish")  # type: ignore[arg-type]
  msg = str(info.value)
  assert "swish" in msg
  for name in ("relu", "gelu", "gelu_tanh", "silu"):
    assert repr(name) in msg


def gate_up(seed):
  rng = np.random.default_rng(seed)
  return (
    jnp.asarray(3 * rng.standard_normal((2, 3, 8)), jnp.float32),
    jnp.asarray(rng.standard_normal((2, 3, 8)), jnp.float32),
  )


def test_swiglu_is_silu_gate_times_up():
  gate, up = gate_up(0)
  np.testing.assert_allclose(
    swiglu(gate, up), silu_ref(gate) * np.asarray(up, np.float64), atol=1e-6, rtol=1e-5
  )


@pytest.mark.parametrize("approximate", [False, True])
def test_geglu_is_gelu_gate_times_up(approximate):
  gate, up = gate_up(1)
  act = gelu_tanh_ref if approximate else gelu_ref
  np.testing.assert_allclose(
    geglu(gate, up, approximate=approximate),
    act(gate) * np.asarray(up, np.float64),
    atol=1e-6,
    rtol=1e-5,
  )


def test_gated_relu_is_reglu():
  gate, up = gate_up(2)
  np.testing.assert_allclose(
    gated("relu", gate, up), relu_ref(gate) * np.asarray(up, np.float64), atol=1e-6, rtol=1e-6
  )


def test_gated_unknown_activation_raises():
  gate, up = gate_up(3)
  with pytest.raises(ValueError, match="unknown activation"):
    gated("tanh", gate, up)  # type: ignore[arg-type]


def test_activations_vmap_and_jit_equal_loop():
  gate, up = gate_up(4)
  got = jax.jit(jax.vmap(swiglu))(gate, up)
  for e in range(gate.shape[0]):
    np.testing.assert_allclose(got[e], swiglu(gate[e], up[e]), atol=1e-6)


def test_activations_work_under_strict_rank_promotion():
  gate, up = gate_up(5)
  with jax.numpy_rank_promotion("raise"):  # tracing (eval_shape) hits the check
    for name in REFS:
      jax.eval_shape(lambda name=name: gated(name, gate, up))
    jax.eval_shape(lambda: dropout(gate, 0.5, jax.random.key(0)))


# --------------------------------------------------------------------------------------------------
# Derivatives: gelu, gelu_tanh and silu carry their derivative as a JVP rule (one saved residual).

SMOOTH = ("gelu", "gelu_tanh", "silu")


def central_difference(f, x, h=1e-5):
  """float64 central difference of a float64 NumPy function."""
  return (f(x + h) - f(x - h)) / (2 * h)


@pytest.mark.parametrize("name", SMOOTH)
def test_activation_gradient_matches_float64_finite_difference(name):
  x = jnp.asarray(X, jnp.float32)
  grad = jax.jit(jax.vmap(jax.grad(FUNCS[name])))(x)
  np.testing.assert_allclose(grad, central_difference(REFS[name], X), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", SMOOTH)
def test_activation_forward_mode_equals_reverse_mode(name):
  x = jnp.asarray(X, jnp.float32)
  tangent = jnp.asarray(np.random.default_rng(0).standard_normal(X.shape), jnp.float32)
  out, jvp = jax.jvp(FUNCS[name], (x,), (tangent,))
  np.testing.assert_allclose(out, REFS[name](X), atol=1e-6, rtol=1e-6)
  _, vjp = jax.vjp(FUNCS[name], x)
  np.testing.assert_allclose(jvp, vjp(tangent)[0], atol=1e-6, rtol=1e-6)


SECOND_DERIVATIVES = """
import json, sys
import jax, jax.numpy as jnp
from transformer_jax import ops
names, x = json.load(sys.stdin)
x = jnp.asarray(x, jnp.float32)
json.dump({n: jax.vmap(jax.grad(jax.grad(getattr(ops, n))))(x).tolist() for n in names}, sys.stdout)
"""


@pytest.fixture(scope="module")
def second_derivatives():
  """float32 second derivatives of SMOOTH at ``X[::10]`` as the library's users get them: computed
  in a fresh process with XLA's default emitters. Near saturation the second derivative is a
  difference of nearly equal terms, and the older emitters this harness compiles with
  (tests/conftest.py) round tanh's tail differently (errors ~5e-5 there)."""
  flags = os.environ.get("XLA_FLAGS", "").replace(OLDER_EMITTERS, "")
  res = subprocess.run(
    [sys.executable, "-c", SECOND_DERIVATIVES],
    input=json.dumps([list(SMOOTH), X[::10].tolist()]),
    env={**os.environ, "XLA_FLAGS": flags},
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert res.returncode == 0, res.stderr[-2000:]
  return {k: np.asarray(v, np.float32) for k, v in json.loads(res.stdout).items()}


@pytest.mark.parametrize("name", SMOOTH)
def test_activation_second_derivative_matches_float64(name, second_derivatives):
  x = X[::10]
  want = central_difference(lambda z: central_difference(REFS[name], z, 1e-4), x, 1e-4)
  np.testing.assert_allclose(second_derivatives[name], want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("name", SMOOTH)
def test_activation_backward_keeps_one_array(name, capsys):
  """Autodiff of ``jax.nn.gelu(approximate=True)`` keeps x, tanh and three products (5 arrays of
  the activation's shape, the memory of a training step's MLP); the rule keeps its derivative."""
  x = jnp.ones((3, 16), jnp.float32)
  print_saved_residuals(lambda x: FUNCS[name](x).sum(), x)
  saved = [line for line in capsys.readouterr().out.splitlines() if line.startswith("f32[3,16]")]
  assert len(saved) == 1, saved


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("name", sorted(REFS))
def test_packed_activation_has_the_rules_values_and_gradients(name, dtype):
  """Same numbers as the JVP rule's reverse mode (bitwise), alone and gated; float32 gradients
  against float64 NumPy (finite differences) through it too."""
  rng = np.random.default_rng(3)
  x, up, dy = (jnp.asarray(rng.standard_normal((4, 61)) * 3, dtype) for _ in range(3))
  for f, g, args in (
    (FUNCS[name], lambda x: packed_activation(name, x), (x,)),
    (lambda x, u: gated(name, x, u), lambda x, u: packed_activation(name, x, u), (x, up)),
  ):
    want, want_vjp = jax.vjp(f, *args)
    got, got_vjp = jax.vjp(g, *args)
    assert got.dtype == dtype
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    for a, b in zip(got_vjp(dy), want_vjp(dy), strict=True):
      assert a.dtype == dtype
      np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
  if name in SMOOTH:
    grad = jax.jit(jax.vmap(jax.grad(lambda x: packed_activation(name, x))))(
      jnp.asarray(X, jnp.float32)
    )
    np.testing.assert_allclose(grad, central_difference(REFS[name], X), atol=1e-5, rtol=1e-5)
  with pytest.raises(ValueError, match="unknown activation 'tanh'"):
    packed_activation("tanh", x)


@only_on("cpu", "XLA:CPU's compiled scan (bf16 residuals as bits)")
def test_packed_activation_stacks_its_bf16_residual_in_place_in_a_scan():
  """The rule's saved ``df(x)`` is a bfloat16 stack, which XLA:CPU updates in float32 by
  converting the whole ``[L, ...]`` array at every layer; the packed form stacks uint16 bits."""
  ws = jnp.asarray(np.random.default_rng(0).standard_normal((3, 24, 24)), jnp.float32)
  x = jnp.asarray(np.random.default_rng(1).standard_normal((16, 24)), jnp.bfloat16)

  def loss(act):
    def layer(h, w):  # cpu.matmul.matmul saves its own input as bits ([3, 24, 16] stacked)
      return act(matmul.matmul(h, w, dtype=jnp.bfloat16)), None

    return lambda ws, x: jnp.sum(jax.lax.scan(layer, x, ws)[0].astype(jnp.float32) ** 2)

  packed = jax.jit(jax.grad(loss(lambda h: packed_activation("gelu_tanh", h)))).lower(ws, x)
  rule = jax.jit(jax.grad(loss(gelu_tanh))).lower(ws, x)
  hlo, rule_hlo = packed.compile().as_text(), rule.compile().as_text()
  if jax.default_backend() == "cpu":  # the float32 update this avoids is XLA:CPU's
    assert re.search(r"f32\[3,16,24\]\{[^}]*\} dynamic-update-slice\(", rule_hlo)
  assert not re.search(r"f32\[3,16,24\]\{[^}]*\} dynamic-update-slice\(", hlo)
  assert re.search(r"u16\[3,16,24\]\{[^}]*\} dynamic-update-slice\(", hlo)


# --------------------------------------------------------------------------------------------------
# Dropout.


def test_dropout_without_rng_is_identity():
  x = jnp.arange(10.0)
  assert dropout(x, 0.5, None) is x


def test_dropout_rate_zero_is_identity():
  x = jnp.arange(10.0)
  np.testing.assert_array_equal(dropout(x, 0.0, jax.random.key(0)), x)


def test_dropout_zero_fraction_is_about_rate():
  x = jnp.ones((200, 500))
  for rate in (0.1, 0.5, 0.9):
    y = np.asarray(dropout(x, rate, jax.random.key(1)))
    assert abs(np.mean(y == 0.0) - rate) < 0.01, rate


def test_dropout_scales_kept_values_by_inverse_keep_probability():
  x = jnp.asarray(np.random.default_rng(2).uniform(1.0, 2.0, (1000,)), jnp.float32)
  y = np.asarray(dropout(x, 0.25, jax.random.key(3)))
  kept = y != 0.0
  assert 0 < kept.sum() < kept.size
  np.testing.assert_allclose(y[kept], np.asarray(x)[kept] / 0.75, rtol=1e-6)


def test_dropout_preserves_mean_statistically():
  x = jnp.asarray(np.random.default_rng(4).uniform(0.0, 2.0, (100_000,)), jnp.float32)
  y = np.asarray(dropout(x, 0.3, jax.random.key(5)), np.float64)
  # std of the mean ~ sqrt(0.3/0.7) * rms(x) / sqrt(n) ~ 0.003.
  assert abs(y.mean() - float(np.mean(np.asarray(x, np.float64)))) < 0.015


def test_dropout_deterministic_given_key():
  x = jnp.ones((64,))
  a = dropout(x, 0.5, jax.random.key(6))
  np.testing.assert_array_equal(a, dropout(x, 0.5, jax.random.key(6)))
  assert not np.array_equal(a, dropout(x, 0.5, jax.random.key(7)))


def test_dropout_keeps_dtype():
  x = jnp.ones((64,), jnp.bfloat16)
  y = dropout(x, 0.5, jax.random.key(8))
  assert y.dtype == jnp.bfloat16
  assert set(np.unique(np.asarray(y, np.float32))) <= {0.0, 2.0}


@pytest.mark.parametrize("rate", [1.0, 1.5, -0.1])
def test_dropout_raises_when_rate_out_of_range(rate):
  with pytest.raises(ValueError, match="rate"):
    dropout(jnp.ones(4), rate, jax.random.key(0))


def test_dropout_works_under_jit_and_vmap():
  x = jnp.ones((3, 1000))
  keys = jax.random.split(jax.random.key(9), 3)
  y = np.asarray(jax.jit(jax.vmap(lambda x_, k_: dropout(x_, 0.5, k_)))(x, keys))
  for e in range(3):
    assert abs(np.mean(y[e] == 0.0) - 0.5) < 0.06
    assert set(np.unique(y[e])) <= {0.0, 2.0}
  assert not np.array_equal(y[0], y[1])  # independent keys, independent masks
