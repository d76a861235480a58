"""Logical axis names carried by every parameter and key activation.

``parallel`` maps these names to mesh axes (``data``, ``fsdp``, ``tensor``, ``sequence``) with a
rules table, so a change of parallelism never touches model code.
"""

BATCH = "batch"
LENGTH = "length"
EMBED = "embed"  # model width D
VOCAB = "vocab"  # vocabulary V
HEADS = "heads"  # query heads N
KV_HEADS = "kv_heads"  # key/value heads K
HEAD_DIM = "head_dim"  # H
MLP = "mlp"  # feed-forward width F
LAYERS = "layers"  # the stacked-layer axis L
POSITIONS = "positions"  # learned position table rows
TYPES = "types"  # token-type table rows
BUCKETS = "buckets"  # relative-position buckets
CLASSES = "classes"  # classifier outputs
LORA_RANK = "lora_rank"  # the rank r of a LoRA adapter
EXPERT = "expert"  # the experts E of a mixture-of-experts layer (their stacked weights)
# State-space mixers (Mamba-1, Mamba-2).
SSM_INNER = "ssm_inner"  # the expanded width E (d_inner): channels, Mamba-2's gated norm
SSM_STATE = "ssm_state"  # the state size S
SSM_HEADS = "ssm_heads"  # Mamba-2's heads (one decay, dt and skip weight each)
SSM_PROJ = "ssm_proj"  # outputs of a fused projection (Mamba-2's in_proj, x_proj, conv channels)
SSM_RANK = "ssm_rank"  # Mamba-1's low-rank time-step projection
CONV = "conv"  # convolution taps W
