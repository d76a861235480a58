"""Fast generation: a preallocated key/value cache and decode loops compiled once
(``lax.while_loop``).

``generate(model, prompt_ids, max_new_tokens=...)`` samples or decodes greedily (GPT, Seq2Seq),
never producing ``suppress_ids`` (``special_ids(tokenizer, keep=[eos])``: text without ``[UNK]``);
``beam_search`` keeps the best ``num_beams`` hypotheses; ``fill_mask`` ranks a BERT's candidates at
each ``[MASK]``. ``KVCache``/``init_cache``/``extend`` are the pieces (prefill a prompt in one call,
then one-token steps). ``generate.stream.stream_generate`` hands out ``generate``'s tokens a chunk
at a time, as they are produced.
"""

from transformer_jax.generate.beam import BeamSearchOutput, beam_search
from transformer_jax.generate.cache import KVCache, extend, init_cache, with_encoder
from transformer_jax.generate.decode import generate, prompt_bucket, special_ids, suppress_mask
from transformer_jax.generate.fill_mask import FillMaskOutput, fill_mask
from transformer_jax.generate.sampling import apply_repetition_penalty, next_token, truncate_logits

__all__ = [
  "BeamSearchOutput",
  "FillMaskOutput",
  "KVCache",
  "apply_repetition_penalty",
  "beam_search",
  "extend",
  "fill_mask",
  "generate",
  "init_cache",
  "next_token",
  "prompt_bucket",
  "special_ids",
  "suppress_mask",
  "truncate_logits",
  "with_encoder",
]
