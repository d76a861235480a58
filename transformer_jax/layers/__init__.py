"""Flax NNX layers built on ``transformer_jax.ops``: every parameter names its logical axes."""

from transformer_jax.layers.attention import Attention, LinearKind
from transformer_jax.layers.block import Block, BlockConfig
from transformer_jax.layers.cache import KVCache, LinearCache
from transformer_jax.layers.dense import Embed, Norm, Projection, RelativePositionBias
from transformer_jax.layers.mlp import MLP
from transformer_jax.layers.mamba import MambaKind, MambaMixer
from transformer_jax.layers.ssm import MixerBlock, MixerBlockConfig, MixerStack, SSMCache
from transformer_jax.layers.stack import Remat, Stack

__all__ = [
  "Attention",
  "Block",
  "BlockConfig",
  "Embed",
  "KVCache",
  "LinearCache",
  "LinearKind",
  "MLP",
  "MambaKind",
  "MambaMixer",
  "MixerBlock",
  "MixerBlockConfig",
  "MixerStack",
  "SSMCache",
  "Norm",
  "Projection",
  "RelativePositionBias",
  "Remat",
  "Stack",
]
