"""Family C: one replica per rank under multi-process launchers (the plan).

* :func:`plan_device_map` (pure): under torchrun / accelerate / DeepSpeed (world size > 1) a
  ``device_map`` that spreads over every visible GPU ("auto", "balanced", "balanced_low_0",
  "sequential") makes every rank spread its own copy of the model over every GPU: slow at best
  (≈1.9× per rank measured on two H200s, 7B-shaped Qwen2), "Expected all tensors to be on the same device" at worst.
  The planner says what this rank should load with instead. The loading wrapper
  (``integrations/transformers/loading.py``) calls it and emits ``device_map_rewritten``.

Aligning the rotary inputs of a model spread over devices is transformers-specific:
:mod:`attnguard.integrations.transformers.rotary`.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..observability import events

# device_map strings that make accelerate spread the model over every visible GPU.
SPREADING_DEVICE_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")


def spreads_over_ranks(device_map: Any, world_size: int) -> bool:
    """True for a device_map that spreads over every visible GPU, in a job of several ranks."""
    return (
        world_size > 1
        and isinstance(device_map, str)
        and device_map.strip().lower() in SPREADING_DEVICE_MAPS
    )


# Share of a GPU's memory the weights may take; the rest is for activations and the KV cache.
# 0.9 is accelerate's own compromise for a single device.
USABLE_FRACTION = 0.9

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


@dataclass(frozen=True)
class DeviceMapDecision:
    """What this rank should pass to ``from_pretrained`` instead of what it asked for.

    ``device_map`` / ``max_memory`` are the new load kwargs (``max_memory`` None = leave the
    kwarg as the user gave it, i.e. absent or unchanged). ``before`` / ``after`` are JSON-friendly
    dicts for the ``device_map_rewritten`` event.
    """

    device_map: Any
    max_memory: dict[int | str, int | str] | None
    reason_code: str
    reason: str
    before: dict[str, Any] = field(default_factory=dict)
    after: dict[str, Any] = field(default_factory=dict)


def parse_bytes(value: int | float | str | None) -> int | None:
    """``"10GiB"`` / ``"500MB"`` / 123 -> bytes (accelerate's spelling); None when unreadable."""
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return int(value)
    m = re.fullmatch(r"\s*([0-9.]+)\s*([A-Za-z]*)\s*", str(value))
    if not m:
        return None
    unit = m.group(2).upper()
    if unit.endswith("BIT"):  # accelerate accepts "Gbit" too
        mult = _UNITS.get(unit[:-3] + "B")
        return None if mult is None else int(float(m.group(1)) * mult / 8)
    mult = _UNITS.get(unit)
    return None if mult is None else int(float(m.group(1)) * mult)


def _gpu_budget(
    index: int, max_memory: Mapping[Any, Any] | None, gpu_bytes: int | None
) -> int | None:
    """Bytes the weights may use on GPU ``index``: the smaller of the user's cap and a share of
    the GPU; None when neither is known."""
    cap = None
    if max_memory:
        for key in (index, str(index), f"cuda:{index}"):
            if key in max_memory:
                cap = parse_bytes(max_memory[key])
                break
    share = int(gpu_bytes * USABLE_FRACTION) if gpu_bytes else None
    candidates = [b for b in (cap, share) if b is not None]
    return min(candidates) if candidates else None


def plan_device_map(
    device_map: Any,
    *,
    world_size: int,
    local_rank: int,
    n_gpus: int,
    max_memory: Mapping[Any, Any] | None = None,
    model_bytes: int | None = None,
    gpu_bytes: int | None = None,
    local_world_size: int | None = None,
    cpu_bytes: int | None = None,
) -> DeviceMapDecision | None:
    """Decide this rank's ``device_map`` when a multi-process launch asks to spread the model.

    Pure: every fact is an argument (see :func:`plan_from_environment` for reading them).

    Args:
        device_map: what the user passed to ``from_pretrained``.
        world_size / local_rank: from the launcher (``WORLD_SIZE`` / ``LOCAL_RANK``).
        n_gpus: CUDA devices this process sees (``torch.cuda.device_count()``, which already
            honours a per-rank ``CUDA_VISIBLE_DEVICES``).
        max_memory: the user's ``max_memory`` kwarg, if any (its per-GPU caps count as budget).
        model_bytes: the weights' size at the load dtype (:func:`estimate_model_bytes`);
            None means "unknown: assume it fits one GPU", the common case for the models people
            run one-per-rank, and the case the measured 1.9× is about.
        gpu_bytes: total memory of one GPU (all assumed equal); None = unknown = assume it fits.
        local_world_size: ranks on this node (``LOCAL_WORLD_SIZE``); None = ``world_size``
            (one node). Multi-node jobs must pass it for the slice arithmetic to be right.
        cpu_bytes: host memory to allow for offload when a slice is planned and the user's
            ``max_memory`` has no ``"cpu"`` entry (else accelerate would offload to disk).

    Returns None (leave the load alone) when:
        * ``world_size <= 1``: one process splitting a model over GPUs does it on purpose;
        * ``device_map`` is not one of :data:`SPREADING_DEVICE_MAPS` (None, "cuda", "cpu", an
          int, a torch.device, an explicit dict: the user placed the model themselves);
        * no GPU is visible;
        * the model does not fit where a per-rank placement would put it and no disjoint slice
          of >= 2 GPUs per rank exists (every rank keeps spreading: the only way it loads).

    Otherwise, with ``ranks = local_world_size or world_size``:
        * the model fits one GPU (or size unknown):
            - ``n_gpus == 1`` (typically ``CUDA_VISIBLE_DEVICES`` per rank) -> ``{"": "cuda:0"}``;
            - ``n_gpus >= ranks`` -> ``{"": f"cuda:{local_rank}"}``;
            - ``1 < n_gpus < ranks`` (more ranks than GPUs) -> ``{"": f"cuda:{local_rank % n_gpus}"}``
              when ``ceil(ranks / n_gpus)`` replicas fit one GPU;
        * it does not fit one GPU and ``k = n_gpus // ranks >= 2``: the user's string map is kept
          and ``max_memory`` limits this rank to GPUs ``[local_rank*k, (local_rank+1)*k)``, every
          other GPU 0 (accelerate then never places a weight there).
    """
    if not spreads_over_ranks(device_map, world_size) or n_gpus <= 0:
        return None
    ranks = max(local_world_size or world_size, 1)
    before = {
        "device_map": device_map,
        "max_memory": dict(max_memory) if max_memory else None,
        "world_size": world_size,
        "local_rank": local_rank,
        "n_gpus": n_gpus,
    }

    def fits(index: int, replicas: int) -> bool:
        budget = _gpu_budget(index, max_memory, gpu_bytes)
        if model_bytes is None or budget is None:
            return True  # unknown size or memory: assume it fits (documented above)
        return replicas * model_bytes <= budget

    def one_gpu(index: int, reason_code: str, reason: str) -> DeviceMapDecision:
        new_map = {"": f"cuda:{index}"}
        return DeviceMapDecision(
            device_map=new_map,
            # transformers ignores max_memory for an explicit dict map: keep what the user gave
            max_memory=dict(max_memory) if max_memory else None,
            reason_code=reason_code,
            reason=reason,
            before=before,
            after={"device_map": new_map, "max_memory": before["max_memory"]},
        )

    if n_gpus == 1:
        if not fits(0, 1):
            return None  # "auto" may offload the rest to CPU; a full placement would OOM
        return one_gpu(
            0,
            "device_map_per_rank",
            f'device_map="{device_map}" under {world_size} processes with one visible GPU: '
            "this rank loads its replica on cuda:0",
        )
    if n_gpus >= ranks:
        if fits(local_rank % n_gpus, 1):
            index = local_rank % n_gpus
            return one_gpu(
                index,
                "device_map_per_rank",
                f'device_map="{device_map}" under {world_size} processes makes every rank spread '
                f"its copy of the model over all {n_gpus} GPUs; this rank loads it on cuda:{index}",
            )
        k = n_gpus // ranks
        if k < 2 or local_rank >= ranks:
            return None
        first = local_rank * k
        slice_ids = list(range(first, first + k))
        # fits() was False, so this rank's own GPU has a known budget
        own = _gpu_budget(local_rank % n_gpus, max_memory, gpu_bytes) or 0
        new_max: dict[int | str, int | str] = {}
        for i in range(n_gpus):
            if i in slice_ids:
                budget = _gpu_budget(i, max_memory, gpu_bytes)
                new_max[i] = own if budget is None else budget
            else:
                new_max[i] = 0
        user_cpu = None
        if max_memory:
            user_cpu = max_memory.get("cpu")
            for key, value in max_memory.items():
                name = str(key)
                if name != "cpu" and not name.isdigit() and not name.startswith("cuda"):
                    new_max[key] = value  # "disk", "mps", ... stay as given
        if user_cpu is not None:
            new_max["cpu"] = user_cpu
        elif cpu_bytes:
            new_max["cpu"] = int(cpu_bytes)
        return DeviceMapDecision(
            device_map=device_map,
            max_memory=new_max,
            reason_code="device_map_gpu_slice",
            reason=(
                f"the model ({_gib(model_bytes)}) does not fit one GPU; under {world_size} "
                f"processes each rank gets its own {k} GPUs: this rank uses "
                f"cuda:{slice_ids[0]}..cuda:{slice_ids[-1]}"
            ),
            before=before,
            after={"device_map": device_map, "max_memory": new_max},
        )
    # 1 < n_gpus < ranks: ranks share GPUs round-robin, each with a whole replica
    index = local_rank % n_gpus
    if not fits(index, math.ceil(ranks / n_gpus)):
        return None
    return one_gpu(
        index,
        "device_map_shared_gpus",
        f'device_map="{device_map}" under {ranks} processes on {n_gpus} GPUs: ranks share GPUs '
        f"round-robin, each with a whole replica; this rank loads it on cuda:{index}",
    )


def _gib(n: int | None) -> str:
    return "unknown size" if n is None else f"{n / 2**30:.1f} GiB"


# --- facts for the planner -----------------------------------------------------------------------


def _dtype_bytes(dtype: Any) -> int | None:
    if dtype is None:
        return None
    itemsize = getattr(dtype, "itemsize", None)
    if isinstance(itemsize, int):
        return itemsize
    name = str(dtype).replace("torch.", "").lower()
    table = {
        "float32": 4,
        "float": 4,
        "fp32": 4,
        "float16": 2,
        "half": 2,
        "fp16": 2,
        "bfloat16": 2,
        "bf16": 2,
        "float64": 8,
        "int8": 1,
        "uint8": 1,
        "float8_e4m3fn": 1,
        "float8_e5m2": 1,
    }
    return table.get(name)


def _get(cfg: Any, *names: str) -> Any:
    for n in names:
        v = getattr(cfg, n, None)
        if v is not None:
            return v
    return None


def _decoder_params(cfg: Any) -> int | None:
    """Parameters of a decoder-only transformer from its config (embeddings, attention, MLP)."""
    h = _get(cfg, "hidden_size", "d_model", "n_embd")
    layers = _get(cfg, "num_hidden_layers", "n_layer", "num_layers")
    vocab = _get(cfg, "vocab_size")
    if not (isinstance(h, int) and isinstance(layers, int) and isinstance(vocab, int)):
        return None
    heads = _get(cfg, "num_attention_heads", "n_head") or 1
    kv_heads = _get(cfg, "num_key_value_heads") or heads
    head_dim = _get(cfg, "head_dim") or h // heads
    inter = _get(cfg, "intermediate_size", "n_inner") or 4 * h
    experts = _get(cfg, "num_local_experts", "num_experts", "n_routed_experts") or 1
    if isinstance(_get(cfg, "moe_intermediate_size"), int):
        inter = cfg.moe_intermediate_size
    attn = h * heads * head_dim * 2 + h * kv_heads * head_dim * 2
    mlp = 3 * h * inter * experts  # gate, up, down (SwiGLU); a 2-matrix MLP is over-counted
    embed = vocab * h * (1 if getattr(cfg, "tie_word_embeddings", True) else 2)
    return int(embed + layers * (attn + mlp + 2 * h) + h)


def _vision_params(cfg: Any) -> int:
    dim = _get(cfg, "embed_dim", "hidden_size")
    depth = _get(cfg, "depth", "num_hidden_layers")
    if not (isinstance(dim, int) and isinstance(depth, int)):
        return 0
    inter = _get(cfg, "intermediate_size") or 4 * dim
    return int(depth * (4 * dim * dim + 3 * dim * inter))


def estimate_model_bytes(config: Any, dtype: Any = None) -> int | None:
    """Rough size of the weights from a config alone (no model is built, nothing is loaded).

    Counts embeddings + per-layer attention and MLP of the text decoder (``config.text_config``
    when present) plus a vision tower (``config.vision_config``); accurate to ~10% for
    Llama/Qwen-style models, an over-estimate for 2-matrix MLPs. ``dtype`` is the load dtype
    (torch.dtype or its name); None -> the config's dtype, else 4 bytes (4.x loads fp32).
    Returns None when the config is not a shape we know (callers then assume the model fits).
    """
    try:
        text = getattr(config, "text_config", None) or config
        n = _decoder_params(text)
        if n is None and text is not config:
            n = _decoder_params(config)
        if n is None:
            return None
        vision = getattr(config, "vision_config", None)
        if vision is not None:
            n += _vision_params(vision)
        per = _dtype_bytes(dtype)
        if per is None:
            per = _dtype_bytes(_get(text, "dtype", "torch_dtype")) or _dtype_bytes(
                _get(config, "dtype", "torch_dtype")
            )
        return n * (per or 4)
    except Exception:
        return None


def local_world_size_from_env(environ: Mapping[str, str] | None = None) -> int | None:
    """Ranks on this node: torchrun / accelerate set LOCAL_WORLD_SIZE, MPI-style launchers
    OMPI_COMM_WORLD_LOCAL_SIZE; None when none is set."""
    env = os.environ if environ is None else environ
    for name in ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS"):
        try:
            return int(env[name])
        except (KeyError, ValueError):
            continue
    return None


def plan_from_environment(
    device_map: Any,
    *,
    max_memory: Mapping[Any, Any] | None = None,
    model_bytes: int | None = None,
) -> DeviceMapDecision | None:
    """:func:`plan_device_map` with the facts of this process (launcher env, visible GPUs).

    Cheap: returns None before touching CUDA when the map is not a spreading string or the world
    size is 1. GPU memory is read with ``torch.cuda.get_device_properties(0).total_memory``.
    """
    if not isinstance(device_map, str) or device_map.strip().lower() not in SPREADING_DEVICE_MAPS:
        return None
    ctx = events.launch_context()
    if ctx["world_size"] <= 1:
        return None
    import torch

    n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    gpu_bytes = None
    if n_gpus and model_bytes is not None:
        gpu_bytes = int(torch.cuda.get_device_properties(0).total_memory)
    cpu_bytes = None
    try:
        cpu_bytes = int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        pass
    return plan_device_map(
        device_map,
        world_size=ctx["world_size"],
        local_rank=ctx["local_rank"],
        n_gpus=n_gpus,
        max_memory=max_memory,
        model_bytes=model_bytes,
        gpu_bytes=gpu_bytes,
        local_world_size=local_world_size_from_env(),
        cpu_bytes=cpu_bytes,
    )
