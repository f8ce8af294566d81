"""``attnguard doctor`` and the names it reads: a directory or variable whose name is no UTF-8
never makes it fail (the name is shown escaped), and the hub kernels it lists are the ones the
`kernels` package itself loads without network, from its own cache (``kernels--org--name``,
``KERNELS_CACHE``) as from ``LOCAL_KERNELS``.

Fresh interpreters running the real command (``python -m attnguard``), with a strict UTF-8
stdout where names are the point; the real `kernels` package of scripts/test.sh
($TEST_KERNELS_DIR) loads the cached stand-in hub kernel offline.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
from helpers.packages import hub_standin
from helpers.processes import PY, subprocess_env

write_repo = hub_standin().write_repo
KERNELS = os.environ.get("TEST_KERNELS_DIR")
ABSENT = os.environ.get("TEST_KERNELS_ABSENT", "")
SHA = "0123456789abcdef0123456789abcdef01234567"
HUB = "kernels-community/flash-attn2"


def doctor(*args: str, kernels: bool = False, **env: str) -> subprocess.CompletedProcess[str]:
    extra = {"HF_HUB_OFFLINE": "1", "PYTHONIOENCODING": "utf-8:strict", **env}
    full = subprocess_env(**extra)
    if kernels and KERNELS:
        full["PYTHONPATH"] = os.pathsep.join([full["PYTHONPATH"], KERNELS])
    return subprocess.run(
        [PY, "-m", "attnguard", "doctor", *args],
        env=full,
        capture_output=True,
        text=True,
        encoding="utf-8",
        errors="surrogateescape",
        timeout=240,
    )


def here(res: subprocess.CompletedProcess[str]) -> list[dict[str, Any]]:
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout)["kernel_hub"]["here"]


def cache_repo(root: Path, repo: str, layout: str = "kernels") -> Path:
    """``repo`` as `kernels` caches it: ``<root>/<layout>--org--name`` with a ``v3`` tag on a
    snapshot holding the stand-in's build."""
    folder = root / f"{layout}--{repo.replace('/', '--')}"
    write_repo(folder / "snapshots" / SHA)
    (folder / "refs").mkdir(parents=True, exist_ok=True)
    (folder / "refs" / "v3").write_text(SHA)
    return folder


def test_a_name_that_is_no_utf8_is_shown_escaped(tmp_path: Path) -> None:
    """Before: exit 2 and only "'utf-8' codec can't encode character '\\udcff' ..."."""
    cache = tmp_path / "hub"
    odd = os.fsencode(cache) + b"/models--org--k\xff/snapshots/abc/build/torch-cpu"
    os.makedirs(odd)
    os.makedirs(os.fsencode(cache) + b"/kernels--org--n\xfe/snapshots/abc/build/torch-\xfd")
    local = os.fsencode(tmp_path) + b"/local\xfc"
    os.makedirs(local + b"/build/torch-cpu")
    env = {
        "HF_HUB_CACHE": str(cache),
        "LOCAL_KERNELS": os.fsdecode(b"org/loc\xfc=" + local),
    }
    text = doctor(**env)
    assert text.returncode == 0, text.stderr[-3000:]
    for shown in ("org/k\\xff [torch-cpu] (cache)", "org/n\\xfe [torch-\\xfd] (cache)"):
        assert shown in text.stdout
    assert "org/loc\\xfc [torch-cpu] (LOCAL_KERNELS)" in text.stdout
    listed = {(k["repo"], tuple(k["variants"]), k["source"]) for k in here(doctor("--json", **env))}
    assert listed == {
        ("org/loc\\xfc", ("torch-cpu",), "LOCAL_KERNELS"),
        ("org/k\\xff", ("torch-cpu",), "cache"),
        ("org/n\\xfe", ("torch-\\xfd",), "cache"),
    }


@pytest.mark.skipif(KERNELS is None, reason=ABSENT or "no kernels package from scripts/test.sh")
@pytest.mark.parametrize("where", ["KERNELS_CACHE", "HF_HUB_CACHE"])
def test_doctor_lists_what_kernels_loads_offline_from_its_own_cache(
    tmp_path: Path, where: str
) -> None:
    """kernels >= 0.16 keeps its builds as ``kernels--org--name`` in the Hugging Face cache, or
    in KERNELS_CACHE when that is set. Before: doctor looked at ``models--*`` only and said
    "none" while kernels loaded the build offline."""
    root = tmp_path / "cache"
    cache_repo(root, HUB)
    env = {where: str(root)}
    if where == "KERNELS_CACHE":
        env["HF_HUB_CACHE"] = str(tmp_path / "empty-hf-cache")
    load = (
        "import kernels\n"
        f"k = kernels.get_kernel({HUB!r}, version=3)\n"
        "print(k.IS_ATTNGUARD_STANDIN)\n"
    )
    full = subprocess_env(HF_HUB_OFFLINE="1", **env)
    full["PYTHONPATH"] = os.pathsep.join([full["PYTHONPATH"], KERNELS or ""])
    loaded = subprocess.run([PY, "-c", load], env=full, capture_output=True, text=True, timeout=240)
    assert loaded.stdout.split()[-1:] == ["True"], loaded.stderr[-3000:]  # kernels' own word
    source = "KERNELS_CACHE" if where == "KERNELS_CACHE" else "cache"
    assert here(doctor("--json", kernels=True, **env)) == [
        {
            "repo": HUB,
            "variants": [f"torch-{hub_standin().system_backend()}"],
            "source": source,
            "twins_compute": "flash-attn 2",
        }
    ]


def test_both_cache_layouts_are_one_entry_per_repo(tmp_path: Path) -> None:
    """Builds of one repo cached by an older `kernels` (``models--``) and a newer one
    (``kernels--``): one line, the variants of both."""
    root = tmp_path / "hub"
    cache_repo(root, HUB, layout="models")
    newer = cache_repo(root, HUB)
    (newer / "snapshots" / SHA / "build" / "torch-other").mkdir()
    listed = here(doctor("--json", HF_HUB_CACHE=str(root)))
    assert [(k["repo"], k["source"]) for k in listed] == [(HUB, "cache")]
    assert "torch-other" in listed[0]["variants"]
