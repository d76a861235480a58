"""Weighted mixtures (``data.mixture``): the rows each source gets, purity, process shares, epochs
and the config's checks."""

from fractions import Fraction

import numpy as np
import pytest

from transformer_jax.data import GPTLoader, MixtureLoader, load_dataset, prepare
from transformer_jax.data.mixture import Schedule, prefix_counts
from transformer_jax.train.config import load_experiment

B, T = 8, 32


@pytest.fixture(scope="module")
def sources(tmp_path_factory, make_corpus):
  """Two datasets prepared by ``tjax prepare``'s code path, with one vocabulary: ``web`` (24
  documents) and the small ``code`` (6 documents, which runs out first)."""
  root = tmp_path_factory.mktemp("mixture")
  make_corpus(root / "web_text", num_docs=24, seed=1)
  make_corpus(root / "code_text", num_docs=6, seed=2)
  web, code = str(root / "web"), str(root / "code")
  prepare([str(root / "web_text")], web, compact_vocab=True, val_fraction=2, progress=False)
  prepare(
    [str(root / "code_text")],
    code,
    compact_vocab=True,
    vocab_from=web,
    val_fraction=1,
    progress=False,
  )
  return {"web": load_dataset(web), "code": load_dataset(code)}


def mixture(sources, weights=(0.7, 0.3), **kw) -> MixtureLoader:
  named = [("web", sources["web"], weights[0]), ("code", sources["code"], weights[1])]
  return MixtureLoader(named, batch_size=kw.pop("batch_size", B), seq_len=T, **kw)


def reference_counts(weights, starts, batch_size, steps) -> np.ndarray:
  """Rows per source of each step, ``[steps, S]``: every stage's rows sorted by arrival time
  ``(2j + 1) / w_s`` (exact fractions; ties to the earlier source), the whole sequence built
  and cut into blocks (no prefix counting, no search)."""
  ends = list(starts[1:]) + [steps]
  order = []
  for w, a, b in zip(weights, starts, ends):
    n = (b - a) * batch_size
    keys = [
      (Fraction(2 * j + 1) / Fraction(ws), s) for s, ws in enumerate(w) if ws > 0 for j in range(n)
    ]
    order += [s for _, s in sorted(keys)[:n]]
  one_hot = np.eye(len(weights[0]), dtype=np.int64)[np.array(order)]
  return one_hot.reshape(steps, batch_size, -1).sum(axis=1)


@pytest.mark.parametrize(
  "weights, starts, batch_size",
  [
    ([(0.7, 0.3), (0.5, 0.5), (0.2, 0.0)], [0, 37, 61], B),
    # Exact ties in arrival time (binary fractions), blocks of odd size: the tie rule shows.
    ([(0.5, 0.25, 0.25), (0.75, 0.25, 1.0)], [0, 20], 5),
  ],
)
def test_rows_per_step_match_the_exact_sorted_reference(weights, starts, batch_size):
  schedule = Schedule(starts, weights, batch_size)
  got = np.stack([schedule.consumed(s + 1) - schedule.consumed(s) for s in range(90)])
  np.testing.assert_array_equal(got, reference_counts(weights, starts, batch_size, 90))
  assert (got.sum(axis=1) == batch_size).all()
  paused = [i for i, w in enumerate(weights[-1]) if w == 0]
  assert (got[starts[-1] :, paused] == 0).all()  # a stage weight of 0 pauses the source


@pytest.mark.parametrize("seed", range(4))
def test_every_prefix_holds_its_share_within_half_the_source_count(seed):
  rng = np.random.default_rng(seed)
  w = rng.uniform(0.05, 1.0, 4)
  p = w / w.sum()
  counts = np.stack([prefix_counts([Fraction(x) for x in w], n) for n in range(0, 400, 7)])
  n = np.arange(0, 400, 7)[:, None]
  assert (counts.sum(axis=1) == n[:, 0]).all()
  assert np.abs(counts - n * p).max() <= (len(w) + 1) / 2
  assert (np.diff(counts, axis=0) >= 0).all()  # no source ever loses a row


def test_a_mixture_row_is_the_sources_own_gpt_window(sources):
  loader = mixture(sources)
  source_B, index_B = loader.rows_at(5)
  batch = loader.batch_at(5)
  for name, s in (("web", 0), ("code", 1)):
    alone = GPTLoader(sources[name], batch_size=1, seq_len=T, process_index=0, process_count=1)
    for row in np.flatnonzero(source_B == s):
      own = alone.batch_at(int(index_B[row]))
      for key in own:
        np.testing.assert_array_equal(batch[key][row], own[key][0])


def test_each_source_reads_its_windows_in_order_without_gaps(sources):
  loader = mixture(sources)
  seen = {0: [], 1: []}
  for step in range(12):
    source_B, index_B = loader.rows_at(step)
    for s in seen:
      seen[s] += sorted(index_B[source_B == s].tolist())
  for s, indices in seen.items():
    assert indices == list(range(len(indices)))
    assert len(indices) == loader.schedule.consumed(12)[s]


def test_batch_at_is_a_pure_function_of_the_step(sources):
  loader = mixture(sources, seed=3)
  first = loader.batch_at(40)
  for step in (0, 7, 90):
    loader.batch_at(step)
  again, fresh = loader.batch_at(40), mixture(sources, seed=3).batch_at(40)
  for key in first:
    np.testing.assert_array_equal(first[key], again[key])
    np.testing.assert_array_equal(first[key], fresh[key])
  other = mixture(sources, seed=4).rows_at(40)[0]
  assert not np.array_equal(other, loader.rows_at(40)[0])  # the seed shuffles the block


@pytest.mark.parametrize("step", [0, 3, 31])
def test_two_processes_rows_union_to_the_one_process_batch(sources, step):
  whole = mixture(sources).batch_at(step)
  parts = [mixture(sources, process_index=i, process_count=2).batch_at(step) for i in (0, 1)]
  for key in whole:
    np.testing.assert_array_equal(np.concatenate([p[key] for p in parts]), whole[key])


def test_a_source_that_runs_out_repeats_with_a_notice(sources, capsys):
  loader = mixture(sources)
  windows = loader.loaders[1].num_windows
  step = next(s for s in range(500) if loader.schedule.consumed(s + 1)[1] > windows)
  loader.batch_at(step - 1)
  assert "repeats" not in capsys.readouterr().err
  loader.batch_at(step)
  err = capsys.readouterr().err
  assert f"'code' runs out at step {step} and repeats: epoch 2 of its {windows} windows" in err
  first_epoch = loader.loaders[1].starts_of(np.arange(windows))
  second_epoch = loader.loaders[1].starts_of(np.arange(windows, 2 * windows))
  assert np.unique(first_epoch).size == windows  # each window once an epoch
  assert not np.array_equal(first_epoch, second_epoch)  # in a new order


def test_max_epochs_refuses_the_step_that_would_start_another(sources):
  loader = mixture(sources, max_epochs=1)
  windows = loader.loaders[1].num_windows
  step = next(s for s in range(500) if loader.schedule.consumed(s + 1)[1] > windows)
  loader.check_steps(step)  # the steps before it are fine
  with pytest.raises(ValueError, match=rf"data.max_epochs=1: .*'code'.*epoch 2 at step {step}"):
    loader.check_steps(step + 1)
  with pytest.raises(ValueError, match="data.max_epochs=1"):
    loader.batch_at(step)


def test_tokens_consumed_counts_the_rows_each_source_gave(sources):
  loader = mixture(sources)
  rows = np.zeros(2, np.int64)
  for step in range(20):
    source_B, _ = loader.rows_at(step)
    rows += np.bincount(source_B, minlength=2)
  assert loader.tokens_consumed(20) == {"web": int(rows[0]) * T, "code": int(rows[1]) * T}


def test_sources_with_another_vocabulary_are_refused(sources, tmp_path, make_corpus):
  make_corpus(tmp_path / "text", num_docs=4, seed=5)
  prepare([str(tmp_path / "text")], str(tmp_path / "ds"), compact_vocab=True, progress=False)
  named = [("web", sources["web"], 1.0), ("other", load_dataset(str(tmp_path / "ds")), 1.0)]
  with pytest.raises(ValueError, match="'other'.*another tokenizer or vocabulary"):
    MixtureLoader(named, batch_size=B, seq_len=T)


# ---- the config ------------------------------------------------------------------------------


def experiment(data: dict, *overrides):
  raw = {"run_dir": "/tmp/r", "model": {"preset": "gpt2-tiny"}, "data": data, "train": {}}
  return load_experiment(None, list(overrides), raw=raw)


MIX = [{"name": "web", "path": "/w", "weight": 0.7}, {"name": "code", "path": "/c", "weight": 0.3}]


def test_the_config_reads_a_mixture_with_stages():
  exp = experiment({"mixture": MIX, "stages": [{"step": "1e4", "weights": {"code": 0.5}}]})
  assert [m.name for m in exp.data.mixture] == ["web", "code"]
  assert exp.data.stages[0].step == 10000  # 1e4, as integer fields read it
  assert exp.data.dataset_path == "/w"  # evaluated on the first source
  assert exp.to_dict()["data"]["mixture"][1] == {"name": "code", "path": "/c", "weight": 0.3}


@pytest.mark.parametrize(
  "data, message",
  [
    ({"mixture": [MIX[0], {**MIX[1], "name": "web"}]}, r"data.mixture\[1\].name='web' repeats"),
    ({"mixture": [MIX[0], {"name": "code", "weight": 1}]}, r"data.mixture\[1\].path is missing"),
    ({"mixture": [{**MIX[0], "weight": 0}]}, r"data.mixture\[0\].weight=0.0: expected a positive"),
    ({"mixture": [{**MIX[0], "weight": float("inf")}]}, r"data.mixture\[0\].weight"),
    ({"mixture": [{**MIX[0], "weight": float("nan")}]}, r"data.mixture\[0\].weight"),
    ({"mixture": [{**MIX[0], "wieght": 1}]}, r"did you mean 'weight'"),
    (
      {"mixture": MIX, "stages": [{"step": 5, "weights": {"cod": 1}}]},
      r"data.stages\[0\].weights: unknown source 'cod' \(did you mean 'code'\?\)",
    ),
    (
      {"mixture": MIX, "stages": [{"step": 5, "weights": {"web": 1}}, {"step": 5, "weights": {}}]},
      r"data.stages\[1\].step=5: expected above data.stages\[0\].step=5",
    ),
    ({"mixture": MIX, "stages": [{"step": 0, "weights": {"web": 1}}]}, r"stages\[0\].step=0"),
    (
      {"mixture": MIX, "stages": [{"step": 2.5, "weights": {"web": 1}}]},
      r"data.stages\[0\].step=2.5: expected int",
    ),
    (
      {"mixture": MIX, "stages": [{"step": 5, "weights": {"web": -1}}]},
      r"data.stages\[0\].weights.web=-1: expected a finite number >= 0",
    ),
    (
      {"mixture": MIX, "stages": [{"step": 5, "weights": {"web": 0, "code": 0}}]},
      r"data.stages\[0\]: every source's weight is 0",
    ),
    ({"mixture": MIX, "max_epochs": 0}, r"data.max_epochs=0 must be >= 1"),
    ({"path": "/d", "stages": [{"step": 5, "weights": {"web": 1}}]}, r"data.stages applies"),
    ({"mixture": MIX, "task": "bert"}, r"data.mixture applies to the gpt task"),
    ({"mixture": MIX, "inputs": ["x.txt"]}, r"data.inputs with data.mixture"),
  ],
)
def test_the_config_refuses_a_bad_mixture_by_name(data, message):
  with pytest.raises(ValueError, match=message):
    experiment(data)
