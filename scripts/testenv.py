"""The test command's environment: what scripts/test.sh installs, each piece built once under a key
of what decides its contents and reused while the key holds, and the variables the tests read.

    python scripts/testenv.py setup       # scripts/test.sh: prints the shell lines it evaluates
    python3 scripts/testenv.py venv --torch 2.13.0 --transformers newest   # .ci/run: a venv's path
    python scripts/testenv.py overlay transformers==4.45.2                  # .ci/run: a site dir
    python3 scripts/testenv.py prune      # .ci/run: removes entries unused for TEST_CACHE_DAYS (7)

``setup`` runs with the interpreter of the environment under test and says on stderr, as it goes,
what it installs or reuses. Into that environment it installs only attnguard (editable) with its
``test`` extras, and nothing where they are installed already: TORCH_VERSION=X installs torch X
first; otherwise the environment's torch stays; torch 2.13.0 only where there is none.
TRANSFORMERS_VERSION pins transformers too, installed into the environment, or, with
TEST_TRANSFORMERS_OVERLAY=1 (CI's smoke lanes), put with what it needs beyond the environment in a
directory on the test run's PYTHONPATH, the environment unchanged.

The test-only packages that recreate real failure cases go into TEST_DEPS_DIR (default
``.test-deps/`` of this checkout), never into the environment, each in a release that runs with
this torch, or its tests skip and say why (TEST_*_ABSENT):

    xformers-<version>-pyXY/       xformers without its torch pin (its CUDA ops never load on a
        CPU: "installed but unusable"), on the test run's PYTHONPATH: 0.0.35 (it needs torch >=
        2.10); for an older torch the newest release built for it (each pins its torch:
        0.0.27.post2 for 2.4.0, 0.0.32.post2 for 2.8.0), as pip resolves it beside this torch
    deepspeed-0.19.8-pyXY-<key>/   DeepSpeed without its CUDA ops (ZeRO-3 on CPU with gloo) and what
        it needs beyond the environment; for tests/test_ranks.py's workers ($TEST_DEEPSPEED_DIR)
    flash-attn-2.8.3-nocuda/       flash-attn built without its CUDA extension (a broken install);
        for the tests that need one ($TEST_BROKEN_FLASH_ATTN_DIR)
    diffusers-0.42.1-pyXY-<key>/   diffusers and what it needs beyond the environment, resolved
        with its torch and transformers, on the test run's PYTHONPATH; where pip cannot install it
        beside this transformers (it needs huggingface-hub >= 1.32, transformers 4.x requires it
        below 1.0) or it does not import with this torch (it needs torch >= 2.6)
        TEST_DIFFUSERS_ABSENT says why; elsewhere TEST_DIFFUSERS_EXPECTED=1 (not importing fails)
    kernels-<version>-pyXY-<key>/  the hub's loader at the newest release this transformers accepts
        (its own bounds, scripts/kernels_requirement.py), else the newest there is (the skew a user
        meets); for the hub-kernel tests' programs ($TEST_KERNELS_DIR, else TEST_KERNELS_ABSENT)
    kernels-0.11.7-nodeps/         a release diffusers refuses, metadata only ($TEST_KERNELS_REFUSED_DIR)

An entry's key is a hash of the Python and the releases pip resolved for it; pip's answer is
remembered under the packages the environment holds (asked again after TEST_RESOLVE_DAYS, 7), so an
environment that changes gets its own entries and never a stale one. Entries are written under a
temporary name and renamed into place, so two test runs sharing TEST_DEPS_DIR (CI's two workers)
never see a half-made one.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import importlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import tomllib
from importlib import metadata
from pathlib import Path

from requirements_met import unmet

REPO = Path(__file__).resolve().parent.parent
PY = f"py{sys.version_info[0]}{sys.version_info[1]}"
FORMAT = 1  # raised when what an entry holds changes: every key changes with it
NO_TORCH_DEFAULT = "2.13.0"  # only where the environment has none (README "Install")
XFORMERS_NEWEST = "0.0.35"
DEEPSPEED = "deepspeed==0.19.8"
FLASH_ATTN = "flash-attn==2.8.3"
DIFFUSERS = "diffusers==0.42.1"
KERNELS_REFUSED = "kernels==0.11.7"  # diffusers' *_hub backends refuse it (their floor: 0.12)
STARTED = time.monotonic()
DAY = 86400.0


SAYS = "scripts/test.sh"  # who speaks: the test command, or .ci/run through this script


def say(line: str) -> None:
    print(f"{SAYS} [{time.monotonic() - STARTED:5.1f} s] {line}", file=sys.stderr, flush=True)


def key(*parts: object) -> str:
    return hashlib.sha256(json.dumps([FORMAT, *parts], sort_keys=True).encode()).hexdigest()[:12]


def version_of(name: str, path: list[str] | None = None) -> str | None:
    dist = next(iter(metadata.distributions(name=name, path=path or sys.path)), None)
    return dist.version if dist is not None else None


def held(path: list[str]) -> list[str]:
    """``name==version`` of every distribution along ``path``, the first of each name (the one that
    imports): what a resolution against this environment depends on."""
    seen: dict[str, str] = {}
    for dist in metadata.distributions(path=path):
        name = re.sub(r"[-_.]+", "-", (dist.metadata["Name"] or "")).lower()
        seen.setdefault(name, dist.version)
    return sorted(f"{n}=={v}" for n, v in seen.items())


def pyproject_requirements() -> list[str]:
    """attnguard's dependencies and its test extras, as pyproject.toml declares them."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return [*project["dependencies"], *project["optional-dependencies"]["test"]]


def pip(*args: str, env: dict[str, str] | None = None, python: str = sys.executable) -> str:
    """pip's stdout; its output is shown only where it fails (then the test command stops)."""
    res = subprocess.run(
        [python, "-m", "pip", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
    )
    if res.returncode:
        sys.stderr.write(res.stdout[-4000:] + res.stderr[-6000:])
        raise SystemExit(f"scripts/test.sh: pip {' '.join(args[:2])} failed (above)")
    return res.stdout


def on_path(dirs: list[str]) -> dict[str, str]:
    return {"PYTHONPATH": os.pathsep.join([*dirs, os.environ.get("PYTHONPATH", "")]).strip(":")}


def import_error(dirs: list[str], module: str) -> str:
    """'' where ``module`` imports with ``dirs`` first on the path, else the last line of its error."""
    res = subprocess.run(
        [sys.executable, "-c", f"import {module}"],
        capture_output=True,
        text=True,
        env={**os.environ, **on_path(dirs)},
        timeout=600,
    )
    return "" if res.returncode == 0 else (res.stderr.strip().splitlines() or ["?"])[-1]


class Cache:
    """Entries (directories) and memos (pip's answers, import checks) in one directory."""

    def __init__(self, root: Path) -> None:
        self.root = root
        (root / "memo").mkdir(parents=True, exist_ok=True)

    def memo(self, name: str, parts: list[object], compute, days: float | None = None):  # noqa: ANN001, ANN201
        """``compute()``'s answer, remembered under a key of ``parts`` (for ``days`` where given)."""
        path = self.root / "memo" / f"{name}-{key(*parts)}.json"
        try:
            if days is None or time.time() - path.stat().st_mtime < days * DAY:
                return json.loads(path.read_text())["value"]
        except (OSError, ValueError, KeyError):
            pass
        value = compute()
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps({"value": value, "parts": parts}))
        os.replace(tmp, path)
        return value

    def entry(self, name: str, what: str, install) -> Path:  # noqa: ANN001
        """The entry ``name``, made by ``install(directory)`` where it is not there yet."""
        final = self.root / name
        if final.is_dir():
            os.utime(final)  # last used: prune keeps it
            say(f"{what}: reused {final}")
            return final
        say(f"{what}: installing into {final}")
        tmp = self.root / f".{name}.tmp{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        install(tmp)
        try:
            os.rename(tmp, final)
        except OSError:  # another run made it meanwhile: the same contents
            shutil.rmtree(tmp, ignore_errors=True)
        return final


def resolve(
    cache: Cache,
    reqs: list[str],
    front: list[str],
    env: dict[str, str] | None = None,
    *,
    conflicts_only: bool = True,
) -> list[str] | str:
    """What pip would add for ``reqs`` to the environment (with ``front`` first on its path):
    ``name==version`` each; or, where pip cannot, its words (the lines that name the conflict).
    ``conflicts_only``: any other failure (no such release, no network) stops the test command."""

    def ask() -> list[str] | str:
        # not quiet: pip names a conflict's causes only at its normal verbosity
        report = cache.root / f".report.{os.getpid()}.json"
        res = subprocess.run(
            [sys.executable, "-m", "pip", "install", "--dry-run", "--report", str(report), *reqs],
            capture_output=True,
            text=True,
            env={**os.environ, **on_path(front), **(env or {})},
        )
        if res.returncode == 0:
            plan = json.loads(report.read_text())["install"]
            report.unlink()
            return [f"{p['metadata']['name']}=={p['metadata']['version']}" for p in plan]
        report.unlink(missing_ok=True)
        said = res.stdout + res.stderr
        if "ResolutionImpossible" in said:
            why = re.findall(r"^ +(\S+ \S+ depends on .*)$", said, re.M)
            return ";".join(why) or "conflicting requirements"
        if conflicts_only:
            sys.stderr.write(said[-8000:])
            raise SystemExit("scripts/test.sh: pip could not resolve " + " ".join(reqs))
        return (re.findall(r"^ERROR: (.*)$", said, re.M) or ["pip failed"])[-1]

    days = float(os.environ.get("TEST_RESOLVE_DAYS", "7"))
    parts = [PY, reqs, env or {}, held([*front, *sys.path]), "with causes"]
    return cache.memo("resolved", parts, ask, days)


def site_dir(
    cache: Cache,
    label: str,
    reqs: list[str],
    front: list[str],
    env: dict[str, str] | None = None,
) -> Path | str:
    """A directory holding what pip would add for ``reqs`` to the environment, or pip's words
    where it cannot (``label``: the entry's name, before its key)."""
    plan = resolve(cache, reqs, front, env)
    if isinstance(plan, str):
        return plan
    name = f"{label}-{PY}-{key(PY, sorted(plan))}"
    return cache.entry(name, label.replace("-", " ", 1), lambda d: target(d, plan, env))


def target(where: Path, reqs: list[str], env: dict[str, str] | None = None, *args: str) -> None:
    """pip installs exactly ``reqs`` into ``where`` (bytecode is written by the runs that import
    them, at their final place)."""
    pip(
        "install", "-qq", "--no-deps", "--no-compile", *args, "--target", str(where), *reqs, env=env
    )


# --- the environment under test -------------------------------------------------------------------


def this_version() -> str:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]


def attnguard_is_this_checkout() -> bool:
    """attnguard is installed editable from this checkout, with this checkout's start-up hook."""
    dist = next(iter(metadata.distributions(name="attnguard")), None)
    if dist is None or dist.version != this_version():
        return False
    url = json.loads(dist.read_text("direct_url.json") or "{}")
    if url.get("url") != REPO.as_uri() or not url.get("dir_info", {}).get("editable"):
        return False
    site = Path(str(dist.locate_file("")))
    hooks = ("attnguard.pth", "attnguard.start", "_attnguard_hook.py")
    return all(
        (site / h).is_file() and (site / h).read_bytes() == (REPO / "hook" / h).read_bytes()
        for h in hooks
    )


def prepare_environment(overlay: bool) -> str:
    """Install into the environment what is unmet; returns where its torch came from."""
    had = version_of("torch")
    if os.environ.get("TORCH_VERSION"):
        torch_pin, torch_from = f"torch=={os.environ['TORCH_VERSION']}", "TORCH_VERSION"
    elif had:
        torch_pin, torch_from = f"torch=={had.split('+')[0]}", "the environment's"
    else:
        torch_pin, torch_from = f"torch=={NO_TORCH_DEFAULT}", "none was installed"
    tf = os.environ.get("TRANSFORMERS_VERSION")
    pins = [torch_pin] + ([f"transformers=={tf}"] if tf and not overlay else [])
    missing = [m for r in [*pins, *pyproject_requirements()] for m in unmet(r)]
    if not missing and attnguard_is_this_checkout():
        say(
            f"environment {sys.prefix}: {', '.join(pins)}, attnguard (this checkout, editable) "
            "and its test extras are installed: nothing to install"
        )
    elif not missing:
        say(f"environment {sys.prefix}: installing attnguard from this checkout (editable)")
        pip("install", "-qq", "--no-deps", "-e", str(REPO))
    else:
        say(
            f"environment {sys.prefix}: installing {' '.join(pins)} and attnguard (editable) "
            f"with its test extras ({len(missing)} unmet, such as {missing[0]})"
        )
        pip("install", "-qq", *pins, "-e", f"{REPO}[test]")
    importlib.invalidate_caches()
    return torch_from


def setup() -> None:
    """Prepare the environment and the test-only packages; print the shell lines that export
    what the tests read."""
    overlay = os.environ.get("TEST_TRANSFORMERS_OVERLAY") == "1"
    torch_from = prepare_environment(overlay)
    tv = version_of("torch") or "?"
    tv_pin = f"torch=={tv.split('+')[0]}"
    cache = Cache(Path(os.environ.get("TEST_DEPS_DIR") or REPO / ".test-deps"))
    env: list[str] = []  # directories that stand for the environment (the transformers overlay)
    exports: dict[str, str] = {}

    pinned = os.environ.get("TRANSFORMERS_VERSION")
    if overlay and pinned and version_of("transformers") != pinned:
        rest = [r for r in pyproject_requirements() if not r.startswith("transformers")]
        got = site_dir(
            cache, f"transformers-{pinned}", [tv_pin, *rest, f"transformers=={pinned}"], []
        )
        if isinstance(got, str):
            raise SystemExit(f"scripts/test.sh: pip cannot install transformers {pinned}: {got}")
        env.append(str(got))
    tf = version_of("transformers", [*env, *sys.path]) or "?"

    xformers_dir, xformers_said = xformers(cache, tv, tv_pin)

    deepspeed = site_dir(cache, "deepspeed-0.19.8", [tv_pin, DEEPSPEED], env, {"DS_BUILD_OPS": "0"})
    if isinstance(deepspeed, str):
        raise SystemExit(f"scripts/test.sh: pip cannot install {DEEPSPEED}: {deepspeed}")
    exports["TEST_DEEPSPEED_DIR"] = str(deepspeed)

    # a real broken flash-attn install: the sdist built without its CUDA extension (~15 s)
    no_cuda = {"FLASH_ATTENTION_SKIP_CUDA_BUILD": "TRUE", "FLASH_ATTENTION_FORCE_BUILD": "TRUE"}
    broken = cache.entry(
        "flash-attn-2.8.3-nocuda",
        "flash-attn 2.8.3 built without CUDA",
        lambda d: target(d, [FLASH_ATTN], no_cuda, "--no-build-isolation"),
    )
    exports["TEST_BROKEN_FLASH_ATTN_DIR"] = str(broken)

    diffusers_dir = ""
    got = site_dir(cache, "diffusers-0.42.1", [tv_pin, f"transformers=={tf}", DIFFUSERS], env)
    if isinstance(got, str):
        exports["TEST_DIFFUSERS_ABSENT"] = (
            f"pip cannot install diffusers 0.42.1 beside transformers {tf} ({got})"
        )
    elif (got / "diffusers").is_dir():  # else the environment has it
        why = cache.memo(
            "imports",
            [str(got), held([*env, *sys.path]), "diffusers"],
            lambda: import_error([str(got), *env], "diffusers.models.attention_dispatch"),
        )
        if why:
            exports["TEST_DIFFUSERS_ABSENT"] = (
                f"diffusers 0.42.1 does not import with torch {tv} ({why})"
            )
        else:
            diffusers_dir = str(got)
    if "TEST_DIFFUSERS_ABSENT" in exports:
        say(f"{exports['TEST_DIFFUSERS_ABSENT']}: the diffusers tests skip")
    else:
        exports["TEST_DIFFUSERS_EXPECTED"] = "1"  # diffusers not importing then fails its tests

    kernels_said = kernels(cache, env, tf, exports)
    if "TEST_DIFFUSERS_ABSENT" not in exports:
        refused = cache.entry(
            "kernels-0.11.7-nodeps",
            "kernels 0.11.7, a release diffusers refuses (metadata only)",
            lambda d: target(d, [KERNELS_REFUSED]),
        )
        exports["TEST_KERNELS_REFUSED_DIR"] = str(refused)

    diffusers_said = "none" if "TEST_DIFFUSERS_ABSENT" in exports else "0.42.1"
    tested = (
        f"torch {tv} ({torch_from}), transformers {tf}, xformers {xformers_said}, "
        f"diffusers {diffusers_said}, kernels {kernels_said}"
    )
    if not os.environ.get("TEST_DEPS_DIR"):  # CI prunes its shared cache itself
        prune(cache.root)
    for name in VARIABLES:
        print(f"export {name}={shlex.quote(exports[name])}" if name in exports else f"unset {name}")
    front = [d for d in (xformers_dir, diffusers_dir, *env) if d]
    print(f"export PYTHONPATH={shlex.quote(on_path(front)['PYTHONPATH'])}")
    print(f"TESTED={shlex.quote(tested)}")


VARIABLES = (
    "TEST_DEEPSPEED_DIR",
    "TEST_BROKEN_FLASH_ATTN_DIR",
    "TEST_DIFFUSERS_ABSENT",
    "TEST_DIFFUSERS_EXPECTED",
    "TEST_KERNELS_DIR",
    "TEST_KERNELS_ABSENT",
    "TEST_KERNELS_REFUSED_DIR",
)


def xformers(cache: Cache, tv: str, tv_pin: str) -> tuple[str, str]:
    """(directory for the test run's path or "", what the tested-with line says)."""
    had = version_of("xformers")
    if had:
        return "", f"{had} (the environment's)"  # on the path already
    wanted = [tv_pin, f"xformers>=0.0.27,<={XFORMERS_NEWEST}"]
    plan = resolve(cache, wanted, [], conflicts_only=False)
    found = (
        [p.split("==")[1] for p in plan if p.startswith("xformers==")]
        if isinstance(plan, list)
        else []
    )
    if not found:
        return "", f"none: no xformers release up to {XFORMERS_NEWEST} installs beside torch {tv}"
    version = found[0]
    where = cache.entry(
        f"xformers-{version}-{PY}",
        f"xformers {version}",
        lambda d: target(d, [f"xformers=={version}"]),
    )
    why = cache.memo(
        "imports",
        [str(where), tv, "xformers.ops"],
        lambda: import_error([str(where)], "xformers.ops"),
    )
    if why:
        return "", f"none: xformers {version} does not import with torch {tv}: {why}"
    return str(where), version


def kernels(cache: Cache, env: list[str], tf: str, exports: dict[str, str]) -> str:
    """The hub's loader for the hub-kernel tests' programs; returns what the tested-with line says."""

    def requirement() -> list[object]:
        res = subprocess.run(
            [sys.executable, str(REPO / "scripts" / "kernels_requirement.py")],
            capture_output=True,
            text=True,
            env={**os.environ, **on_path(env)},
            timeout=600,
        )
        return [res.returncode, res.stdout.strip(), (res.stderr.strip().splitlines() or [""])[-1]]

    here = held([*env, *sys.path])
    rc, want, why = cache.memo("kernels-requirement", [here], requirement)
    if rc != 0:
        exports["TEST_KERNELS_ABSENT"] = why
        return f"none ({why})"
    hub = version_of("huggingface-hub", [*env, *sys.path]) or "?"
    plan: list[str] | str = []
    for req in (want, "kernels"):  # in the window, else the newest (the skew a user meets)
        plan = resolve(cache, [req, f"huggingface-hub=={hub}"], env, conflicts_only=False)
        if isinstance(plan, list):
            break
    found = (
        [p.split("==")[1] for p in plan if p.startswith("kernels==")]
        if isinstance(plan, list)
        else []
    )
    if not found or isinstance(plan, str):
        exports["TEST_KERNELS_ABSENT"] = f"pip cannot install kernels beside huggingface-hub {hub}"
        return f"none ({exports['TEST_KERNELS_ABSENT']})"
    kver = found[0]
    where = cache.entry(
        f"kernels-{kver}-{PY}-{key(PY, sorted(plan))}", f"kernels {kver}", lambda d: target(d, plan)
    )
    # a release may break the import of a transformers that names no upper bound (kernels 0.17
    # raises inside transformers 5.3's import of its hub layers): a user of that pair cannot
    # import transformers at all, so no hub test runs there, and the skips say why
    if "<" not in want:
        err = cache.memo(
            "imports",
            [str(where), here, "transformers.modeling_utils"],
            lambda: import_error([str(where), *env], "transformers.modeling_utils"),
        )
        if err:
            exports["TEST_KERNELS_ABSENT"] = (
                f"kernels {kver} breaks the import of transformers {tf} ({err})"
            )
            say(f"{exports['TEST_KERNELS_ABSENT']}: the hub-kernel tests skip")
            return f"none ({exports['TEST_KERNELS_ABSENT']})"
    exports["TEST_KERNELS_DIR"] = str(where)
    return f"{kver} (hub-kernel tests' programs only)"


# --- CI: cached venvs, overlays, pruning ------------------------------------------------------------


def newest(name: str, env: dict[str, str]) -> str:
    """The newest release pip offers this Python (``pip index versions``: no resolution)."""
    out = pip("index", "versions", name, env=env)
    found = re.match(rf"{re.escape(name)} \(([^)]+)\)", out.strip(), re.I)
    if found is None:
        raise SystemExit(f"scripts/testenv.py: pip names no release of {name}")
    return found.group(1)


def venv(args: argparse.Namespace) -> None:
    """Print the path of a venv with this torch, this transformers, attnguard's requirements, its
    test extras and ``--with`` (``--nodeps``: installed without their requirements), made once per
    key and kept in TEST_CACHE_DIR/venvs; attnguard itself is installed editable from this
    checkout (again where another checkout was installed last)."""
    # this machine's pip caps torch below the newest release: the newest torch lifts that cap
    env = {"PIP_CONSTRAINT": "/dev/null"} if args.torch == "newest" else {}
    torch = newest("torch", env) if args.torch == "newest" else args.torch
    tf = newest("transformers", env) if args.transformers == "newest" else args.transformers
    reqs = [f"torch=={torch}", f"transformers=={tf}", *pyproject_requirements(), *args.with_]
    extra = "".join(f"-{r.split('==')[0]}" for r in [*args.with_, *args.nodeps])
    root = cache_dir() / "venvs"
    root.mkdir(parents=True, exist_ok=True)
    where = root / f"torch{torch}-tf{tf}{extra}-{PY}-{key(PY, sys.version, reqs, args.nodeps)}"
    with open(root / f"{where.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one run builds it; another waits, then reuses it
        python = str(where / "bin" / "python")
        if (where / ".complete").is_file():
            say(f"venv torch {torch}, transformers {tf}: reused {where}")
        else:
            say(f"venv torch {torch}, transformers {tf}: installing into {where}")
            shutil.rmtree(where, ignore_errors=True)
            subprocess.run([sys.executable, "-m", "venv", str(where)], check=True)
            pip("install", "-qq", "--no-compile", *reqs, env=env, python=python)
            if args.nodeps:
                pip(
                    "install",
                    "-qq",
                    "--no-compile",
                    "--no-deps",
                    *args.nodeps,
                    env=env,
                    python=python,
                )
            (where / ".complete").touch()
        here = [python, str(REPO / "scripts" / "testenv.py"), "current"]
        if subprocess.run(here).returncode != 0:
            say(f"venv {where.name}: installing attnguard from this checkout (editable)")
            pip("install", "-qq", "--no-deps", "-e", str(REPO), python=python)
        os.utime(where)
    print(where)


def overlay(args: argparse.Namespace) -> None:
    """Print a directory holding ``reqs`` and what they need beyond this environment (resolved
    with its torch held), for a PYTHONPATH: a release outside attnguard's requirements (the
    version gate) without changing the environment."""
    torch = version_of("torch") or "?"
    cache = Cache(cache_dir() / "deps")
    label = "-".join(r.replace("==", "-") for r in args.reqs)
    got = site_dir(cache, label, [f"torch=={torch.split('+')[0]}", *args.reqs], [])
    if isinstance(got, str):
        raise SystemExit(f"scripts/testenv.py: pip cannot install {' '.join(args.reqs)}: {got}")
    print(got)


def cache_dir() -> Path:
    default = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "attnguard-ci"
    return Path(os.environ.get("TEST_CACHE_DIR") or default)


def prune(root: Path, days: float | None = None) -> None:
    """Remove the entries and memos under ``root`` unused for ``days`` (TEST_CACHE_DAYS, 7), and
    what an interrupted run left half-made."""
    days = float(os.environ.get("TEST_CACHE_DAYS", "7")) if days is None else days
    now = time.time()
    for entry in [*root.iterdir(), *(root / "memo").glob("*")] if root.is_dir() else []:
        if entry.name in ("memo",) or entry.suffix == ".lock":
            continue
        age = now - entry.stat().st_mtime
        half_made = ".tmp" in entry.name and age > DAY
        if age > days * DAY or half_made:
            say(f"cache: removing {entry} (unused for {age / DAY:.0f} days)")
            shutil.rmtree(entry) if entry.is_dir() else entry.unlink()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("setup", help="prepare this environment; print the variables (scripts/test.sh)")
    sub.add_parser("current", help="exit 0 where attnguard is this checkout, installed editable")
    v = sub.add_parser("venv", help="print a cached venv's path (.ci/run)")
    v.add_argument("--torch", required=True)
    v.add_argument("--transformers", required=True)
    v.add_argument("--with", dest="with_", action="append", default=[])
    v.add_argument("--nodeps", action="append", default=[])
    o = sub.add_parser("overlay", help="print a cached site directory's path (.ci/run)")
    o.add_argument("reqs", nargs="+")
    sub.add_parser("prune", help="remove cache entries unused for TEST_CACHE_DAYS")
    args = parser.parse_args()
    global SAYS
    SAYS = "scripts/test.sh" if args.command == "setup" else "scripts/testenv.py"
    if args.command == "setup":
        setup()
    elif args.command == "current":
        sys.exit(0 if attnguard_is_this_checkout() else 1)
    elif args.command == "venv":
        venv(args)
    elif args.command == "overlay":
        overlay(args)
    else:
        for root in (cache_dir() / "venvs", cache_dir() / "deps"):
            prune(root)


if __name__ == "__main__":
    main()
