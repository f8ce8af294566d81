"""The ATTNGUARD=1 start-up hook (hook/ in this checkout, attnguard.pth where installed): a child
environment that runs this checkout's hook, and the mark for tests that need it installed."""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

import pytest

from helpers.processes import REPO, subprocess_env

HOOK_DIR = REPO / "hook"


def env_for(*paths: str | Path, **extra: str) -> dict[str, str]:
    """A child environment: this checkout's attnguard and its ``_attnguard_hook`` first."""
    env = subprocess_env(HF_HUB_OFFLINE="1", TQDM_DISABLE="1", **extra)
    env["PYTHONPATH"] = os.pathsep.join([*map(str, paths), str(HOOK_DIR), env["PYTHONPATH"]])
    return env


def startup_hook_installed() -> bool:
    return (Path(sysconfig.get_paths()["purelib"]) / "attnguard.pth").is_file()


needs_hook = pytest.mark.skipif(
    not startup_hook_installed(), reason="the ATTNGUARD=1 start-up hook is not installed here"
)
