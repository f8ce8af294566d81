"""Activation paths: import, activate/deactivate orderings, the start-up hook in real installs,
and ``attnguard run``. Hook tests install the package for real into fresh virtual environments
(``pip install .`` and ``pip install -e .``) and run fresh interpreters."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from helpers.packages import STANDINS
from helpers.processes import PY, fresh_venv, subprocess_env

import attnguard
from attnguard import runtime

HEAVY = ("torch", "transformers", "attnguard", "_attnguard_hook", "wrapt", "structlog")
PROBE = (
    "import sys, json; print(json.dumps(sorted({m.split('.')[0] for m in sys.modules} & "
    + repr(set(HEAVY))
    + ")))"
)


def _records() -> list:
    return [r for mod in runtime.integrations().values() for r in _ledgers(mod)]


def _ledgers(mod) -> list:
    """Every PatchRecord of an integration (transformers has two halves)."""
    out = []
    for obj in vars(mod).values():
        recs = getattr(getattr(obj, "ledger", obj), "records", None)
        if isinstance(recs, list):
            out.extend(recs)
    return out


@pytest.mark.smoke
def test_import_activates_in_a_fresh_process() -> None:
    code = "import attnguard; print(attnguard.is_active(), attnguard.settings().mode)"
    out = subprocess.run(
        [PY, "-c", code],
        env=subprocess_env(ATTNGUARD_LOG="none"),
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.split() == ["True", "fix"]
    env = subprocess_env(ATTNGUARD_LOG="none", ATTNGUARD_MODE="off")
    out = subprocess.run([PY, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "off"]


def test_import_with_an_invalid_setting_is_one_clear_line_and_uses_the_default() -> None:
    """A bad value set for a whole environment never stops the program (tests/test_bad_settings.py
    has every entry, tests/test_bad_log_setting.py every substitute)."""
    env = subprocess_env(ATTNGUARD_DTYPE="fp64")
    code = "import attnguard; print(attnguard.is_active(), attnguard.settings().dtype)"
    res = subprocess.run([PY, "-c", code], env=env, capture_output=True, text=True)
    assert res.returncode == 0 and res.stdout == "True auto\n"
    assert res.stderr.splitlines() == [
        "attnguard: invalid ATTNGUARD_DTYPE='fp64'; valid values: auto | bf16 | fp16 "
        "(ATTNGUARD_DTYPE=auto is used)"
    ]


@pytest.mark.smoke
def test_activate_deactivate_activate_restores_and_repatches_by_identity() -> None:
    import transformers.modeling_utils  # noqa: F401  (the integration patches on import)

    attnguard.activate(log="none")
    first = {(id(r.owner), r.attr): r for r in _records()}
    assert first, "activation patched nothing"
    # the attention registry's entries are recorded beside the patched attributes
    assert any(r.item for r in first.values()) and any(not r.item for r in first.values())
    for rec in first.values():
        assert rec.current() is rec.wrapper
    attnguard.activate(log="none")  # same settings: nothing changes
    assert {(id(r.owner), r.attr): r.wrapper for r in _records()} == {
        k: r.wrapper for k, r in first.items()
    }
    attnguard.deactivate()
    for rec in first.values():
        assert rec.current() is rec.original  # the very object (or absence) from before
    assert _records() == []
    attnguard.activate(log="none")
    again = {(id(r.owner), r.attr) for r in _records()}
    assert again == set(first)
    attnguard.deactivate()
    attnguard.deactivate()  # twice is harmless


def test_changing_settings_reactivates_with_the_new_ones() -> None:
    attnguard.activate(log="none", mode="warn")
    assert runtime.settings().mode == "warn"
    attnguard.configure(mode="strict")
    assert runtime.settings().mode == "strict" and attnguard.is_active()


@pytest.mark.skipif(not (STANDINS / "flash_attn").is_dir(), reason="flash_attn stand-in missing")
def test_from_import_binds_the_guarded_function_only_after_activation(tmp_path: Path) -> None:
    """A user module doing ``from flash_attn import flash_attn_func`` (flash_attn stand-in)."""
    (tmp_path / "user_mod.py").write_text("from flash_attn import flash_attn_func\n")
    code = (
        "import sys, importlib\n"
        "first = sys.argv[1]\n"
        "if first == 'user':\n"
        "    import user_mod\n"
        "    import attnguard\n"
        "else:\n"
        "    import attnguard\n"
        "    import user_mod\n"
        "import flash_attn\n"
        "guarded = flash_attn.flash_attn_func\n"
        "print(user_mod.flash_attn_func is guarded, hasattr(user_mod.flash_attn_func, '__wrapped__'))\n"
    )
    env = subprocess_env(ATTNGUARD_LOG="none")
    env["PYTHONPATH"] = f"{tmp_path}:{STANDINS}:{env['PYTHONPATH']}"
    after = subprocess.run([PY, "-c", code, "guard"], env=env, capture_output=True, text=True)
    assert after.stdout.split() == ["True", "True"], after.stderr
    before = subprocess.run([PY, "-c", code, "user"], env=env, capture_output=True, text=True)
    # bound before activation: the user's name still points at the unguarded original
    assert before.stdout.split() == ["False", "False"], before.stderr


# --- real installs and the start-up hook -------------------------------------------------------


@pytest.fixture(scope="module", params=[False, True], ids=["pip-install", "pip-install-e"])
def venv(request, tmp_path_factory) -> Path:
    return fresh_venv(tmp_path_factory.mktemp("venvs"), editable=request.param)


def _clean_env(**extra: str) -> dict[str, str]:
    env = subprocess_env(**extra)
    env.pop("PYTHONPATH", None)  # only what the venv installed
    return env


def _py(venv: Path, code: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(venv / "bin" / "python"), "-c", code],
        env=_clean_env(**env),
        capture_output=True,
        text=True,
        cwd="/",
    )


def test_installed_hook_is_inert_when_the_switch_is_off(venv: Path) -> None:
    site = Path(
        _py(venv, "import sysconfig; print(sysconfig.get_paths()['purelib'])").stdout.strip()
    )
    assert (site / "attnguard.pth").is_file() and (site / "attnguard.start").is_file()
    for value in (None, "0", ""):
        env = {} if value is None else {"ATTNGUARD": value}
        res = _py(venv, PROBE, **env)
        assert json.loads(res.stdout) == [], res.stderr


def test_installed_hook_activates_without_importing_torch(venv: Path) -> None:
    res = _py(
        venv,
        PROBE + "; import attnguard; print(attnguard.is_active())",
        ATTNGUARD="1",
        ATTNGUARD_LOG="none",
    )
    loaded, active = res.stdout.splitlines()
    assert "attnguard" in json.loads(loaded) and "torch" not in json.loads(loaded), res.stderr
    assert "transformers" not in json.loads(loaded)
    assert active == "True"


def test_installed_hook_patches_transformers_on_import(venv: Path) -> None:
    code = (
        "import transformers.modeling_utils as mu\n"
        "from attnguard import runtime\n"
        "print(sorted(runtime.patched_integrations()))\n"
    )
    res = _py(venv, code, ATTNGUARD="1", ATTNGUARD_LOG="none")
    assert res.stdout.strip() == "['transformers']", res.stderr


def test_installed_hook_with_an_invalid_setting_runs_the_program_in_warn_mode(venv: Path) -> None:
    code = "import attnguard; print('ran', attnguard.is_active(), attnguard.settings().mode)"
    res = _py(venv, code, ATTNGUARD="1", ATTNGUARD_MODE="loud")
    assert res.returncode == 0 and res.stdout.strip() == "ran True warn"
    assert (
        res.stderr.count("invalid ATTNGUARD_MODE='loud'; valid values: fix | warn | strict | off")
        == 1
    )


def test_attnguard_run_sets_the_switch_and_passes_the_exit_code(venv: Path) -> None:
    child = "import sys, attnguard; print(attnguard.is_active()); sys.exit(7)"
    res = subprocess.run(
        [str(venv / "bin" / "attnguard"), "run", "--", "python", "-c", child],
        env={**_clean_env(ATTNGUARD_LOG="none"), "PATH": f"{venv / 'bin'}:/usr/bin:/bin"},
        capture_output=True,
        text=True,
    )
    assert res.returncode == 7 and res.stdout.strip() == "True", res.stderr


def test_attnguard_run_refuses_a_bad_setting_before_starting_the_child(venv: Path) -> None:
    res = subprocess.run(
        [str(venv / "bin" / "attnguard"), "run", "--", "python", "-c", "print('child ran')"],
        env={**_clean_env(ATTNGUARD_FALLBACK="flash"), "PATH": f"{venv / 'bin'}:/usr/bin:/bin"},
        capture_output=True,
        text=True,
    )
    assert res.returncode == 2 and "child ran" not in res.stdout
    assert "invalid ATTNGUARD_FALLBACK='flash'" in res.stderr


def test_hook_leaves_a_torchrun_launcher_unguarded_but_not_its_workers(
    venv: Path, tmp_path: Path
) -> None:
    """The launcher has no rank; its workers (plain python processes) inherit ATTNGUARD=1."""
    body = "import attnguard; print(attnguard.is_active())\n"
    launcher = tmp_path / "torchrun"
    worker = tmp_path / "train.py"
    launcher.write_text(body)
    worker.write_text(body)
    py = str(venv / "bin" / "python")
    env = _clean_env(ATTNGUARD="1", ATTNGUARD_LOG="none")
    outs = [
        subprocess.run([py, str(s)], env=env, capture_output=True, text=True).stdout.strip()
        for s in (launcher, worker)
    ]
    assert outs == ["False", "True"]
