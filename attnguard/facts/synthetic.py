"""Facts for a machine we are not on (:func:`synthetic`), judged by the same
:func:`~attnguard.facts.backends.assess_backend`: tests, ``attnguard doctor`` and the examples
plan for a GPU box from anywhere.
"""

from __future__ import annotations

from collections.abc import Mapping

from .backends import BACKENDS, PackageState, assess_backend
from .context import InitContext, Launch
from .hardware import GPU, Hardware
from .machine import Facts


def synthetic(
    capabilities: tuple[tuple[int, int], ...] = (),
    *,
    installed: Mapping[str, str | PackageState] | None = None,
    gpu_name: str = "GPU",
    gpu_memory: int = 80 * 2**30,
    launch: Launch | None = None,
    init: InitContext | None = None,
    accelerate: bool = True,
    torch_version: str = "2.5.0",
    transformers_version: str = "4.57.6",
) -> Facts:
    """Facts for a machine we are not on, judged by the same :func:`assess_backend`.

    ``capabilities``: one (major, minor) per GPU (empty: no CUDA). ``installed``: backend name ->
    version string (installed and importable) or a :class:`PackageState` (e.g. a broken import).
    """
    gpus = tuple(
        GPU(i, f"{gpu_name} (sm{c[0]}{c[1]})", tuple(c), gpu_memory)  # type: ignore[arg-type]
        for i, c in enumerate(capabilities)
    )
    launch = launch or Launch()
    base = Facts(Hardware(gpus), {}, launch=launch)
    gpu = base.local_gpu or (gpus[0] if gpus else None)
    backends = {}
    for name in BACKENDS:
        raw = (installed or {}).get(name)
        if name in ("sdpa", "flex_attention"):
            state = raw if isinstance(raw, PackageState) else PackageState(True)
        elif raw is None:
            state = PackageState(False)
        elif isinstance(raw, PackageState):
            state = raw
        else:
            state = PackageState(True, raw)
        backends[name] = assess_backend(
            name,
            state,
            cuda=bool(gpus),
            gpu=gpu,
            torch_version=torch_version,
            transformers_version=transformers_version,
        )
    return Facts(
        Hardware(gpus),
        backends,
        launch=launch,
        init=init or InitContext(),
        accelerate=accelerate,
        torch_version=torch_version,
        transformers_version=transformers_version,
    )
