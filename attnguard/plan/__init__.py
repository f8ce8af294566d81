"""The load-time planner: (request, facts, settings) -> Plan. Pure: no torch, no I/O, no events.

This package answers "what happens to a model that asks for flash attention here": which backend it
loads with, in which dtype, on which device. The decision table (:data:`TABLE`) is data:
``attnguard doctor`` prints it and the tests walk every row. :func:`plan_load` is the one
implementation of it; the transformers patches, ``guard_model`` and ``attnguard doctor`` call it.

Three principles shape the rows:

* **An explicit choice stands.** A dtype the caller passed, a placement they chose (``device_map``,
  ``tp_plan``, a ``with torch.device(...)`` block), a deliberate setup (DeepSpeed ZeRO-3, FSDP, meta
  init, quantization) is never overridden at load time. Where a flash kernel will then meet
  float32, the call-time guard carries each call (q/k/v cast for the kernel, output cast back) and
  one ``observed`` event says so. Only what nobody chose (4.x's default float32, 5.x's ``"auto"``
  resolving to a float32 checkpoint) may be cast or placed.
* **Ranks never diverge.** With several processes (``WORLD_SIZE > 1``) the dtype is never changed at
  load: one rank cannot see whether the others build on the meta device, and a cast on some ranks
  only hangs a sharded wrapper's first broadcast. Placement on ``cuda:LOCAL_RANK`` stays (every
  replicating wrapper needs it there; a sharding one moves each rank's part itself).
* **The run they would have had.** When flash attention was asked for but its kernel cannot run
  here, the model still gets what it would have had if flash had worked (the half dtype and the
  rank's GPU, when there is one), and transformers' flash code path is kept where attnguard's SDPA
  twins of the flash-attn kernels can run under it, so padded and packed batches, sliding windows,
  softcapping and the bottom-right causal alignment are computed exactly as flash would.

The plan is what fix mode would do. The caller decides, from the mode, whether to apply it (fix),
only report it (warn) or refuse to go on (strict). Remedies disabled with ATTNGUARD_DISABLE turn
into ``observed`` actions that say what was left alone and why.
"""

from .backend import plan_backend
from .load import flash_fp32_request, plan_load
from .request import Action, LoadRequest, Plan, dtype_name, half_dtype, is_flash
from .table import CAST, DEVICE_MAP, FALLBACK, PLACE, RULES, SDPA_TWINS, TABLE, Rule

__all__ = [
    "CAST",
    "DEVICE_MAP",
    "FALLBACK",
    "PLACE",
    "RULES",
    "SDPA_TWINS",
    "TABLE",
    "Action",
    "LoadRequest",
    "Plan",
    "Rule",
    "dtype_name",
    "flash_fp32_request",
    "half_dtype",
    "is_flash",
    "plan_backend",
    "plan_load",
]
