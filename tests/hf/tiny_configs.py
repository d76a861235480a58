"""Keyword arguments of tiny transformers configs shared by several test files (plain data: no
torch or transformers import here, so a file that skips without them can still import it)."""

# A ReformerConfig with a local and an LSH layer, small enough to build in milliseconds.
TINY_REFORMER = dict(
  vocab_size=61,
  hidden_size=16,
  num_attention_heads=2,
  attention_head_size=4,
  feed_forward_size=24,
  attn_layers=["local", "lsh"],
  axial_pos_shape=(8, 8),
  axial_pos_embds_dim=(6, 10),
  max_position_embeddings=64,
  is_decoder=True,
  num_buckets=4,
  num_hashes=2,
  lsh_attn_chunk_length=8,
  local_attn_chunk_length=4,
  hash_seed=5,
)
