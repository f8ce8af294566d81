"""This process's facts (:func:`current`): hardware and each backend read the first time a
decision needs them and cached, the context re-read on every call; :class:`Facts`, what the
planner decides on.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .._settings import Settings
from .backends import (
    BACKENDS,
    CAPABILITY_FLOOR,
    INTEGRATION_OF,
    OK,
    Backend,
    Backends,
    PackageState,
    assess_backend,
    canonical_backend,
    flex_state,
    package_state,
    probe_package,
    spec_found,
)
from .context import InitContext, Launch, init_context_now, launch_now
from .hardware import GPU, Hardware


@dataclass(frozen=True)
class Facts:
    """Everything the planner needs to know about this runtime."""

    hardware: Hardware
    backends: Mapping[str, Backend]
    launch: Launch = field(default_factory=Launch)
    init: InitContext = field(default_factory=InitContext)
    accelerate: bool = True
    torch_version: str | None = None
    transformers_version: str | None = None

    @property
    def cuda(self) -> bool:
        return self.hardware.cuda

    @property
    def gpus(self) -> tuple[GPU, ...]:
        return self.hardware.gpus

    def backend(self, name: str) -> Backend:
        """Status of ``name``; "eager" and keys we do not judge count as usable."""
        key = canonical_backend(name)
        if key in BACKENDS:
            found = self.backends.get(key)
            if found is not None:
                return found
        return Backend(name, True, OK, "not judged by attnguard")

    @property
    def local_gpu(self) -> GPU | None:
        """The GPU this rank would use: LOCAL_RANK, or 0 when each rank sees one GPU."""
        index = self.local_gpu_index
        return None if index is None else self.gpus[index]

    @property
    def local_gpu_index(self) -> int | None:
        if not self.cuda or not self.gpus:
            return None
        rank = self.launch.local_rank
        if rank < len(self.gpus):
            return rank
        return 0 if len(self.gpus) == 1 else None

    @property
    def native_bf16(self) -> bool:
        gpu = self.local_gpu
        return gpu is not None and gpu.native_bf16

    def as_dict(self) -> dict[str, Any]:
        """JSON-friendly view (``attnguard doctor --json``): judges every backend."""
        d: dict[str, Any] = {
            "cuda": self.cuda,
            "gpus": [dict(dataclasses.asdict(g), native_bf16=g.native_bf16) for g in self.gpus],
            "backends": {k: dataclasses.asdict(self.backends[k]) for k in self.backends},
            "launch": dataclasses.asdict(self.launch),
            "init": dataclasses.asdict(self.init),
            "accelerate": self.accelerate,
            "torch_version": self.torch_version,
            "transformers_version": self.transformers_version,
            "native_bf16": self.native_bf16,
        }
        for raw in d["gpus"]:
            raw["capability"] = list(raw["capability"])
        return d


def _integration_allowed(name: str, settings: Settings | None) -> bool:
    """False when ATTNGUARD_DISABLE (in ``settings``) names the library this backend's probe
    would import."""
    integration = INTEGRATION_OF.get(name)
    if integration is None:
        return True
    return settings is None or settings.allows(integration)


def _probe_backend(name: str, facts: Facts, settings: Settings | None) -> Backend:
    """Judge ``name`` on this machine (the body of :class:`Backends` for the current process)."""
    if name == "sdpa":
        state = PackageState(True)
    elif name == "flex_attention":
        state = flex_state()
    else:
        allowed = _integration_allowed(name, settings)
        state, _ = package_state(name)
        gpu = gpu_device = half = None
        if state.installed and allowed:
            gpu = facts.local_gpu or (facts.gpus[0] if facts.gpus else None)
            floor = CAPABILITY_FLOOR.get(name)
            # a tiny call only where it can pass: capability checks come first and are cheaper
            if gpu is not None and (floor is None or tuple(gpu.capability) >= floor):
                import torch

                gpu_device = f"cuda:{gpu.index}"
                half = torch.bfloat16 if gpu.native_bf16 else torch.float16
        state = probe_package(name, gpu_device=gpu_device, half=half, do_import=allowed)
    gpu = facts.local_gpu or (facts.gpus[0] if facts.gpus else None)
    return assess_backend(
        name,
        state,
        cuda=facts.cuda,
        gpu=gpu,
        torch_version=facts.torch_version,
        transformers_version=facts.transformers_version,
    )


_lock = threading.RLock()


_machine: tuple[Hardware, Backends, dict[str, Any]] | None = None


def _this_machine() -> tuple[Hardware, Backends, dict[str, Any]]:
    """The cached hardware / backends objects and versions of this process (nothing probed yet)."""
    global _machine
    machine = _machine
    if machine is None:
        with _lock:
            if _machine is None:
                from ..installed import imported_version

                hardware = Hardware()
                static = {
                    "accelerate": spec_found("accelerate"),
                    "torch_version": imported_version("torch", "torch"),
                    "transformers_version": imported_version("transformers", "transformers"),
                }
                holder: list[Facts] = []
                backends = Backends(lambda name: _probe_backend(name, holder[0], backends.settings))
                holder.append(Facts(hardware, backends, **static))
                _machine = (hardware, backends, static)
            machine = _machine
    return machine


def current(settings: Settings | None = None) -> Facts:
    """This process's facts. Cheap: hardware and each backend are read the first time a decision
    needs them and cached; the launch and init context are re-read on every call.

    ``settings``: the settings in force, whose ATTNGUARD_DISABLE keeps a backend's probe from
    importing a library it names (None: as the last caller gave them; none given: every one)."""
    hardware, backends, static = _this_machine()
    if settings is not None:
        backends.settings = settings
    return Facts(hardware, backends, launch=launch_now(), init=init_context_now(), **static)


def device_read_so_far() -> dict[str, Any]:
    """This process's device as decisions read it so far (``device``: "cuda" / "cpu",
    ``capability`` of this rank's GPU), reading nothing new: {} where no decision needed it."""
    machine = _machine
    if machine is None or not machine[0].read_yet:
        return {}
    if not machine[0].cuda:
        return {"device": "cpu"}
    gpu = current().local_gpu or (machine[0].gpus[0] if machine[0].gpus else None)
    if gpu is None:
        return {"device": "cuda"}
    return {"device": "cuda", "capability": f"{gpu.capability[0]}.{gpu.capability[1]}"}


def reset() -> None:
    """Forget everything read so far (tests; after installing or removing a backend)."""
    global _machine
    with _lock:
        _machine = None
