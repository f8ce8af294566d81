"""What the planner decides on and what it decides: :class:`LoadRequest` in, :class:`Plan` (its
:class:`Action` rows) out, and the dtype names both speak.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .. import kernel_identity
from ..config import Settings
from ..facts import FLASH_BACKENDS, Facts, canonical_backend


@dataclass(frozen=True)
class LoadRequest:
    """What the caller asked for, normalised (dtypes by name: "float32", "bfloat16", ...)."""

    model: str = ""
    site: str = "transformers.load"
    # a backend name, None (transformers' default), or {sub-config key or "": backend}
    attn_implementation: str | Mapping[str, str | None] | None = None
    dtype: str | None = None  # as given; None = not given; "auto" = the checkpoint's
    default_dtype: str = "float32"  # what "not given" means on this path / version
    checkpoint_dtype: str | None = None  # what "auto" resolves to; None = unknown
    # the caller chose the dtype (a concrete dtype passed; "auto" and nothing are not a choice)
    dtype_explicit: bool = False
    device_map: Any = None
    max_memory: Mapping[Any, Any] | None = None
    placement: str | None = None  # other explicit placement: "tp_plan", "accelerate hooks", ...
    device: str | None = None  # a built model: where its parameters are ("cpu", "cuda:0", "meta")
    quantized: bool = False
    supports_flash: bool = True
    supports_sdpa: bool = True
    supports_flex: bool = True
    # transformers' flash code path can run on attnguard's SDPA twins for this model here
    flash_path_on_twins: bool = False
    # why attnguard does not know this release's flash code path ("" when it does, or unasked)
    flash_path_unrecognised: str = ""
    # the kernel transformers itself would load for this model's flash request ("" = the
    # request), and the arguments its attention passes that the twins do not compute
    flash_routed_to: str = ""
    flash_uncomputed: tuple[str, ...] = ()
    # the Hugging Face hub kernel transformers itself loads for this flash request ("" = none):
    # it is tried as without attnguard (where it cannot load: attnguard.kernels.
    # kernels.verdict decides, at transformers' loader of hub kernels)
    hub_kernel: str = ""
    model_bytes: int | None = None

    @property
    def effective_dtype(self) -> str | None:
        """The dtype the model would end up in; None when unknown (or a per-module dict)."""
        d = self.dtype if self.dtype is not None else self.default_dtype
        if d == "auto":
            return self.checkpoint_dtype
        return d if isinstance(d, str) else None


@dataclass(frozen=True, kw_only=True)
class Action:
    """One decision, with the table row it comes from.

    ``problem`` says what is wrong (or, for an observation, what was seen and why it is left as it
    is); ``change`` says what fix mode does, as a phrase that reads after "attnguard will" / "would"
    ("load with sdpa"): the event's reason is worded from both and the mode.
    """

    rule: str
    event: str
    reason_code: str
    problem: str
    remedy: str | None = None
    target: str = ""  # sub-config key for per-sub-config backends ("" = the whole model)
    before: Any = None
    after: Any = None
    change: str = ""
    fields: Mapping[str, Any] = field(default_factory=dict)  # event-specific extras

    @property
    def applies(self) -> bool:
        """True for a change (fix mode applies it); False for an observation."""
        return self.event != "observed"

    def reason(self, mode: str = "fix") -> str:
        """The event's reason in ``mode``: what fix mode did, or would have done."""
        if not self.applies or not self.change:
            return self.problem
        if mode == "fix":
            return f"{self.problem}; attnguard: {self.change}"
        return f"{self.problem}; attnguard would {self.change} ({mode} mode: not applied)"


@dataclass(frozen=True)
class Plan:
    request: LoadRequest
    actions: tuple[Action, ...] = ()
    attn_implementation: str | Mapping[str, str | None] | None = None  # to load with
    dtype: str | None = None  # load dtype to inject; None = leave as requested
    device: str | None = None  # place the model here; None = leave
    device_map: Any = None  # new device_map (one replica per rank); None = leave
    max_memory: Mapping[Any, Any] | None = None
    replaced_backends: frozenset[str] = field(default_factory=frozenset)
    # "sdpa": flash kept as the code path, its kernel calls computed by the SDPA twins
    kernels: str | None = None

    @property
    def changes(self) -> list[Action]:
        return [a for a in self.actions if a.applies]

    @property
    def observations(self) -> list[Action]:
        return [a for a in self.actions if not a.applies]

    @property
    def backend_changed(self) -> bool:
        """The load must pass another ``attn_implementation`` than the caller's."""
        return self.attn_implementation != self.request.attn_implementation

    def as_dict(self) -> dict[str, Any]:
        return {
            "request": {
                k: (dict(v) if isinstance(v, Mapping) else v)
                for k, v in self.request.__dict__.items()
            },
            "attn_implementation": _jsonable(self.attn_implementation),
            "kernels": self.kernels,
            "dtype": self.dtype,
            "device": self.device,
            "device_map": _jsonable(self.device_map),
            "max_memory": _jsonable(self.max_memory),
            "actions": [
                {
                    **{k: v for k, v in a.__dict__.items() if k != "fields"},
                    **dict(a.fields),
                    "reason": a.reason(),
                    "applies": a.applies,
                }
                for a in self.actions
            ],
        }


def _jsonable(v: Any) -> Any:
    return {str(k): x for k, x in v.items()} if isinstance(v, Mapping) else v


_DTYPE_NAMES = {
    "float32": "float32",
    "float": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "half": "float16",
    "fp16": "float16",
    "auto": "auto",
}


def dtype_name(dtype: Any) -> str | None:
    """torch.float32 / "fp32" / "float32" -> "float32"; None stays None; others by their name."""
    if dtype is None:
        return None
    name = str(dtype).replace("torch.", "").strip().lower()
    return _DTYPE_NAMES.get(name, name)


def is_flash(name: Any) -> bool:
    """A request whose kernel is one of flash-attn's families: ``flash_attention_2/3/4`` (and
    their paged variants), or a hub kernel known to be one (a request by hub name gets the same
    rows as ``flash_attention_2`` routed to that kernel)."""
    if not isinstance(name, str):
        return False
    return canonical_backend(name) in FLASH_BACKENDS or kernel_identity.is_flash_request(name)


def half_dtype(facts: Facts, settings: Settings) -> str:
    """bf16 where the GPU has it natively, else fp16; ATTNGUARD_DTYPE overrides."""
    if settings.dtype == "bf16":
        return "bfloat16"
    if settings.dtype == "fp16":
        return "float16"
    return "bfloat16" if facts.native_bf16 else "float16"
