"""Fast generation: a preallocated key/value cache and a decode loop compiled once (``lax.while_loop``).

``generate(model, prompt_ids, max_new_tokens=...)`` for GPT; ``KVCache``/``init_cache``/``extend`` are
the pieces (prefill a prompt in one call, then one-token steps).
"""

from transformer_jax.generate.cache import KVCache, extend, init_cache, with_encoder
from transformer_jax.generate.decode import generate, prompt_bucket
from transformer_jax.generate.sampling import apply_repetition_penalty, next_token, truncate_logits

__all__ = ["KVCache", "apply_repetition_penalty", "extend", "generate", "init_cache", "next_token", "prompt_bucket",
           "truncate_logits", "with_encoder"]
