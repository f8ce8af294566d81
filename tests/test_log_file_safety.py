"""Safe on a shared machine, the log file: attnguard never follows another user's link, appends
to another user's file or follows a directory link on the log path, while your own links and
/dev/stderr still work; values checked before anything runs (a log path it could not open, a huge
value, a format that makes a null byte, a deep path); summaries of files without events;
rendezvous files private; a FIFO log left to its reader. Cross-user cases need root (as
tests/test_file_safety.py)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from helpers.files import (
    SECRET_NOTES,
    as_user,
    attnguard_run,
    private_run_dir,
    records,
    went_around,
)
from helpers.processes import PY, subprocess_env

import attnguard

# --- item 2: the log file ------------------------------------------------------------------------

ACTIVATE = "import attnguard; print('ran', attnguard.settings().enabled)"


def _run_guarded(log: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PY, "-c", ACTIVATE],
        env=subprocess_env(ATTNGUARD="1", ATTNGUARD_LOG=log, ATTNGUARD_LOG_FORMAT="json", **env),
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_another_users_link_in_a_shared_directory_is_not_followed(
    other_user: tuple[int, int], shared_dir: Path, tmp_path: Path
) -> None:
    """The planted link is never followed, nor does it turn
    the guard off any more; the events go to a fresh file beside it, named, that nobody could
    have planted (its name is random and it is created O_EXCL)."""
    notes = tmp_path / "notes.txt"
    notes.write_text(SECRET_NOTES)
    planted = shared_dir / "ag-0.jsonl"
    as_user(other_user, lambda: os.symlink(str(notes), str(planted)))
    res = _run_guarded(str(shared_dir / "ag-{rank}.jsonl"))
    assert notes.read_text() == SECRET_NOTES
    assert f"is a symbolic link that belongs to another user (uid {other_user[0]})" in res.stderr
    went_around(res, planted, shared_dir)
    # `attnguard run` starts the command (which goes around the link the same way) and leaves
    # no file of its own check behind
    before = set(shared_dir.iterdir())
    res = attnguard_run(tmp_path, ATTNGUARD_LOG=str(planted))
    assert res.returncode == 0 and (tmp_path / "command-ran").exists(), res.stderr
    assert len(set(shared_dir.iterdir()) - before) == 1  # the command's own file
    assert notes.read_text() == SECRET_NOTES


def test_another_users_file_is_not_appended_to(
    other_user: tuple[int, int], shared_dir: Path
) -> None:
    planted = shared_dir / "ag-0.jsonl"
    as_user(other_user, lambda: (planted.write_text(""), planted.chmod(0o666)))
    res = _run_guarded(str(shared_dir / "ag-{rank}.jsonl"))
    assert planted.read_text() == ""  # nothing of the victim's run went to the other user
    assert f"belongs to another user (uid {other_user[0]})" in res.stderr
    went_around(res, planted, shared_dir)


def test_another_users_directory_link_on_the_log_path_is_not_followed(
    other_user: tuple[int, int], shared_dir: Path, tmp_path: Path
) -> None:
    """/tmp/agshared -> the victim's project, planted by another user. Only
    the last component's links were checked, so the victim's own ag-0.jsonl there grew. Every
    link on the way is checked now; the events go to a fresh file in the victim's private
    directory (the link's directory is the other user's to point anywhere)."""
    project = tmp_path / "proj"
    project.mkdir()
    (project / "ag-0.jsonl").write_text(SECRET_NOTES)
    link = shared_dir / "agshared"
    as_user(other_user, lambda: os.symlink(str(project), str(link)))
    run = private_run_dir(tmp_path)
    res = _run_guarded(str(link / "ag-{rank}.jsonl"), XDG_RUNTIME_DIR=str(run))
    assert (project / "ag-0.jsonl").read_text() == SECRET_NOTES
    assert os.listdir(project) == ["ag-0.jsonl"]  # nothing created in the victim's project
    assert f"{link} is a symbolic link that belongs to another user (uid {other_user[0]})" in (
        res.stderr
    )
    went_around(res, link / "ag-0.jsonl", run / "attnguard")


def test_your_own_links_and_dev_stderr_still_work(tmp_path: Path) -> None:
    target = tmp_path / "real.jsonl"
    (tmp_path / "link.jsonl").symlink_to(target)
    res = _run_guarded(str(tmp_path / "link.jsonl"))
    assert res.stdout == "ran True\n", res.stderr
    assert [r["event"] for r in records(target)] == ["activated", "summary"]
    res = _run_guarded("/dev/stderr")
    assert res.stdout == "ran True\n"
    assert json.loads(res.stderr.splitlines()[0])["event"] == "activated"


# --- values checked before anything runs ----------------------------------------------------------


def test_run_starts_the_command_guarded_with_a_log_path_it_could_not_open(tmp_path: Path) -> None:
    """/sys: the directory looks writable to root, yet no file can be created there. The
    command runs, guarded, its events on stderr, and its guard says the path once."""
    if not os.path.isdir("/sys/kernel"):
        pytest.skip("no /sys here")
    res = attnguard_run(tmp_path, ATTNGUARD_LOG="/sys/kernel/ag-{rank}.jsonl")
    assert res.returncode == 0 and (tmp_path / "command-ran").exists(), res.stderr
    assert res.stderr.startswith("attnguard: invalid ATTNGUARD_LOG='/sys/kernel/ag-{rank}.jsonl'")
    assert res.stderr.count("invalid ATTNGUARD_LOG") == 1
    # and a good path starts the command, leaving no file of its own behind
    res = attnguard_run(tmp_path, ATTNGUARD_LOG=str(tmp_path / "ev-{pid}.jsonl"))
    assert res.returncode == 0 and (tmp_path / "command-ran").exists(), res.stderr


def test_a_huge_value_is_named_and_cut_not_echoed(tmp_path: Path) -> None:
    huge = str(tmp_path / ("x" * 120_000))
    res = attnguard_run(tmp_path, ATTNGUARD_LOG=huge)
    assert res.returncode == 0 and (tmp_path / "command-ran").exists()  # events on stderr
    assert res.stderr.startswith("attnguard: invalid ATTNGUARD_LOG=")
    assert f"({len(huge)} characters)" in res.stderr and len(res.stderr) < 2000
    with pytest.raises(ValueError) as err:
        attnguard.activate(mode="f" * 1_000_000)
    assert str(err.value).startswith("attnguard: invalid ATTNGUARD_MODE='ffff")
    assert "(1000000 characters)" in str(err.value) and len(str(err.value)) < 1000


def test_a_format_spec_that_makes_a_null_byte_names_the_variable(tmp_path: Path) -> None:
    with pytest.raises(ValueError) as err:
        attnguard.activate(log=str(tmp_path / "ev-{rank:c}.jsonl"))
    assert str(err.value).startswith("attnguard: invalid ATTNGUARD_LOG=")
    assert "the path contains a null byte" in str(err.value)


def test_a_deep_log_path_is_a_clear_error_not_a_recursion_error(tmp_path: Path) -> None:
    deep = str(tmp_path) + "/a" * 3000 + "/ev.jsonl"
    with pytest.raises(ValueError) as err:
        attnguard.activate(log=deep)
    assert str(err.value).startswith("attnguard: invalid ATTNGUARD_LOG=")
    assert "the path is" in str(err.value) and "characters long" in str(err.value)
    # a deep path within the limits is created without recursion
    ok = str(tmp_path / "d") + "/a" * 800 + "/ev.jsonl"
    attnguard.activate(log=ok)
    attnguard.deactivate()
    assert os.path.exists(ok)


def test_summary_of_files_without_events_says_so_and_fails(tmp_path: Path) -> None:
    empty, code = tmp_path / "empty.jsonl", tmp_path / "train.py"
    empty.write_text("")
    code.write_text("import torch\nprint('hello')\n")
    for path in (empty, code):
        res = subprocess.run(
            [PY, "-m", "attnguard", "summary", str(path)],
            env=subprocess_env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert res.returncode == 1, path
        assert res.stdout.rstrip().endswith("no attnguard events found in these files")
        assert "nothing to change" not in res.stdout


def test_rendezvous_files_are_private_and_never_follow_links(tmp_path: Path) -> None:
    """docs/files.md's modes: the directory 0700, each record 0600 under a fresh name; a link
    planted at a record's name is replaced, its target left alone; a link is never read."""
    from attnguard import safefiles

    notes = tmp_path / "notes.txt"
    notes.write_text(SECRET_NOTES)
    old_umask = os.umask(0)
    try:
        with safefiles.PrivateDir(str(tmp_path / "job")) as d:
            os.symlink(notes, tmp_path / "job" / "rank-1.json")
            os.symlink(notes, tmp_path / "job" / "announce-1")
            d.write("rank-1.json", b"{}")
            assert (tmp_path / "job").stat().st_mode & 0o777 == 0o700
            assert (tmp_path / "job" / "rank-1.json").lstat().st_mode & 0o777 == 0o600
            assert d.read("rank-1.json", 100)[0] == b"{}"
            with pytest.raises(safefiles.UnsafeFile, match="symbolic link"):
                d.read("announce-1", 100)
            with pytest.raises(safefiles.UnsafeFile, match=r"\(at most 1\)"):
                d.read("rank-1.json", 1)
    finally:
        os.umask(old_umask)
    assert notes.read_text() == SECRET_NOTES


def test_run_leaves_a_fifo_log_to_its_reader(tmp_path: Path) -> None:
    """``attnguard run`` checks a FIFO without opening it: an open and close would hand the
    reader at the other end its end of file before the command wrote a line."""
    import threading

    fifo = tmp_path / "events.fifo"
    os.mkfifo(fifo)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()))
    reader.start()
    res = attnguard_run(tmp_path, ATTNGUARD_LOG=str(fifo))
    reader.join(timeout=120)
    assert res.returncode == 0, res.stderr
    assert b'"event": "activated"' in got[0]  # the command's lines, not an early end of file
