"""Child processes: this checkout's paths, a child Python's environment, one run with a watchdog,
a free port, an exception's first line."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"
WORKERS = TESTS / "workers"
PY = sys.executable


def subprocess_env(**extra: str) -> dict[str, str]:
    """Environment for a child Python that imports this checkout of attnguard."""
    # not attnguard's settings, nor .ci/run's records of this session (a child pytest session
    # would write its own times over this one's)
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("ATTNGUARD") and k not in ("TEST_FILE_TIMES", "TEST_TIMES_FILE")
    }
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(extra)
    return env


def run_python(
    args: list[str], env: dict[str, str], *, timeout: float = 600, what: str = ""
) -> subprocess.CompletedProcess[str]:
    """``python ARGS`` (a script and its arguments, or ``-c CODE ...``) under a watchdog
    (``timeout`` seconds: a hang fails the test, it never stalls the suite); it must exit 0,
    or the test fails with ``what`` and the end of its stderr."""
    res = subprocess.run([PY, *args], env=env, capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, f"{what or args[0]}:\n{res.stderr[-4000:]}"
    return res


def run_code(
    code: str, *args: str, env: dict[str, str], cwd: Path | None = None, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """``python -c CODE ARGS`` (the code dedented) under a watchdog; the result, whatever it is."""
    return subprocess.run(
        [PY, "-c", textwrap.dedent(code), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
    )


def start_program(script: Path, code: str, **env: str) -> subprocess.Popen[str]:
    """``code`` written to ``script`` and started as a child Python that imports this checkout
    (``env`` added to its environment), its output piped: end it with ended()."""
    script.write_text(code)
    return subprocess.Popen(
        [PY, str(script)],
        env=subprocess_env(**env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def ended(proc: subprocess.Popen[str], hang_s: float) -> tuple[int, str, str]:
    """A started program's (exit code, stdout, stderr), once it ends; one that arms faulthandler
    with ``hang_s`` and still runs 30 s later, or whose dump says it hung, fails the test."""
    import pytest

    try:
        out, err = proc.communicate(timeout=hang_s + 30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        pytest.fail("the guarded program hung")
    assert "Timeout (" not in err, f"the guarded program hung:\n{err[-4000:]}"
    return proc.returncode, out, err


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (a launcher's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def first_line(exc: BaseException, limit: int = 300) -> str:
    """``Type: the message's first line`` (at most ``limit`` characters of it)."""
    return f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:limit]}"


def fresh_venv(root: Path, editable: bool) -> Path:
    """A new venv with attnguard pip-installed; torch & co. come from this venv via a .pth."""
    venv = root / ("venv-e" if editable else "venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    target = ["-e", str(REPO)] if editable else [str(REPO)]
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps", *target],
        check=True,
    )
    site = Path(
        subprocess.run(
            [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    # sorts before attnguard.pth, so dependencies are importable when the hook runs
    (site / "_attnguard_test_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return venv
