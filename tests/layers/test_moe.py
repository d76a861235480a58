"""Tests for ``transformer_jax.layers.moe`` and the backends' grouped product, against a float64
per-token reference (PyTorch autograd for the gradients)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import transformer_jax as tj
from transformer_jax import backends
from transformer_jax.backends.cpu.grouped import blocked_grouped_matmul
from transformer_jax.backends.tpu import megablox_grouped_matmul
from transformer_jax.layers.moe import MoE, MoEKind

torch = pytest.importorskip("torch")

D, F, E, B, T = 8, 12, 4, 2, 7


def make(kind: MoEKind, seed=0):
  return MoE(
    D,
    kind,
    activation="silu",
    init_std=0.3,
    out_init_std=0.3,
    dtype=jnp.float32,
    param_dtype=jnp.float32,
    rngs=nnx.Rngs(seed),
  )


def inputs(seed=1):
  return jnp.asarray(np.random.default_rng(seed).standard_normal((B, T, D)), jnp.float32)


def reference(layer: MoE, x, cot, kind: MoEKind, keep=None):
  """Per token: softmax over the router, top-k, renormalised, sum of w * SwiGLU expert (float64
  torch); returns (y, grads of sum(y * cot) w.r.t. x and each weight). ``keep [N, k]``: copies
  that count (a capacity's)."""
  t = lambda a: torch.tensor(np.asarray(a, np.float64), requires_grad=True)  # noqa: E731
  w = {
    "x": t(np.asarray(x).reshape(-1, D)),
    "router": t(layer.router.kernel[...]),
    "gate": t(layer.gate[...]),
    "up": t(layer.up[...]),
    "down": t(layer.down[...]),
  }
  probs = torch.softmax(w["x"] @ w["router"], -1)
  top, idx = torch.topk(probs, kind.top_k, -1)
  if kind.normalize:
    top = top / top.sum(-1, keepdim=True)
  ys = []
  for n in range(w["x"].shape[0]):
    y = 0.0
    for j in range(kind.top_k):
      if keep is not None and not keep[n, j]:
        continue
      e = int(idx[n, j])
      xe = w["x"][n]
      h = torch.nn.functional.silu(xe @ w["gate"][e]) * (xe @ w["up"][e])
      y = y + top[n, j] * (h @ w["down"][e])
    ys.append(y if torch.is_tensor(y) else torch.zeros(D, dtype=torch.float64))
  y = torch.stack(ys)
  (y * torch.tensor(np.asarray(cot, np.float64).reshape(-1, D))).sum().backward()
  return y.detach().numpy().reshape(B, T, D), {k: v.grad.numpy() for k, v in w.items()}, idx


def grads(layer, x, cot):
  graphdef, params = nnx.split(layer)

  def f(params, x):
    y, _ = nnx.merge(graphdef, params)(x)
    return jnp.sum(y * cot)

  gp, gx = jax.jit(jax.grad(f, argnums=(0, 1)))(params, x)
  return {
    "x": np.asarray(gx).reshape(-1, D),
    "router": np.asarray(gp["router"]["kernel"][...]),
    **{n: np.asarray(gp[n][...]) for n in ("gate", "up", "down")},
  }


@pytest.mark.parametrize("impl", ["grouped", "dense"])
@pytest.mark.parametrize("top_k,normalize", [(2, True), (1, False)])
def test_moe_matches_per_token_reference(impl, top_k, normalize):
  kind = MoEKind(num_experts=E, top_k=top_k, d_ff=F, normalize=normalize, impl=impl)
  layer, x = make(kind), inputs()
  cot = jnp.asarray(np.random.default_rng(2).standard_normal((B, T, D)), jnp.float32)
  y, stats = layer(x)
  y_ref, g_ref, idx = reference(layer, x, cot, kind)
  # float32 products of width <= 12 over values of size ~1: relative error well under 1e-5.
  np.testing.assert_allclose(np.asarray(y), y_ref, rtol=1e-5, atol=1e-5)
  for name, g in grads(layer, x, cot).items():
    np.testing.assert_allclose(g, g_ref[name], rtol=1e-4, atol=1e-5, err_msg=name)
  counts = np.bincount(idx.numpy().reshape(-1), minlength=E)
  np.testing.assert_array_equal(np.asarray(stats["tokens_per_expert"]), counts)
  assert float(stats["dropped"]) == 0.0


def test_dropless_keeps_every_token_when_all_choose_one_expert():
  kind = MoEKind(num_experts=E, top_k=1, d_ff=F, normalize=True)
  layer = make(kind)
  # Every token routed to expert 2: a router that only sees a constant feature.
  k = np.zeros((D, E), np.float32)
  k[0, 2] = 10.0
  layer.router.kernel[...] = jnp.asarray(k)
  x = inputs().at[..., 0].set(1.0)
  y, stats = layer(x)
  assert float(stats["tokens_per_expert"][2]) == B * T
  y_ref, _, _ = reference(layer, x, jnp.zeros_like(x), kind)
  np.testing.assert_allclose(np.asarray(y), y_ref, rtol=1e-5, atol=1e-5)
  assert np.abs(np.asarray(y)).min(axis=-1).all()  # no token's output left at zero
  # The same routing under a capacity factor drops all but the expert's capacity.
  capped = make(MoEKind(num_experts=E, top_k=1, d_ff=F, capacity_factor=1.0))
  nnx.update(capped, nnx.state(layer))
  y_cap, stats_cap = capped(x)
  cap = int(np.ceil(B * T / E))
  assert float(stats_cap["dropped"]) == B * T - cap
  keep = (np.arange(B * T) < cap)[:, None]
  y_ref, _, _ = reference(layer, x, jnp.zeros_like(x), kind, keep=keep)
  np.testing.assert_allclose(np.asarray(y_cap), y_ref, rtol=1e-5, atol=1e-5)


def test_capacity_path_matches_reference_with_drops():
  kind = MoEKind(num_experts=E, top_k=2, d_ff=F, capacity_factor=0.5)
  layer, x = make(kind, seed=3), inputs(4)
  cot = jnp.asarray(np.random.default_rng(5).standard_normal((B, T, D)), jnp.float32)
  y, stats = layer(x)
  _, _, idx = reference(layer, x, cot, kind)
  # Slots first come first served: all first choices in token order, then second choices.
  cap, seen, keep = int(np.ceil(0.5 * B * T * 2 / E)), np.zeros(E, int), np.zeros((B * T, 2), bool)
  for j in range(2):
    for n in range(B * T):
      e = int(idx[n, j])
      keep[n, j] = seen[e] < cap
      seen[e] += 1
  assert 0 < (~keep).sum() == float(stats["dropped"])
  y_ref, g_ref, _ = reference(layer, x, cot, kind, keep=keep)
  np.testing.assert_allclose(np.asarray(y), y_ref, rtol=1e-5, atol=1e-5)
  for name, g in grads(layer, x, cot).items():
    np.testing.assert_allclose(g, g_ref[name], rtol=1e-4, atol=1e-5, err_msg=name)


def test_shared_experts_add_a_dense_mlp():
  kind = MoEKind(num_experts=E, top_k=2, d_ff=F, num_shared=2, shared_d_ff=3)
  layer, x = make(kind), inputs()
  y, _ = layer(x)
  assert layer.shared.up.kernel.shape == (D, 6)
  y_ref, _, _ = reference(layer, x, jnp.zeros_like(x), kind)
  np.testing.assert_allclose(
    np.asarray(y), y_ref + np.asarray(layer.shared(x)), rtol=1e-5, atol=1e-5
  )


def gmm_ref(x, w, sizes):
  out, start = [], 0
  for e, s in enumerate(sizes):
    out.append(np.asarray(x[start : start + s], np.float64) @ np.asarray(w[e], np.float64))
    start += s
  return np.concatenate(out)


def grouped_fn(kernel: str):
  """The grouped product ``kernel``: ``fn(x, w, sizes) -> [M, N]`` in float32."""
  match kernel.split("_"):
    case ["ragged", "dot"]:
      return lambda x, w, s: jax.lax.ragged_dot(x, w, s)
    case ["blocked", b]:
      return lambda x, w, s: blocked_grouped_matmul(x, w, s, dtype=jnp.float32, block=int(b))
    case ["backend"]:  # the default backend's (on CPU the blocked form)
      return lambda x, w, s: backends.current().grouped_matmul(x, w, s, dtype=jnp.float32)
    case ["megablox", "interpret"]:
      return lambda x, w, s: megablox_grouped_matmul(x, w, s, dtype=jnp.float32, interpret=True)


KERNELS = ["ragged_dot", "blocked_1", "blocked_4", "blocked_64", "backend", "megablox_interpret"]


@pytest.mark.parametrize("kernel", KERNELS)
def test_grouped_matmul_matches_reference(kernel):
  r = np.random.default_rng(6)
  x = jnp.asarray(r.standard_normal((21, 16)), jnp.float32)
  w = jnp.asarray(r.standard_normal((4, 16, 24)), jnp.float32)
  sizes = np.array([5, 0, 12, 4])
  fn = grouped_fn(kernel)
  # 16-term float32 sums of products of unit normals: within 1e-5 relative of float64.
  y = fn(x, w, jnp.asarray(sizes))
  np.testing.assert_allclose(np.asarray(y), gmm_ref(x, w, sizes), rtol=1e-5, atol=1e-5)
  cot = r.standard_normal((21, 24))
  gx, gw = jax.grad(lambda x, w: jnp.sum(fn(x, w, jnp.asarray(sizes)) * cot), argnums=(0, 1))(x, w)
  start, gx_ref, gw_ref = 0, np.zeros((21, 16)), np.zeros((4, 16, 24))
  for e, s in enumerate(sizes):
    xs, cs = np.asarray(x[start : start + s], np.float64), cot[start : start + s]
    gx_ref[start : start + s] = cs @ np.asarray(w[e], np.float64).T
    gw_ref[e] = xs.T @ cs
    start += s
  np.testing.assert_allclose(np.asarray(gx), gx_ref, rtol=1e-5, atol=1e-4)
  np.testing.assert_allclose(np.asarray(gw), gw_ref, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("block", [1, 3, 8])
@pytest.mark.parametrize("sizes", [[0, 21, 0, 0], [1, 1, 1, 1], [9, 0, 2, 3]])
def test_blocked_grouped_matmul_equals_ragged_dot(block, sizes):
  """Groups that fill whole blocks or none, single rows, and rows past the groups (zeros, as
  ragged_dot gives them): the same numbers and gradients as ``jax.lax.ragged_dot``."""
  r = np.random.default_rng(7)
  x = jnp.asarray(r.standard_normal((21, 16)), jnp.float32)
  w = jnp.asarray(r.standard_normal((4, 16, 24)), jnp.float32)
  cot = jnp.asarray(r.standard_normal((21, 24)), jnp.float32)
  out = {}
  for kernel in ("ragged_dot", f"blocked_{block}"):
    fn = grouped_fn(kernel)
    f = lambda x, w: jnp.sum(fn(x, w, jnp.asarray(sizes)) * cot)  # noqa: E731
    out[kernel] = (fn(x, w, jnp.asarray(sizes)), *jax.grad(f, argnums=(0, 1))(x, w))
  total = sum(sizes)
  np.testing.assert_array_equal(np.asarray(out[f"blocked_{block}"][0])[total:], 0.0)
  for a, b in zip(out["ragged_dot"], out[f"blocked_{block}"]):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-5)


def test_blocked_grouped_matmul_refuses_a_bad_block():
  x, w = jnp.zeros((4, 2)), jnp.zeros((2, 2, 3))
  with pytest.raises(ValueError, match="block=0"):
    blocked_grouped_matmul(x, w, jnp.asarray([2, 2]), dtype=jnp.float32, block=0)


# Plain MLP layers among the expert layers (GPTConfig.dense_layers): two stacks, run in order.
MIXED = dict(
  vocab_size=61, d_model=16, num_layers=4, num_heads=2, d_ff=32, max_len=32, num_experts=4,
  expert_d_ff=8, dense_layers=[2, 0],
)  # fmt: skip


def test_dense_layers_build_two_stacks_run_in_order():
  cfg = tj.models.get_config("moe-tiny", **MIXED)
  assert cfg.dense_layers == (0, 2)
  tok = jnp.asarray(np.random.default_rng(0).integers(0, 61, (2, 9)), jnp.int32)
  out = {}
  for scan in (True, False):
    model = tj.models.GPT(dataclasses.replace(cfg, scan_layers=scan), rngs=nnx.Rngs(0))
    stats = []
    out[scan] = np.asarray(model(tok, moe_stats=stats)), stats[0]
  params = nnx.state(model, nnx.Param)
  assert params["blocks"]["dense_layers"]["mlp"]["gate"]["kernel"][...].shape == (2, 16, 32)
  assert params["blocks"]["layers"]["mlp"]["gate"][...].shape == (2, 4, 16, 8)
  # Router statistics of the two expert layers only.
  assert out[True][1]["tokens_per_expert"].shape == (2, 4)
  np.testing.assert_allclose(out[True][0], out[False][0], atol=1e-6)
  # The same function as the blocks called one by one, each kind from its own stack.
  blocks = model.blocks
  x = model.embed(tok)
  kw = dict(positions=jnp.arange(9)[None], causal=True)
  for i, name, j in [(0, "dense_layers", 0), (1, "layers", 0), (2, "dense_layers", 1),
                     (3, "layers", 1)]:  # fmt: skip
    graphdef, p = nnx.split(getattr(blocks, name))
    x = nnx.merge(graphdef, jax.tree.map(lambda a: a[j], p))(x, **kw)[0]
  manual = np.asarray(model.logits(model.final_norm(x)))
  np.testing.assert_allclose(out[False][0], manual, atol=1e-6)
  # Counting: every parameter of the model, the unchosen experts of the expert layers inactive.
  pc = tj.models.param_count(cfg)
  assert pc.total == sum(a.size for a in jax.tree.leaves(params))
  assert pc.inactive == 2 * (4 - 2) * 3 * 16 * 8


@pytest.mark.parametrize(
  "change,match",
  [
    (dict(dense_layers=[4]), r"dense_layers=\[4\]: \[4\] outside \[0, num_layers=4\)"),
    (dict(dense_layers=[-1]), r"\[-1\] outside"),
    (dict(dense_layers=[1, 1]), r"names layers \[1\] more than once"),
    (dict(dense_layers=[0, 1, 2, 3]), "every layer dense"),
    (dict(dense_layers=[0], num_experts=0), r"dense_layers=\[0\] needs num_experts > 0"),
    (dict(dense_layers=[True]), "must be a list of layer indices"),
  ],
)
def test_bad_dense_layers_are_named(change, match):
  with pytest.raises(ValueError, match=match):
    tj.models.get_config("moe-tiny", **{**MIXED, **change})
