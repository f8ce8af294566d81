"""The package a team adopts: what its sdist holds, what pyproject declares, and the fixed words of
README.md that come from somewhere else (the supported matrix of attnguard/support.py, the
windows the integrations declare (attnguard.integrations.REGISTRY), the pins of scripts/test.sh and .ci/run, the public API,
the settings, the event schema). Each test reads the files as a user would and fails when one of
them says something the others do not."""

from __future__ import annotations

import fnmatch
import re
import subprocess
import tarfile
from pathlib import Path

import pytest
from helpers.events import FIXED
from helpers.processes import PY, REPO, subprocess_env

import attnguard
from attnguard import config, support
from attnguard.integrations import by_name
from attnguard.observability import events

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

README = (REPO / "README.md").read_text()
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
TEST_SH = (REPO / "scripts" / "test.sh").read_text()
TESTENV = (REPO / "scripts" / "testenv.py").read_text()  # what the test command installs
CI_RUN = (REPO / ".ci" / "run").read_text()


def readme_section(heading: str) -> str:
    return README.split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]


# --- the sdist ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sdist(tmp_path_factory: pytest.TempPathFactory) -> tarfile.TarFile:
    """The sdist, built from this checkout by the build backend a frontend (pip, build) calls."""
    pytest.importorskip("hatchling", reason="the test extras install hatchling")
    out = tmp_path_factory.mktemp("sdist")
    build = "import sys, hatchling.build as b; print(b.build_sdist(sys.argv[1]))"
    res = subprocess.run(
        [PY, "-c", build, str(out)],
        cwd=REPO,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return tarfile.open(out / res.stdout.strip().splitlines()[-1])


def members(sdist: tarfile.TarFile) -> set[str]:
    """Paths inside the sdist, relative to its top directory."""
    return {name.split("/", 1)[1] for name in sdist.getnames() if "/" in name}


# repository paths as the docs write them: `examples/quickstart.py`, bash scripts/test.sh,
# .ci/run, tests/gpu/, examples/*.py (not /var/log/..., not attnguard-{rank}.jsonl)
PATH_IN_TEXT = re.compile(
    r"(?<![\w/.{-])((?:\.ci|attnguard|bench|docs|examples|hook|scripts|tests)/[\w./*-]*[\w*/])"
)
TOP_FILES = re.compile(r"`(LICENSE|SECURITY\.md|CHANGELOG\.md|README\.md|pyproject\.toml)`")
LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")


def referenced(doc: Path) -> set[str]:
    """Every repository path a document links to, names, or tells you to run."""
    text = doc.read_text()
    found = set(PATH_IN_TEXT.findall(text)) | set(TOP_FILES.findall(text))
    for link in LINK.findall(text):
        if not re.match(r"[a-z]+:", link):
            found.add((doc.parent / link).resolve().relative_to(REPO).as_posix())
    return {p.rstrip("/") for p in found}


def in_sdist(path: str, inside: set[str]) -> bool:
    if any(ch in path for ch in "*?["):
        return any(fnmatch.fnmatch(m, path) for m in inside)
    return path in inside or any(m.startswith(path + "/") for m in inside)


def test_the_sdist_holds_everything_the_readme_and_docs_point_to(sdist: tarfile.TarFile) -> None:
    """Starting from the sdist, every link of README.md and of the docs it leads to, every file
    they name and every command they tell you to run (scripts/test.sh, examples/...) works."""
    inside = members(sdist)
    docs = [REPO / "README.md"]
    seen: set[str] = set()
    missing = []
    while docs:
        doc = docs.pop()
        for path in sorted(referenced(doc) - seen):
            seen.add(path)
            if not in_sdist(path, inside):
                missing.append(f"{doc.relative_to(REPO)} -> {path}")
            elif path.endswith(".md") and path != "CHANGELOG.md" and (REPO / path).is_file():
                docs.append(REPO / path)  # the changelog is history: it names files long gone
    assert missing == []
    # the walk reached what a newcomer needs
    for needed in ("scripts/test.sh", "docs/observability.md", "LICENSE", "SECURITY.md"):
        assert needed in seen and needed in inside, needed


def test_the_sdist_says_who_and_under_which_license(sdist: tarfile.TarFile) -> None:
    (info,) = [n for n in sdist.getnames() if n.count("/") == 1 and n.endswith("/PKG-INFO")]
    meta = sdist.extractfile(info).read().decode()
    assert "License-Expression: Apache-2.0" in meta and "License-File: LICENSE" in meta
    assert "Author: attnguard developers" in meta
    assert "Project-URL" not in meta and "Home-page" not in meta  # none exists: none invented
    license_text = (REPO / "LICENSE").read_text()
    assert "Apache License" in license_text and "Version 2.0, January 2004" in license_text
    assert "END OF TERMS AND CONDITIONS" in license_text  # the full text, not a stub


# --- pyproject and attnguard.support ---------------------------------------------------------------


def requirement(spec: str) -> tuple[str, str]:
    """("flash-attn", ">=2.6,<3") from "flash-attn>=2.6,<3"."""
    name, rest = re.match(r"([A-Za-z0-9_.-]+)(.*)", spec).groups()
    return name, rest.replace(" ", "")


def test_extras_install_only_versions_the_guard_patches() -> None:
    """An extra derived from the integration's declared window: pip cannot install a flash-attn or
    xformers that the integration then declines to patch."""
    extras = PYPROJECT["project"]["optional-dependencies"]
    for extra, integration in (
        ("flash", "flash_attn"),
        ("xformers", "xformers"),
        ("diffusers", "diffusers"),
    ):
        declared = by_name(integration)
        want = (declared.distribution, declared.window())
        assert [requirement(r) for r in extras[extra]] == [want], extra


def test_pyproject_declares_the_supported_matrix() -> None:
    project = PYPROJECT["project"]
    python = support.COMPONENTS["python"]
    assert project["requires-python"] == python.supported
    declared = sorted(
        c.rsplit(" :: ", 1)[1]
        for c in project["classifiers"]
        if re.fullmatch(r"Programming Language :: Python :: 3\.\d+", c)
    )
    assert declared == sorted(python.tested)  # the Python versions a test run used
    # and no floor below them: a Python no test ran on is not declared supported
    oldest = min(python.tested, key=lambda v: tuple(map(int, v.split("."))))
    assert project["requires-python"] == f">={oldest}"
    deps = dict(requirement(r) for r in project["dependencies"])
    assert deps["torch"] == support.COMPONENTS["torch"].supported
    # transformers' floor is the integration's (no ceiling: a newer release is only not patched)
    assert deps["transformers"] == support.COMPONENTS["transformers"].supported.split(",")[0]


def shell_array(text: str, name: str) -> list[str]:
    body = re.search(rf"^{name}=\((.*?)\)", text, re.S | re.M).group(1)
    return body.split()


def constant(name: str) -> str:
    """A constant of scripts/testenv.py: ``NAME = "value"``."""
    return re.search(rf'^{name} = "([^"]+)"', TESTENV, re.M).group(1)


def test_ci_and_the_test_command_run_the_versions_the_matrix_lists() -> None:
    assert tuple(shell_array(CI_RUN, "full")) == support.TRANSFORMERS_FULL
    assert tuple(shell_array(CI_RUN, "smoke")) == support.TRANSFORMERS_SMOKE
    assert re.search(r"^below=(\S+)", CI_RUN, re.M).group(1) == support.TRANSFORMERS_BELOW
    # every release listed is a lane: a full lane on the newest release, unpinned (the test
    # command without TRANSFORMERS_VERSION, the whole zoo), and on each pinned full release
    assert 'lanes+=("full:newest:$p")' in CI_RUN
    assert 'for v in "${full[@]}"; do for p in' in CI_RUN
    assert 'for v in "${smoke[@]}"; do lanes+=("smoke:$v"); done' in CI_RUN
    assert 'test_sh "$venv" TEST_ZOO=all --' in CI_RUN
    assert "--transformers newest" in CI_RUN
    # the test command keeps the environment's torch; 2.13.0 only where there is none
    assert constant("NO_TORCH_DEFAULT") == support.TORCH_CI
    assert re.search(r"^torch_ci=(\S+)", CI_RUN, re.M).group(1) == support.TORCH_CI
    assert 'pip("install", "-qq", *pins, "-e", f"{REPO}[test]")' in TESTENV
    assert constant("XFORMERS_NEWEST") == support.COMPONENTS["xformers"].tested[0]
    pins = dict(re.findall(r'"([a-z-]+)==([\d.]+)"', TESTENV))
    assert "torch" not in pins
    assert pins["flash-attn"] in support.COMPONENTS["flash-attn"].tested
    assert pins["diffusers"] == support.DIFFUSERS_CI
    assert pins["deepspeed"] == support.DEEPSPEED
    # the torch lanes: the newest torch (unpinned), then the pinned (torch, transformers) pairs
    lanes = [lane.split("=") for lane in shell_array(CI_RUN, "torch_lanes")]
    assert lanes[0] == ["newest", "newest"]
    assert tuple((t, tf) for t, tf in lanes[1:]) == support.TORCH_LANES
    assert 'for t in "${torch_lanes[@]}"; do lanes+=("torch:$t"); done' in CI_RUN
    # this machine's pip caps torch: the newest torch's venv and its test run lift the cap
    assert '{"PIP_CONSTRAINT": "/dev/null"} if args.torch == "newest"' in TESTENV
    assert 'test_sh "$venv" PIP_CONSTRAINT=/dev/null --' in CI_RUN
    ray = re.search(r'"ray==([\d.]+)"', CI_RUN).group(1)
    also = readme_section("Compatibility")
    assert re.search(rf"DeepSpeed\s+{re.escape(support.DEEPSPEED)} ", also)
    assert re.search(rf"Ray\s+{re.escape(ray)} ", also)


def versions_in(cell: str) -> list[str]:
    return re.findall(r"\d+\.\d+(?:\.\d+)?(?:\.post\d+)?", cell)


def test_the_readme_compatibility_table_is_the_matrix() -> None:
    rows = {}
    for line in readme_section("Compatibility").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        if line.startswith("| ") and cells[0] in support.COMPONENTS:
            rows[cells[0]] = cells
    assert set(rows) == set(support.COMPONENTS)
    for name, component in support.COMPONENTS.items():
        _, supported, tested, _ = rows[name]
        assert supported == component.supported, name
        assert versions_in(tested) == list(component.tested), name
    # the windows named in prose are the integrations' windows too
    for integration in ("transformers", "flash_attn", "xformers", "diffusers"):
        assert support.window(integration) in readme_section("Compatibility")


def test_the_readme_install_and_test_commands_agree_with_the_test_command() -> None:
    pinned = set(re.findall(r'"torch==([\d.]+)"', readme_section("Install")))
    assert pinned == {support.TORCH_CI}
    assert "--index-url https://download.pytorch.org/whl/cpu" in readme_section("Install")
    extras = PYPROJECT["project"]["optional-dependencies"]
    for extra in ("flash", "xformers", "diffusers"):
        dist, spec = requirement(extras[extra][0])
        assert f"`{extra}` ({dist} {spec})" in readme_section("Install")
    tests = readme_section("Run the tests")
    listed = re.search(r"`test`\s+extras \(([^)]*)\)", tests).group(1)
    names = [requirement(r)[0] for r in extras["test"]]
    assert [n.strip() for n in listed.split(",")] == names
    # what goes into .test-deps/, with the versions the test command installs there
    for label, version in (
        ("xformers", constant("XFORMERS_NEWEST")),
        ("DeepSpeed", constant("DEEPSPEED").split("==")[1]),
        ("flash-attn", constant("FLASH_ATTN").split("==")[1]),
        ("diffusers", constant("DIFFUSERS").split("==")[1]),
    ):
        assert f"{label} {version}" in tests
    assert '"--target", str(where)' in TESTENV  # with pip's --target, not into the environment
    for older in support.XFORMERS_FOR_OLDER_TORCH:  # what an older torch gets instead
        assert older in tests
    # xformers and diffusers on the test run's path, not in the environment
    assert "front = [d for d in (xformers_dir, diffusers_dir, *env) if d]" in TESTENV


# --- the version policy's fixed words ---------------------------------------------------------------


def test_the_version_policy_names_what_the_code_has() -> None:
    policy = readme_section("Versions and stability")
    assert int(re.search(r"\(now (\d+)\)", policy).group(1)) == events.SCHEMA
    api = re.search(r"\*\*the Python API\*\* \(([^)]*)\)", policy).group(1)
    assert sorted(re.findall(r"`(\w+)`", api)) == sorted(attnguard.__all__)
    commands = re.search(r"\*\*the command line\*\* \(([^)]*)\)", policy).group(1)
    said = set(re.findall(r"`(?:attnguard )?(\w+)`", commands))
    res = subprocess.run(
        [PY, "-m", "attnguard", "--help"],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    offered = set(re.search(r"\{([\w,]+)\}", res.stdout).group(1).split(","))
    assert said == offered
    # the project's own version is one number everywhere
    assert PYPROJECT["project"]["version"] == attnguard.__version__
    assert "## [Unreleased]" in (REPO / "CHANGELOG.md").read_text()


def test_the_readme_lists_every_fixed_field_and_every_setting() -> None:
    fixed = re.search(r"Every event carries `([^`]*)`", readme_section("Events")).group(1)
    assert [f.strip() for f in fixed.split(",")] == FIXED
    table = readme_section("Configuration")
    rows = re.findall(r"^\| `(ATTNGUARD\w*)` \|", table, re.M)
    assert sorted(rows) == sorted(config._ENV)
