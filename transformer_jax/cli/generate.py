"""``tjax generate`` and ``tjax fill-mask``: text in, text out, from a run directory.

A run directory (``transformer_jax.runs``) holds ``model.yaml``, ``checkpoints/`` and
``dataset.json``, whose absolute ``path`` names the prepared dataset; its metadata rebuilds the
tokenizer (compact vocabulary included). ``tjax generate`` prints the continuation while it is
produced, as ``generate.stream.stream_generate`` hands it out: the first token comes from the
prefill, then each jitted call runs a chunk of up to ``--chunk`` one-token steps with the
key/value cache carried from call to call (compiled once per chunk size, not per token).
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import TextIO

import jax
import numpy as np

from transformer_jax.backends.cpu import poll
from transformer_jax.generate.beam import beam_search
from transformer_jax.generate.decode import generate, special_ids
from transformer_jax.generate.fill_mask import MASK_TEXT, encode_masked, fill_mask
from transformer_jax.generate.stream import stream_generate
from transformer_jax.models.config import BERTConfig, GPTConfig, MambaConfig, Seq2SeqConfig


def _family(config) -> str:
  return {BERTConfig: "BERT", GPTConfig: "GPT", Seq2SeqConfig: "Seq2Seq", MambaConfig: "Mamba"}[
    type(config)
  ]


class _TextStream:
  """Prints the decoding of a growing id list, holding back a trailing partial UTF-8 character."""

  def __init__(self, tokenizer, out: TextIO):
    self.tokenizer, self.out = tokenizer, out
    self.ids: list[int] = []
    self.printed = 0

  def add(self, ids, final: bool = False) -> None:
    self.ids += [int(i) for i in ids]
    text = self.tokenizer.decode(self.ids)
    end = len(text) if final else len(text.rstrip("\ufffd"))
    if end > self.printed:
      self.out.write(text[self.printed : end])
      self.out.flush()
      self.printed = end


def _until_eos(ids, eos_id: int) -> list[int]:
  ids = [int(i) for i in ids]
  return ids[: ids.index(eos_id)] if eos_id in ids else ids


# -------------------------------------------------------------------------------------------------
# tjax generate


def add_generate_args(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("run_dir")
  parser.add_argument("--prompt", required=True, help="text to continue (Seq2Seq: the source)")
  parser.add_argument("--max-new-tokens", type=int, default=64)
  parser.add_argument(
    "--temperature", type=float, default=None, help="0 = greedy; default 0.8 (GPT) or 0 (Seq2Seq)"
  )
  parser.add_argument("--top-k", type=int, default=None, help="default 40 when sampling")
  parser.add_argument("--top-p", type=float, default=None, help="nucleus mass in (0, 1]")
  parser.add_argument(
    "--num-beams",
    type=int,
    default=1,
    help="> 1: beam search (deterministic; prints the best hypothesis at the end)",
  )
  parser.add_argument("--length-penalty", type=float, default=1.0, help="beam search only")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--chunk", type=int, default=8, help="tokens per printed chunk")
  parser.add_argument("--best", action="store_true", help="the best checkpoint, not the latest")
  parser.add_argument(
    "--data",
    default=None,
    metavar="DIR",
    help="dataset whose tokenizer to use (default: data.path of config.yaml)",
  )
  parser.add_argument(
    "--cpu-poll",
    action=argparse.BooleanOptionalAction,
    default=None,
    help="while decoding on CPU, ask Linux to keep idle CPUs polling instead of "
    "halting (writes /dev/cpu_dma_latency, usually root only; affects the whole "
    f"machine while it runs). Default: ${poll.POLL_ENV}=1, else off",
  )


# The seeds jax.random.key takes.
_SEED_RANGE = (-(2**63), 2**63)


def check_generate_args(args) -> bool:
  """Checks every option of ``tjax generate`` that does not need the run, before anything is
  printed.

  Returns:
    Whether idle CPUs should poll while it decodes (``--cpu-poll`` or ``$TJAX_CPU_POLL``).

  Raises:
    ValueError: naming the first bad option and its value.
  """
  if not args.prompt:
    raise ValueError("the prompt is empty; give some text with --prompt")
  if args.max_new_tokens < 1:
    raise ValueError(f"--max-new-tokens {args.max_new_tokens} must be >= 1")
  if args.temperature is not None and not (
    math.isfinite(args.temperature) and args.temperature >= 0.0
  ):
    raise ValueError(f"--temperature {args.temperature} must be a number >= 0 (0 = greedy)")
  if args.top_k is not None and args.top_k < 1:
    raise ValueError(f"--top-k {args.top_k} must be >= 1")
  if args.top_p is not None and not 0.0 < args.top_p <= 1.0:
    raise ValueError(f"--top-p {args.top_p} must be in (0, 1]")
  if args.num_beams < 1:
    raise ValueError(f"--num-beams {args.num_beams} must be >= 1")
  if not math.isfinite(args.length_penalty):
    raise ValueError(f"--length-penalty {args.length_penalty} must be a finite number")
  if args.chunk < 1:
    raise ValueError(f"--chunk {args.chunk} must be >= 1")
  if not _SEED_RANGE[0] <= args.seed < _SEED_RANGE[1]:
    raise ValueError(f"--seed {args.seed} must be in [-2**63, 2**63)")
  if args.num_beams > 1 and (args.temperature, args.top_k, args.top_p) != (None, None, None):
    raise ValueError(
      "--num-beams > 1 searches deterministically: --temperature, --top-k and "
      "--top-p are for sampling"
    )
  return poll.requested(getattr(args, "cpu_poll", None))


def run_generate(args, out: TextIO | None = None) -> int:
  """``tjax generate RUN_DIR --prompt TEXT``: prints the prompt and its continuation.

  Every option is checked (``check_generate_args``, then against the run's model) before
  anything is printed.
  """
  out = sys.stdout if out is None else out
  wants_poll = check_generate_args(args)

  def check(config, tok):
    if isinstance(config, BERTConfig):
      raise ValueError(
        f"{args.run_dir} is a BERT run (a masked language model): it cannot "
        "generate text; use tjax fill-mask"
      )
    ids = tok.encode(args.prompt)
    seq2seq = isinstance(config, Seq2SeqConfig)
    if len(ids) > config.max_len - (0 if seq2seq else 1):
      raise ValueError(
        f"the prompt is {len(ids)} tokens, too long for the model's context "
        f"max_len={config.max_len}"
      )
    room = config.max_len - (0 if seq2seq else len(ids))
    if args.max_new_tokens < 1 or args.max_new_tokens > room:
      raise ValueError(
        f"--max-new-tokens {args.max_new_tokens} must be in [1, {room}]: the "
        f"{_family(config)} model's context is max_len={config.max_len}"
        + ("" if seq2seq else f" and the prompt takes {len(ids)} of them")
      )

  # Imported once the options passed: the checkpoint library alone takes a second or more.
  from transformer_jax.runs import load_run

  config, params, tok = load_run(args.run_dir, best=args.best, data=args.data, check=check)
  with poll.cpu_poll_if(wants_poll) as request:
    if request.requested and not request.held:
      print(f"tjax generate: --cpu-poll has no effect: {request.reason}", file=sys.stderr)
    return _generate_text(args, config, params, tok, out)


def _generate_text(args, config, params, tok, out: TextIO) -> int:
  """``run_generate``'s decoding, after the run is loaded and the arguments checked."""
  beams = args.num_beams > 1
  ids = tok.encode(args.prompt)
  seq2seq = isinstance(config, Seq2SeqConfig)
  eos = tok.eos_id if seq2seq else tok.eot_id
  suppress = special_ids(tok, keep=[eos])  # [UNK], [PAD]... are not text
  model = (config, params)
  key = jax.random.key(args.seed)
  # Defaults: sampling for a language model, greedy for a Seq2Seq (translation-like) model.
  temperature = (0.0 if seq2seq else 0.8) if args.temperature is None else args.temperature
  top_k = 40 if args.top_k is None and temperature > 0 else args.top_k
  if seq2seq:
    start = tok.bos_id
    if beams:
      new = beam_search(
        model,
        [ids],
        num_beams=args.num_beams,
        max_new_tokens=args.max_new_tokens,
        eos_id=eos,
        decoder_start_id=start,
        length_penalty=args.length_penalty,
        suppress_ids=suppress,
      ).sequences[0]
    else:
      new = generate(
        model,
        [ids],
        max_new_tokens=args.max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=args.top_p,
        eos_id=eos,
        key=key,
        decoder_start_id=start,
        suppress_ids=suppress,
      )[0]
    out.write(tok.decode(_until_eos(np.asarray(new), eos)) + "\n")
    return 0
  out.write(args.prompt)
  out.flush()
  stream = _TextStream(tok, out)
  if beams:
    result = beam_search(
      model,
      [ids],
      num_beams=args.num_beams,
      max_new_tokens=args.max_new_tokens,
      eos_id=eos,
      length_penalty=args.length_penalty,
      suppress_ids=suppress,
    )
    stream.add(_until_eos(np.asarray(result.sequences[0]), eos), final=True)
  else:
    for chunk in stream_generate(
      model,
      [ids],
      max_new_tokens=args.max_new_tokens,
      chunk_size=args.chunk,
      temperature=temperature,
      top_k=top_k,
      top_p=args.top_p,
      eos_id=eos,
      key=key,
      suppress_ids=suppress,
    ):
      new = _until_eos(chunk[0], eos)
      stream.add(new)
      if len(new) < chunk.shape[1]:
        break
    stream.add([], final=True)
  out.write("\n")
  return 0


# -------------------------------------------------------------------------------------------------
# tjax fill-mask


def add_fill_mask_args(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("run_dir")
  parser.add_argument("text", help=f"text with one or more {MASK_TEXT}")
  parser.add_argument("--top-k", type=int, default=5)
  parser.add_argument("--best", action="store_true", help="the best checkpoint, not the latest")
  parser.add_argument(
    "--data",
    default=None,
    metavar="DIR",
    help="dataset whose tokenizer to use (default: data.path of config.yaml)",
  )


def run_fill_mask(args, out: TextIO | None = None) -> int:
  """``tjax fill-mask RUN_DIR TEXT``: prints the top-k candidates of each ``[MASK]``."""
  out = sys.stdout if out is None else out
  if MASK_TEXT not in args.text:
    raise ValueError(f"the text has no {MASK_TEXT} to fill: {args.text!r}")
  if args.top_k < 1:
    raise ValueError(f"--top-k {args.top_k} must be >= 1")

  def check(config, tok):
    if not isinstance(config, BERTConfig):
      raise ValueError(
        f"{args.run_dir} is a {_family(config)} run: fill-mask needs a BERT "
        "(masked language model) run"
      )
    n = len(encode_masked(tok, args.text))
    if n > config.max_len:
      raise ValueError(
        f"the text is {n} tokens with [CLS] and [SEP], longer than the model's "
        f"context max_len={config.max_len}"
      )

  from transformer_jax.runs import load_run  # once the options passed (see run_generate)

  config, params, tok = load_run(args.run_dir, best=args.best, data=args.data, check=check)
  ids = encode_masked(tok, args.text)
  result = fill_mask(
    (config, params),
    np.asarray([ids]),
    top_k=min(args.top_k, config.vocab_size),
    mask_id=tok.mask_id,
  )
  pieces = args.text.split(MASK_TEXT)
  best = pieces[0]
  for m in range(len(result.positions)):
    out.write(f"{MASK_TEXT} {m + 1} of {len(result.positions)}:\n")
    for cand, prob in zip(result.token_ids[m], result.probs[m]):
      out.write(f"  {prob:7.2%}  {tok.decode([cand])!r}\n")
    word = tok.decode([result.token_ids[m, 0]])
    if best.endswith(" ") and word[:1].isspace():  # the space went to the mask (encode_masked)
      best = best[:-1]
    best += word + pieces[m + 1]
  out.write("best: " + best + "\n")
  return 0


def add_commands(sub, common) -> None:
  """Adds ``generate`` and ``fill-mask`` to the ``tjax`` subcommands ``sub`` (see
  ``build_parser``)."""
  gen = sub.add_parser("generate", help="continue a prompt with a run's model (sampling or beams)")
  add_generate_args(gen)
  gen.set_defaults(func=run_generate)
  fill = sub.add_parser("fill-mask", help="a BERT run's top candidates for each [MASK] in a text")
  add_fill_mask_args(fill)
  fill.set_defaults(func=run_fill_mask)
