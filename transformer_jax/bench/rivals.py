"""The PyTorch sides the benchmarks time ours against, on the same weights (written by
``transformer_jax.hf.save``): ``Torch``, the ``transformers`` causal LM's training step for
``tjax bench train`` (eager, or its forward+loss ``torch.compile``-d), and ``Theirs``, Hugging Face
``generate`` for ``tjax bench generate``; ``hf_device`` says where the latter runs.

torch and transformers are optional (the hf extra): they are imported where they are used.
"""

from __future__ import annotations

import tempfile
import time
import warnings

import numpy as np
from flax import nnx

from transformer_jax import hf as tjhf
from transformer_jax import models
from transformer_jax.bench import machine
from transformer_jax.hf.configs import default_architecture


class Torch:
  """The preset's ``transformers`` causal LM (``hf.save``'s architecture: ``GPT2LMHeadModel``,
  ``LlamaForCausalLM``, ``MistralForCausalLM``) on the same weights: forward, token-mean
  cross-entropy, backward, clipping, AdamW, in eager mode (or with the forward+loss
  ``torch.compile``-d).

  On ``device`` "cpu" everything is float32. On "cuda" the model and batch live on the GPU, the
  forward+loss runs under ``torch.autocast`` to ``autocast`` when given ("bfloat16"; the weights
  and optimizer stay float32), AdamW is the fused kernel, and a step synchronizes the device
  before it reads the clock at either end.
  """

  def __init__(
    self,
    config,
    params,
    host_batch,
    lr: float,
    weight_decay: float,
    clip: float,
    b1: float,
    b2: float,
    eps: float,
    compiled: bool = False,
    device: str = "cpu",
    autocast: str | None = None,
  ):

    import torch  # noqa: PLC0415 - torch is optional (the hf extra)
    import transformers  # noqa: PLC0415 - transformers is optional (the hf extra)

    if device not in ("cpu", "cuda"):
      raise ValueError(f"device={device!r}: the PyTorch rival runs on 'cpu' or 'cuda'")
    if autocast is not None and device != "cuda":
      raise ValueError(f"autocast={autocast!r} on device={device!r}: autocast is for 'cuda'")
    self.torch = torch
    transformers.logging.set_verbosity_error()
    model = nnx.merge(models.graphdef(config), params)
    self.architecture = default_architecture(config)
    with tempfile.TemporaryDirectory() as tmp:
      tjhf.save(model, config, tmp)
      # PyTorch's fused attention; Mamba's mixers have no attention to choose.
      extra = (
        {}
        if self.architecture in ("MambaForCausalLM", "Mamba2ForCausalLM")
        else {"attn_implementation": "sdpa"}
      )
      with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        self.model = getattr(transformers, self.architecture).from_pretrained(tmp, **extra).train()
    self.device, self.autocast = device, autocast
    self.fused_adamw = device == "cuda"
    self._sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    self.model.to(device)
    # No decay on biases and norm scales, as on our side.
    decay = [p for n, p in self.model.named_parameters() if p.dim() >= 2]
    rest = [p for n, p in self.model.named_parameters() if p.dim() < 2]
    self.opt = torch.optim.AdamW(
      [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}],
      lr=lr,
      betas=(b1, b2),
      eps=eps,
      **({"fused": True} if self.fused_adamw else {}),
    )
    self.clip = clip
    self.tokens = torch.as_tensor(host_batch["tokens"], dtype=torch.long).to(device)
    self.labels = torch.as_tensor(host_batch["labels"], dtype=torch.long).to(device)

    def loss_fn(tokens, labels):
      logits = self.model(tokens).logits
      return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())

    if autocast:
      plain, cast_to = loss_fn, getattr(torch, autocast)

      def loss_fn(tokens, labels):
        with torch.autocast("cuda", dtype=cast_to):
          return plain(tokens, labels)

    self.loss_fn = torch.compile(loss_fn) if compiled else loss_fn
    self.losses: list[float] = []

  def compile(self) -> float:
    """One forward + backward without an update (``torch.compile`` compiles here), so the weights
    stay in step with ours; returns its time."""
    self._sync()
    start = time.perf_counter()
    self.loss_fn(self.tokens, self.labels).backward()
    self.opt.zero_grad(set_to_none=True)
    self._sync()
    return time.perf_counter() - start

  def step(self) -> float:
    """One training step; returns its time."""
    self._sync()
    start = time.perf_counter()
    self.opt.zero_grad(set_to_none=True)
    loss = self.loss_fn(self.tokens, self.labels)
    loss.backward()
    self.torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
    self.opt.step()
    self.losses.append(float(loss.detach()))
    self._sync()
    return time.perf_counter() - start


class Theirs:
  """Hugging Face ``GPT2LMHeadModel.generate`` with ``threads`` torch threads on CPU, or on
  ``device`` "cuda" (the model already there; ``threads`` None), synchronizing the GPU at both
  ends of a call."""

  def __init__(self, hf_model, threads: int | None, device: str = "cpu"):
    if device not in ("cpu", "cuda"):
      raise ValueError(f"device={device!r}: Hugging Face runs on 'cpu' or 'cuda' here")
    if (threads is None) != (device == "cuda"):
      raise ValueError(
        f"threads={threads!r} on device={device!r}: a thread count is for 'cpu' "
        "only, and 'cpu' needs one"
      )
    self.model, self.threads, self.device = hf_model, threads, device

  def _sync(self) -> None:
    if self.device == "cuda":
      import torch  # noqa: PLC0415 - torch is optional (the hf extra)

      torch.cuda.synchronize()

  def generate(self, prompt_BP: np.ndarray, new_tokens: int) -> np.ndarray:
    import torch  # noqa: PLC0415 - torch is optional (the hf extra)

    self._sync()
    ids = torch.as_tensor(prompt_BP, dtype=torch.long)
    if self.device != "cpu":
      ids = ids.to(self.device)
    if self.threads is not None:
      torch.set_num_threads(self.threads)
    with torch.inference_mode():
      out = self.model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
      )
    self._sync()
    return out[:, prompt_BP.shape[1] :].cpu().numpy()

  def logits(self, ids_1T: np.ndarray) -> np.ndarray:
    import torch  # noqa: PLC0415 - torch is optional (the hf extra)

    if self.threads is not None:
      torch.set_num_threads(self.threads)
    with torch.inference_mode():
      out = self.model(torch.as_tensor(ids_1T, dtype=torch.long).to(self.device)).logits[0]
    return out.float().cpu().numpy()


def hf_device() -> str:
  """Where Hugging Face runs: "cpu" when JAX does, "cuda" when JAX runs on a GPU and torch has
  CUDA.

  Raises:
    ValueError: on any other platform (a TPU) or a GPU where torch has no CUDA device.
  """
  device, why_not = machine.torch_device()
  if device is None:
    raise ValueError(f"bench generate: Hugging Face cannot run beside JAX here: {why_not}")
  return device
