"""``tjax generate`` / ``tjax fill-mask`` on tiny run directories (random weights saved with
``save_model`` next to a prepared dataset): output against references, streaming, and every
error."""

import functools
import os
import random
import struct

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml
from flax import nnx

from transformer_jax import cli, data, generate, models
from transformer_jax.backends.cpu import poll
from transformer_jax.cli import generate as generate_cli
from transformer_jax.generate import stream
from transformer_jax.generate.fill_mask import encode_masked
from transformer_jax.runs import load_run, save_model
from tests.generate.conftest import last_logits
from tests.backends.cpu.test_poll import _fds_on

MAX_LEN = 32


def random_params(config, seed=0):
  """N(0, 0.3^2) parameters drawn with NumPy: no compiled initialisation to wait for."""
  rng = np.random.default_rng(seed)
  return jax.tree.map(
    lambda s: jnp.asarray(rng.normal(0.0, 0.3, s.shape), s.dtype), models.init_abstract(config)
  )


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """A prepared text dataset, a GPT run and a BERT run on it, and a run without a checkpoint."""
  root = tmp_path_factory.mktemp("cmd")
  rng = random.Random(0)
  words = ["alpha", "beta", "gamma", "def", "return", "self", "class", "for", "in", "x", "y"]
  corpus = root / "corpus"
  corpus.mkdir()
  for d in range(8):
    lines = [" ".join(rng.choice(words) for _ in range(rng.randint(3, 9))) for _ in range(10)]
    (corpus / f"doc{d}.txt").write_text("\n".join(lines) + "\n")
  ds = str(root / "ds")
  data.prepare([str(corpus)], ds, compact_vocab=True, progress=False, val_fraction=2)
  vocab = data.load_dataset(ds).vocab_size
  out = {"data": ds}
  for name, preset in (("gpt", "gpt2-tiny"), ("bert", "bert-tiny")):
    config = models.get_config(preset, vocab_size=vocab, max_len=MAX_LEN)
    run_dir = str(root / name)
    save_model(run_dir, config, random_params(config))
    with open(os.path.join(run_dir, "config.yaml"), "w") as f:
      yaml.safe_dump({"data": {"path": ds}}, f)
    out[name] = run_dir
  empty = root / "empty"
  empty.mkdir()
  (empty / "model.yaml").write_text((root / "gpt" / "model.yaml").read_text())
  (empty / "config.yaml").write_text(yaml.safe_dump({"data": {"path": ds}}))
  out["empty"] = str(empty)
  return out


def tjax(capsys, *argv):
  code = cli.main(list(argv))
  captured = capsys.readouterr()
  return code, captured.out, captured.err


@functools.lru_cache(maxsize=None)
def restored(run_dir):
  config, params, tok = load_run(run_dir)
  return config, params, tok


def naive_sample(config, params, prompt, n, key, *, temperature, top_k, eos_id, suppress):
  """Full forward passes (no cache), one token at a time, with generate's sampling keys."""
  seq, out = list(prompt), []
  for i in range(n):
    logits = np.array(last_logits(params, config, seq))
    logits[list(suppress)] = -np.inf
    tok = int(
      generate.next_token(
        jnp.asarray(logits)[None], jax.random.fold_in(key, i), temperature=temperature, top_k=top_k
      )[0]
    )
    if tok == eos_id:
      break
    out.append(tok)
    seq.append(tok)
  return out


def _watch_poll(tmp_path, monkeypatch):
  """A stand-in for /dev/cpu_dma_latency, and the list of how many descriptors were open on it
  each time decoding started."""
  device = tmp_path / "cpu_dma_latency"
  device.write_bytes(b"")
  monkeypatch.setattr(poll, "CPU_DMA_LATENCY", str(device))
  monkeypatch.delenv(poll.POLL_ENV, raising=False)
  held = []

  def streamed(*a, **kw):
    held.append(_fds_on(device))
    yield from stream.stream_generate(*a, **kw)

  monkeypatch.setattr(generate_cli, "stream_generate", streamed)
  return device, held


def test_generate_prints_prompt_and_sampled_continuation(runs, capsys, tmp_path, monkeypatch):
  # With --cpu-poll it decodes holding the polling request (a stand-in file here), and only while
  # decoding.
  device, held = _watch_poll(tmp_path, monkeypatch)
  code, out, err = tjax(
    capsys,
    "generate",
    runs["gpt"],
    "--prompt",
    "def alpha",
    "--max-new-tokens",
    "20",
    "--seed",
    "3",
    "--chunk",
    "6",
    "--cpu-poll",
  )
  assert code == 0, err
  assert held == [1] and _fds_on(device) == 0 and device.read_bytes() == struct.pack("i", 0)
  config, params, tok = restored(runs["gpt"])
  suppress = sorted(set(tok.special_ids.values()) - {tok.eot_id})
  want = naive_sample(
    config,
    params,
    tok.encode("def alpha"),
    20,
    jax.random.key(3),
    temperature=0.8,
    top_k=40,
    eos_id=tok.eot_id,
    suppress=suppress,
  )
  assert out == "def alpha" + tok.decode(want) + "\n"
  assert len(want) > 0 and not set(want) & set(suppress)


def test_generate_asks_for_polling_cpus_only_when_told(runs, capsys, tmp_path, monkeypatch):
  device, held = _watch_poll(tmp_path, monkeypatch)
  argv = ("generate", runs["gpt"], "--prompt", "def", "--max-new-tokens", "2")
  code, _, err = tjax(capsys, *argv)
  assert code == 0 and err == "" and held == [0] and device.read_bytes() == b""
  monkeypatch.setenv(poll.POLL_ENV, "1")
  code, _, err = tjax(capsys, *argv)
  assert code == 0 and held == [0, 1]
  code, _, err = tjax(capsys, *argv, "--no-cpu-poll")  # the flag over the environment
  assert code == 0 and held == [0, 1, 0]
  # Asked for but not allowed: one line says so, and it decodes all the same.
  monkeypatch.setattr(poll, "CPU_DMA_LATENCY", str(tmp_path / "absent"))
  code, out, err = tjax(capsys, *argv, "--cpu-poll")
  assert code == 0 and out.startswith("def") and err.count("\n") == 1
  assert err.startswith("tjax generate: --cpu-poll has no effect: cannot open")


@pytest.mark.parametrize(
  "option, value, message",
  [
    ("--temperature", "-1", "--temperature -1.0 must be a number >= 0"),
    ("--temperature", "nan", "--temperature nan must be a number >= 0"),
    ("--top-k", "0", "--top-k 0 must be >= 1"),
    ("--chunk", "0", "--chunk 0 must be >= 1"),
    ("--length-penalty", "inf", "--length-penalty inf must be a finite number"),
    ("--seed", str(2**63), f"--seed {2**63} must be in [-2**63, 2**63)"),
    ("--max-new-tokens", "-3", "--max-new-tokens -3 must be >= 1"),
  ],
)
def test_a_bad_option_is_one_line_before_any_output(
  runs, capsys, monkeypatch, option, value, message
):
  """Every option is checked before the prompt is printed: nothing on stdout, one line naming the
  option and its value on stderr."""
  code, out, err = tjax(capsys, "generate", runs["gpt"], "--prompt", "the fox", option, value)
  assert (code, out) == (2, "")
  assert err.startswith(f"tjax generate: error: {message}") and err.count("\n") == 1, err


def test_a_bad_cpu_poll_setting_is_one_line_before_any_output(runs, capsys, monkeypatch):
  monkeypatch.setenv(poll.POLL_ENV, "sometimes")
  code, out, err = tjax(capsys, "generate", runs["gpt"], "--prompt", "def")
  assert (code, out) == (2, "") and err.count("\n") == 1
  assert "TJAX_CPU_POLL='sometimes' must be 1 or 0" in err


def test_generate_with_beams_prints_best_hypothesis(runs, capsys):
  code, out, err = tjax(
    capsys,
    "generate",
    runs["gpt"],
    "--prompt",
    "class",
    "--num-beams",
    "3",
    "--max-new-tokens",
    "8",
  )
  assert code == 0, err
  config, params, tok = restored(runs["gpt"])
  suppress = sorted(set(tok.special_ids.values()) - {tok.eot_id})
  best = generate.beam_search(
    (config, params),
    [tok.encode("class")],
    num_beams=3,
    max_new_tokens=8,
    eos_id=tok.eot_id,
    suppress_ids=suppress,
  )
  new = np.asarray(best.sequences[0]).tolist()
  new = new[: new.index(tok.eot_id)] if tok.eot_id in new else new
  assert out == "class" + tok.decode(new) + "\n"


def test_fill_mask_prints_top_k_per_mask(runs, capsys):
  text = "def [MASK] in x [MASK]"
  code, out, err = tjax(capsys, "fill-mask", runs["bert"], text, "--top-k", "3")
  assert code == 0, err
  config, params, tok = restored(runs["bert"])
  ids = (
    [tok.cls_id]
    + tok.encode("def")
    + [tok.mask_id]
    + tok.encode(" in x")
    + [tok.mask_id]
    + [tok.sep_id]
  )
  assert encode_masked(tok, text) == ids
  logits = np.asarray(
    nnx.merge(models.graphdef(config), params)(np.asarray([ids])).mlm_logits, np.float64
  )[0]
  lines = out.splitlines()
  assert len(lines) == 2 * 4 + 1
  words = []
  for m, col in enumerate(np.flatnonzero(np.asarray(ids) == tok.mask_id)):
    p = np.exp(logits[col] - logits[col].max())
    p /= p.sum()
    top = np.argsort(-p)[:3]
    assert lines[4 * m] == f"[MASK] {m + 1} of 2:"
    for j, cand in enumerate(top):
      assert lines[4 * m + 1 + j] == f"  {p[cand]:7.2%}  {tok.decode([cand])!r}"
    word = tok.decode([top[0]])
    words.append(word if word[:1].isspace() else " " + word)  # keeps the space before [MASK]
  assert lines[-1] == f"best: def{words[0]} in x{words[1]}"


@pytest.mark.parametrize(
  "argv, message",
  [
    (["generate", "{gpt}", "--prompt", ""], "the prompt is empty"),
    (
      ["generate", "{gpt}", "--prompt", " alpha" * 40],
      "too long for the model's context max_len=32",
    ),
    (
      ["generate", "{gpt}", "--prompt", "x", "--max-new-tokens", "40"],
      "--max-new-tokens 40 must be in [1, 31]",
    ),
    (["generate", "{gpt}", "--prompt", "x", "--max-new-tokens", "0"], "--max-new-tokens 0"),
    (["generate", "{gpt}", "--prompt", "x", "--top-p", "0"], "--top-p 0.0 must be in (0, 1]"),
    (["generate", "{gpt}", "--prompt", "x", "--top-p", "1.5"], "--top-p 1.5 must be in (0, 1]"),
    (
      ["generate", "{gpt}", "--prompt", "x", "--num-beams", "2", "--temperature", "1"],
      "--num-beams > 1 searches deterministically",
    ),
    (["generate", "{empty}", "--prompt", "x"], "has no checkpoint"),
    (["generate", "{data}", "--prompt", "x"], "is not a run directory (no model.yaml)"),
    (["generate", "{bert}", "--prompt", "x"], "is a BERT run"),
    (["fill-mask", "{bert}", "no mask here"], "the text has no [MASK] to fill"),
    (["fill-mask", "{gpt}", "a [MASK]"], "is a GPT run: fill-mask needs a BERT"),
    (["fill-mask", "{bert}", "x [MASK]" + " alpha" * 40], "longer than the model's context"),
  ],
)
def test_bad_input_exits_2_with_one_line(runs, capsys, argv, message):
  code, out, err = tjax(capsys, *[a.format(**runs) for a in argv])
  assert code == 2 and out == ""
  assert err.count("\n") == 1 and err.startswith(f"tjax {argv[0]}: error: ")
  assert message in err, err
