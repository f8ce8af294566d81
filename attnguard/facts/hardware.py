"""The GPUs of this machine: compute capability, memory, native bf16 (read once, when a decision
first needs them).
"""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass

NATIVE_BF16_FLOOR = (8, 0)


@dataclass(frozen=True)
class GPU:
    """One visible CUDA device."""

    index: int
    name: str
    capability: tuple[int, int]
    total_memory: int = 0

    @property
    def native_bf16(self) -> bool:
        """bf16 in hardware (Ampere+). ``torch.cuda.is_bf16_supported()`` is True on V100/T4
        too because it counts emulation, which is slow: never use it for this decision."""
        return tuple(self.capability) >= NATIVE_BF16_FLOOR


class Hardware:
    """CUDA availability and the visible GPUs: given (synthetic facts) or read from torch the first
    time a decision needs them (never at activation: a load that needs no GPU fact touches no GPU)."""

    def __init__(self, gpus: tuple[GPU, ...] | None = None, *, cuda: bool | None = None) -> None:
        self._gpus = gpus
        self._cuda = cuda if cuda is not None else (None if gpus is None else bool(gpus))
        self._lock = threading.Lock()

    def _read(self) -> None:
        with self._lock:
            if self._gpus is None:
                self._cuda, self._gpus = _read_gpus()

    @property
    def cuda(self) -> bool:
        if self._cuda is None:
            self._read()
        return bool(self._cuda)

    @property
    def gpus(self) -> tuple[GPU, ...]:
        if self._gpus is None:
            self._read()
        return self._gpus or ()

    @property
    def read_yet(self) -> bool:
        """Whether the GPUs were read (or given): asking then reads nothing new."""
        return self._gpus is not None

    def __repr__(self) -> str:
        known = "not read yet" if self._gpus is None else f"{len(self._gpus)} GPU(s)"
        return f"Hardware({known})"


def _read_gpus() -> tuple[bool, tuple[GPU, ...]]:
    torch = sys.modules.get("torch")
    if torch is None:  # nothing has imported torch: no model is being built on a GPU here
        import torch
    try:
        if not torch.cuda.is_available():
            return False, ()
        out = []
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            out.append(GPU(i, props.name, (props.major, props.minor), int(props.total_memory)))
        return True, tuple(out)
    except Exception:
        return False, ()
