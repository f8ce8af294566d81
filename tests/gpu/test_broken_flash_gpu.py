"""transformers 4.49, 4.53 and 4.54 next to a broken flash-attn, on a GPU (the GPU half
of tests/test_broken_flash.py).

Those releases import flash-attn at module import wherever their metadata-only availability
check says yes, so with a flash-attn whose import raises every model import fails, sdpa too.
Guarded, transformers is told the truth and runs as if flash-attn were not installed; a flash
request runs transformers' flash code path on attnguard's SDPA twins.

Inputs (each test skips with the reason when one is missing):

* ``$TEST_REAL_FLASH_ATTN_DIR``: the real flash-attn 2.8.3 (scripts/gpu_suite.sh unpacks
  its wheel there; tests/gpu/gpuenv.py). It is the reference, and the broken build is made
  from it: the same package and metadata, its ``flash_attn_2_cuda*.so`` replaced by a shared
  object with an undefined symbol (built with the machine's C compiler; without one, a file that
  is not an ELF object), so ``import flash_attn`` raises an ImportError as a build for another
  torch does.
* the wheels of ``scripts/fetch_gpu_wheels.sh``: ``.whl-tf/gpu-wheels.tar.xz`` (carry
  ``.whl-tf``), or ``$TEST_TF_WHEELS_DIR`` holding the wheels. Each release is installed with
  ``pip install --no-index --no-deps --target`` together with the tokenizers, huggingface_hub,
  requests and structlog wheels it needs beside the image's packages.

Per release, tests/workers/broken_flash_worker.py builds seeded Llama, Qwen2 and Gemma 2
checkpoints with that release, then four programs run (each its own process, that release first
on its path, bf16, ``device_map="cuda:0"``): ``real`` (the real kernel, unguarded, flash only),
``broken`` unguarded and guarded (sdpa, eager, flash), ``absent`` unguarded (sdpa, eager).
Everything measured goes to $GPU_RESULTS/broken_flash/ when set.

Run alone (device tool, carry [".gpu-deps", ".whl-tf"]; structlog, which attnguard needs and the
image lacks, comes from the same archive):
    mkdir -p /tmp/flashsite /tmp/whl-tf && tar xJf .gpu-deps/flash_attn-*.tar.xz -C /tmp/flashsite
    && tar xJf .whl-tf/gpu-wheels.tar.xz -C /tmp/whl-tf && python3 -m pip install -q --no-index
    --no-deps --target /tmp/site /tmp/whl-tf/structlog-*.whl && PYTHONPATH=/tmp/site
    TEST_REAL_FLASH_ATTN_DIR=/tmp/flashsite TEST_TF_WHEELS_DIR=/tmp/whl-tf
    python3 -m pytest tests/gpu/test_broken_flash_gpu.py -v -rA -p no:cacheprovider
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sysconfig
import tarfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import gpuenv
import pytest
import torch

RELEASES = ("4.49.0", "4.53.3", "4.54.1")
FAMILIES = "llama,qwen2,gemma2"
FLASH = "flash_attention_2"
WORKER = gpuenv.WORKERS / "broken_flash_worker.py"
ARCHIVE = gpuenv.REPO / ".whl-tf" / "gpu-wheels.tar.xz"
WHEELS_ENV = "TEST_TF_WHEELS_DIR"
AVAILABILITY = "transformers.availability.flash_attn"
REL = 2e-2  # of max |kernel logit| at the compared tokens (bf16; tests/gpu/test_semantics_gpu.py)
MISSING_SYMBOL = "attnguard_test_symbol_missing_from_this_torch"
RUN_ON = ["--device", "cuda:0", "--dtype", "bfloat16"]  # the worker's placement and load dtype

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


# --- setup (pure file work and pip: runs on CPU too, see the tests at the end) -----------------


def wheels(into: Path) -> Path | str:
    """The directory holding the wheels (unpacking the archive into ``into``), or why not."""
    given = os.environ.get(WHEELS_ENV, "").strip()
    if given:
        found = Path(given)
        if not any(found.glob("transformers-*.whl")):
            return f"{WHEELS_ENV}={found} holds no transformers wheel"
        return found
    if not ARCHIVE.is_file():
        return (
            f"{ARCHIVE} is missing: run scripts/fetch_gpu_wheels.sh "
            f"where there is internet and carry .whl-tf (or set {WHEELS_ENV})"
        )
    into.mkdir(parents=True, exist_ok=True)
    with tarfile.open(ARCHIVE) as tar:
        tar.extractall(into, filter="data")
    return into


def install(release: str, wheel_dir: Path, target: Path, *pip_args: str) -> str | None:
    """transformers ``release`` and every other (non-transformers) wheel of ``wheel_dir``
    installed into ``target``; None, or why not."""
    mine = sorted(wheel_dir.glob(f"transformers-{release}-*.whl"))
    if not mine:
        return f"no transformers {release} wheel in {wheel_dir}"
    others = [w for w in sorted(wheel_dir.glob("*.whl")) if not w.name.startswith("transformers-")]
    cmd = [gpuenv.PY, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile"]
    cmd += ["--target", str(target), *pip_args, *map(str, mine + others)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if res.returncode != 0:
        return f"pip install of transformers {release} failed: {res.stderr.strip()[-500:]}"
    return None


def break_flash(real: Path, broken: Path) -> str:
    """A copy of the flash-attn install at ``real`` whose CUDA extension no longer loads;
    returns how it was broken."""
    extensions = sorted(real.glob("flash_attn_2_cuda*.so"))
    if not extensions or not (real / "flash_attn").is_dir():
        raise FileNotFoundError(f"{real} holds no flash_attn/ and flash_attn_2_cuda*.so")
    shutil.copytree(real, broken, ignore=shutil.ignore_patterns("flash_attn_2_cuda*.so"))
    target = broken / extensions[0].name
    source = broken / "undefined_symbol.c"
    source.write_text(
        f"extern void {MISSING_SYMBOL}(void);\n"
        f"void PyInit_flash_attn_2_cuda(void) {{ {MISSING_SYMBOL}(); }}\n"
    )
    compiler = shutil.which("cc") or shutil.which("gcc")
    built = compiler is not None and (
        subprocess.run(
            [compiler, "-shared", "-fPIC", "-o", str(target), str(source)], capture_output=True
        ).returncode
        == 0
    )
    source.unlink()
    if built:
        return f"undefined symbol: {MISSING_SYMBOL}"
    target.write_bytes(b"not a shared object: flash_attn_2_cuda of another build\n")
    return "not an ELF object"


def child_env(tf: Path, flash: Path | None, **extra: str) -> dict[str, str]:
    """This release first on the path, then ``flash`` (the real or the broken build) or no
    flash-attn at all, then this checkout."""
    env = gpuenv.child_env(real=False, ATTNGUARD_LOG="none", TQDM_DISABLE="1", **extra)
    front = [str(tf)] + ([str(flash)] if flash is not None else [])
    env["PYTHONPATH"] = os.pathsep.join([*front, env["PYTHONPATH"]])
    return env


def _worker(args: list[str], env: dict[str, str]) -> None:
    res = subprocess.run(
        [gpuenv.PY, str(WORKER), *args], env=env, capture_output=True, text=True, timeout=600
    )
    assert res.returncode == 0, f"broken_flash_worker {args[0]}:\n{res.stderr[-4000:]}"


# --- the runs --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    real = gpuenv.require()
    tmp = tmp_path_factory.mktemp("broken_flash")
    found = wheels(tmp / "wheels")
    if isinstance(found, str):
        pytest.skip(found)
    how = break_flash(real, tmp / "broken-flash")
    return {"tmp": tmp, "wheels": found, "real": real, "broken": tmp / "broken-flash", "how": how}


@pytest.fixture(scope="module", params=RELEASES)
def runs(
    request: pytest.FixtureRequest,
    prepared: dict[str, Any],
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, Any]:
    release = request.param
    tmp = prepared["tmp"] / release
    tf = tmp / "site"
    why = install(release, prepared["wheels"], tf)
    if why is not None:
        pytest.fail(why)
    ckpt = tmp / "ckpt"
    _worker(["make", str(ckpt)], child_env(tf, None))
    gpu = [*RUN_ON, "--families", FAMILIES]
    programs = {  # name -> (flash-attn on the path, guarded, impls)
        "real": (prepared["real"], False, FLASH),
        "broken": (prepared["broken"], False, f"sdpa,eager,{FLASH}"),
        "guarded": (prepared["broken"], True, f"sdpa,eager,{FLASH}"),
        "absent": (None, False, "sdpa,eager"),
    }

    def one(name: str) -> dict[str, Any]:
        flash, guarded, impls = programs[name]
        out = tmp / f"{name}.pt"
        args = ["run", str(ckpt), str(out), *gpu, "--impls", impls] + ["--guarded"] * guarded
        _worker(args, child_env(tf, flash))
        return torch.load(out, weights_only=False)

    with ThreadPoolExecutor(max_workers=len(programs)) as pool:
        done = dict(zip(programs, pool.map(one, programs), strict=True))
    results = gpuenv.results_dir(tmp_path_factory, "broken_flash")
    summary: dict[str, Any] = {
        name: {
            "meta": run["meta"],
            "loads": {  # outcomes and events; the tensors stay out
                f: {
                    i: {k: v for k, v in r.items() if not torch.is_tensor(v)} for i, r in by.items()
                }
                for f, by in run["loads"].items()
            },
        }
        for name, run in done.items()
    }
    summary["broken_by"] = prepared["how"]
    summary["compared"] = {f: flash_gaps(done, f) for f in FAMILIES.split(",")}
    (results / f"{release}.json").write_text(json.dumps(summary, indent=1, default=str))
    return {"release": release, **done, "how": prepared["how"]}


def gap(twin: torch.Tensor, real: torch.Tensor, keep: torch.Tensor | None = None) -> dict:
    if keep is not None:
        twin, real = twin[keep.bool()], real[keep.bool()]
    err = (twin - real).abs().max().item()
    bound = REL * real.abs().max().item()
    return {"err": err, "bound": bound, "ok": bool(err <= bound)}


def flash_gaps(done: dict[str, Any], family: str) -> dict[str, Any]:
    guarded = done["guarded"]["loads"][family][FLASH]
    real = done["real"]["loads"][family][FLASH]
    if "error" in guarded or "error" in real:
        return {"error": guarded.get("error") or real.get("error")}
    return {
        # real flash zeroes padded positions where SDPA does not: real tokens only
        "padded": gap(guarded["logits_padded"], real["logits_padded"], real["padded_mask"]),
        "packed": gap(guarded["logits_packed"], real["logits_packed"]),
    }


# --- on the GPU ------------------------------------------------------------------------------------


@pytest.mark.gpu
@needs_gpu
def test_the_reference_is_the_real_kernel_and_the_broken_build_really_fails(runs: dict) -> None:
    assert runs["real"]["meta"]["transformers"] == runs["release"]
    for family, by_impl in runs["real"]["loads"].items():
        assert by_impl[FLASH].get("error") is None, (family, by_impl[FLASH].get("error"))
        assert by_impl[FLASH]["attn_implementation"] == FLASH
    assert "flash_attn_2_cuda" in runs["real"]["meta"]["flash_modules"]  # the real extension
    own = runs["guarded"]["meta"]["own_import"]
    assert own.startswith("ImportError") and runs["broken"]["meta"]["own_import"] == own


@pytest.mark.gpu
@needs_gpu
def test_unguarded_every_model_import_fails_as_today(runs: dict) -> None:
    for family, by_impl in runs["broken"]["loads"].items():
        for impl, rec in by_impl.items():
            assert "error" in rec, f"{family}/{impl} loaded unguarded next to the broken build"
    for family, by_impl in runs["absent"]["loads"].items():  # it is the broken build's doing
        for impl, rec in by_impl.items():
            assert "error" not in rec, (family, impl, rec.get("error"))


@pytest.mark.gpu
@needs_gpu
def test_guarded_sdpa_and_eager_run_as_without_flash_attn(runs: dict) -> None:
    for family, by_impl in runs["absent"]["loads"].items():
        for impl, want in by_impl.items():
            got = runs["guarded"]["loads"][family][impl]
            assert "error" not in got, (family, impl, got.get("error"))
            assert got["attn_implementation"] == want["attn_implementation"] == impl
            assert (got["param_dtype"], got["param_device"]) == ("torch.bfloat16", "cuda:0")
            for name in ("logits_padded", "logits_packed"):
                diff = (got[name] - want[name]).abs().max().item()
                assert got[name].equal(want[name]), f"{family}/{impl} {name}: max diff {diff}"
            assert [e for e in got["events"] if e["site"] != AVAILABILITY] == []


@pytest.mark.gpu
@needs_gpu
def test_guarded_flash_equals_the_real_kernel(runs: dict) -> None:
    for family in FAMILIES.split(","):
        got = runs["guarded"]["loads"][family][FLASH]
        assert "error" not in got, (family, got.get("error"))
        assert got["attn_implementation"] == FLASH
        assert (got["param_dtype"], got["param_device"]) == ("torch.bfloat16", "cuda:0")
        (fallback,) = [e for e in got["events"] if e["event"] == "backend_fallback"]
        assert (fallback["rule"], fallback["reason_code"]) == ("flash-on-sdpa", "extension_broken")
        gaps = flash_gaps(runs, family)
        assert "error" not in gaps and all(g["ok"] for g in gaps.values()), (family, gaps)


@pytest.mark.gpu
@needs_gpu
def test_one_event_names_the_broken_package(runs: dict) -> None:
    found = [e for e in runs["guarded"]["meta"]["events"] if e["site"] == AVAILABILITY]
    (event,) = found
    assert (event["event"], event["reason_code"], event["package"]) == (
        "observed",
        "extension_broken",
        "flash_attn",
    )
    expected = MISSING_SYMBOL if runs["how"].startswith("undefined") else "ImportError"
    assert expected in event["error"], event


# --- the setup itself, on any machine ------------------------------------------------------------


def test_missing_inputs_skip_with_the_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(WHEELS_ENV, raising=False)
    monkeypatch.setattr("test_broken_flash_gpu.ARCHIVE", tmp_path / ".whl-tf" / "gpu-wheels.tar.xz")
    why = wheels(tmp_path / "unpacked")
    assert isinstance(why, str) and "scripts/fetch_gpu_wheels.sh" in why
    monkeypatch.setenv(WHEELS_ENV, str(tmp_path))
    why = wheels(tmp_path / "unpacked")
    assert isinstance(why, str) and WHEELS_ENV in why


def test_the_broken_build_fails_to_import_like_a_build_for_another_torch(tmp_path: Path) -> None:
    """A stand-in for the real install (package, metadata, extension): the broken copy keeps the
    package and its metadata and its import raises ImportError from the extension."""
    real = tmp_path / "real"
    (real / "flash_attn").mkdir(parents=True)
    (real / "flash_attn" / "__init__.py").write_text("import flash_attn_2_cuda\n")
    dist = real / "flash_attn-2.8.3.post2.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: flash_attn\nVersion: 2.8.3.post2\n"
    )
    (real / "flash_attn_2_cuda.cpython-312-x86_64-linux-gnu.so").write_bytes(b"\0" * 16)
    how = break_flash(real, tmp_path / "broken")
    probe = (
        "import importlib.metadata as m\n"
        "print(m.version('flash_attn'))\n"
        "try:\n    import flash_attn\nexcept ImportError as exc:\n    print('ImportError', exc)\n"
    )
    # named for Python 3.12 (the GPU image): give this interpreter the same file under its name
    so = next((tmp_path / "broken").glob("flash_attn_2_cuda*.so"))
    shutil.copyfile(so, so.with_name("flash_attn_2_cuda" + sysconfig.get_config_var("EXT_SUFFIX")))
    res = subprocess.run(
        [gpuenv.PY, "-c", probe],
        env={**os.environ, "PYTHONPATH": str(tmp_path / "broken")},
        capture_output=True,
        text=True,
    )
    version, error = res.stdout.splitlines()
    assert version == "2.8.3.post2"
    assert error.startswith("ImportError")
    if how.startswith("undefined symbol"):
        assert MISSING_SYMBOL in error
    assert not (tmp_path / "broken" / "undefined_symbol.c").exists()


def test_each_release_installs_from_the_wheels(tmp_path: Path) -> None:
    """What the GPU run installs, installed here (the binary wheels are for Python 3.12, so pip
    is told that interpreter) and transformers imported from it."""
    found = wheels(tmp_path / "wheels")
    if isinstance(found, str):
        pytest.skip(found)
    for release in RELEASES:
        target = tmp_path / release
        why = install(
            release,
            found,
            target,
            *("--python-version", "3.12", "--implementation", "cp", "--only-binary=:all:"),
            *("--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_17_x86_64"),
        )
        assert why is None, why
        code = "import transformers, tokenizers, huggingface_hub, structlog; print(transformers.__version__)"
        res = subprocess.run(
            [gpuenv.PY, "-c", code],
            env={**os.environ, "PYTHONPATH": str(target)},
            capture_output=True,
            text=True,
        )
        assert res.stdout.strip() == release, res.stderr[-2000:]
