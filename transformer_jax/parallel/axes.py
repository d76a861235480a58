"""Logical axis names carried by every parameter and key activation.

``parallel`` maps these names to mesh axes (``data``, ``fsdp``, ``tensor``, ``sequence``) with a rules
table, so a change of parallelism never touches model code.
"""

BATCH = "batch"
LENGTH = "length"
EMBED = "embed"          # model width D
VOCAB = "vocab"          # vocabulary V
HEADS = "heads"          # query heads N
KV_HEADS = "kv_heads"    # key/value heads K
HEAD_DIM = "head_dim"    # H
MLP = "mlp"              # feed-forward width F
LAYERS = "layers"        # the stacked-layer axis L
POSITIONS = "positions"  # learned position table rows
TYPES = "types"          # token-type table rows
BUCKETS = "buckets"      # relative-position buckets
CLASSES = "classes"      # classifier outputs
LORA_RANK = "lora_rank"  # the rank r of a LoRA adapter
