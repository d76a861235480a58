"""Multi-host start-up: when and how to call ``jax.distributed.initialize``.

One process runs per host (per node); each sees its local devices, and together they form one
global device list on which meshes are built. Three ways to start, in order of precedence:

1. Explicit arguments (``tjax train --coordinator-address HOST:PORT --num-processes N
   --process-id I``).
2. The environment: ``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID``. Each
   fills only what the arguments left unset, so all three must end up known (or none of them).
3. Automatic (``tjax train --distributed``): ``jax.distributed.initialize()`` with no arguments,
   which asks the cluster. It detects Cloud TPU pods (the TPU metadata server), SLURM
   (``SLURM_NTASKS``, ``SLURM_PROCID``, the first host of ``SLURM_STEP_NODELIST``) and Open MPI.
   Under SLURM, JAX then gives each process a single GPU (``SLURM_LOCALID``): that fits
   ``srun --ntasks-per-node=GPUS``; with one process per node, pass the explicit arguments instead
   (see ``experiments/launch/``).

With none of these, nothing happens and the run is a single process. When the coordinator, the
count and the id are all given, JAX's cluster detection is switched off, so every local device
stays visible unless ``local_device_ids`` (or ``JAX_LOCAL_DEVICE_IDS``) restricts them.

CPU processes talk through gloo collectives (``jax_cpu_collectives_implementation``, JAX's
default).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import jax

ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"


def is_initialized() -> bool:
  """Whether ``jax.distributed.initialize`` has run in this process."""
  return jax.distributed.is_initialized()


def requested(
  coordinator_address: str | None = None,
  num_processes: int | None = None,
  process_id: int | None = None,
  *,
  auto: bool = False,
) -> bool:
  """Whether these arguments or the environment ask for a multi-process start."""
  given = (coordinator_address, num_processes, process_id)
  env = (ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID)
  return auto or any(v is not None for v in given) or any(os.environ.get(k) for k in env)


def _env_int(name: str) -> int | None:
  raw = os.environ.get(name)
  if not raw:
    return None
  try:
    return int(raw)
  except ValueError:
    raise ValueError(f"{name}={raw!r} is not an integer") from None


def _check_address(address: str, source: str) -> None:
  host, sep, port = address.rpartition(":")
  if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
    raise ValueError(
      f"{source}={address!r}: the coordinator address must be HOST:PORT "
      "(process 0's host name or IP and a free port, e.g. 10.0.0.2:8476)"
    )


def initialize(
  coordinator_address: str | None = None,
  num_processes: int | None = None,
  process_id: int | None = None,
  local_device_ids: Sequence[int] | None = None,
  *,
  auto: bool = False,
) -> bool:
  """Joins this process to a multi-process JAX job when asked to; a no-op otherwise.

  Call it before any JAX computation (and before anything asks JAX for its devices). A second call
  does nothing and returns True.

  Args:
    coordinator_address: ``HOST:PORT`` of process 0, where it serves the coordination service
      (default: ``$JAX_COORDINATOR_ADDRESS``).
    num_processes: The number of processes, one per host (default: ``$JAX_NUM_PROCESSES``).
    process_id: This process's index in ``[0, num_processes)`` (default: ``$JAX_PROCESS_ID``).
    local_device_ids: The local devices this process may use (default: all, or
      ``$JAX_LOCAL_DEVICE_IDS``, or one GPU per process under SLURM auto-detection).
    auto: With nothing above known, call ``jax.distributed.initialize()`` without arguments and let
      JAX detect the cluster (TPU pods, SLURM, Open MPI).

  Returns:
    Whether the process is now part of a distributed job.

  Raises:
    ValueError: Only some of the coordinator address, process count and process id are known, a
      value is malformed or out of range, or ``auto`` found no cluster to detect.
    RuntimeError: JAX had already started its backend (some computation ran first).
  """
  if is_initialized():
    return True
  explicit = {
    "coordinator_address": coordinator_address,
    "num_processes": num_processes,
    "process_id": process_id,
  }
  if coordinator_address is None:
    coordinator_address = os.environ.get(ENV_COORDINATOR) or None
  if num_processes is None:
    num_processes = _env_int(ENV_NUM_PROCESSES)
  if process_id is None:
    process_id = _env_int(ENV_PROCESS_ID)
  values = {
    "coordinator_address": coordinator_address,
    "num_processes": num_processes,
    "process_id": process_id,
  }
  sources = {
    "coordinator_address": ("--coordinator-address", ENV_COORDINATOR),
    "num_processes": ("--num-processes", ENV_NUM_PROCESSES),
    "process_id": ("--process-id", ENV_PROCESS_ID),
  }

  def source(name):
    flag, env = sources[name]
    return flag if explicit[name] is not None else env

  known = [k for k, v in values.items() if v is not None]
  if not known and not auto:
    return False
  ids = None if local_device_ids is None else [int(i) for i in local_device_ids]
  if known:
    if len(known) < 3:
      missing = [k for k in values if values[k] is None]
      raise ValueError(
        "a multi-process start needs the coordinator address, the process count and the process "
        f"id together; got {', '.join(f'{source(k)}={values[k]}' for k in known)} but not "
        + ", ".join(" / ".join(sources[k]) for k in missing)
      )
    _check_address(coordinator_address, source("coordinator_address"))
    if num_processes < 1:
      raise ValueError(f"{source('num_processes')}={num_processes} must be at least 1")
    if not 0 <= process_id < num_processes:
      raise ValueError(
        f"{source('process_id')}={process_id} is out of range: process ids run from "
        f"0 to {num_processes - 1} ({source('num_processes')}={num_processes})"
      )
    kwargs = dict(
      coordinator_address=coordinator_address,
      num_processes=num_processes,
      process_id=process_id,
      local_device_ids=ids,
      cluster_detection_method="deactivate",
    )
  else:
    kwargs = dict(local_device_ids=ids)
  try:
    jax.distributed.initialize(**kwargs)
  except RuntimeError as e:
    if "before" in str(e) or "backend" in str(e).lower():
      raise RuntimeError(
        "jax.distributed.initialize must run before any JAX computation; call "
        "transformer_jax.parallel.distributed.initialize first thing"
      ) from e
    raise
  except ValueError as e:
    if known:
      raise
    raise ValueError(
      f"--distributed found no cluster to join ({e}): on TPU pods, SLURM and Open MPI JAX "
      "detects it; elsewhere give --coordinator-address, --num-processes and --process-id (or "
      f"{ENV_COORDINATOR}, {ENV_NUM_PROCESSES}, {ENV_PROCESS_ID})"
    ) from e
  return True


def describe() -> str:
  """``process i/n``, this process's devices and the global device count, on one line."""
  local = jax.local_devices()
  kinds = sorted({d.device_kind for d in local})
  return (
    f"process {jax.process_index()}/{jax.process_count()}: {len(local)} local devices "
    f"({', '.join(kinds)}), {jax.device_count()} global devices"
  )


def log_topology() -> None:
  """Prints :func:`describe` from process 0 only."""
  if jax.process_index() == 0:
    print(describe(), flush=True)
