"""Where a job's ranks meet in files: the rendezvous directory of the exit summary, and the
marks ranks leave there that they are alive.

The ranks of a job on one host meet in this user's private directory
(:func:`attnguard.safefiles.private_dir`), under a name made of the job's identity and its
launcher; ranks that may run on several hosts meet beside the ``ATTNGUARD_LOG`` file (a shared
file system), under a name made of the job's identity (:func:`open_job_dir`). How the summary
uses them: :mod:`attnguard.observability.summary`.
"""

from __future__ import annotations

import hashlib
import os
import socket
from collections.abc import Mapping

from .. import launch, safefiles
from . import events

# What identifies one run of a job, the same on every rank (torchrun / torch.distributed.run).
JOB_VARS = (
    "TORCHELASTIC_RUN_ID",
    "MASTER_ADDR",
    "MASTER_PORT",
    "WORLD_SIZE",
    "TORCHELASTIC_RESTART_COUNT",
)


class JobSummaryUnavailable(Exception):
    """Why a job-wide summary cannot be gathered through files (the text is shown to users)."""


_LOOPBACK = ("localhost", "::1", "0:0:0:0:0:0:0:1")


def may_span_hosts(env: Mapping[str, str]) -> bool:
    """Whether the job's ranks may run on several hosts: LOCAL_WORLD_SIZE below WORLD_SIZE,
    or, where the launcher did not say, a rendezvous address other than this host's loopback."""
    try:
        world = int(env.get("WORLD_SIZE", "1"))
        if env.get("LOCAL_WORLD_SIZE"):
            return int(env["LOCAL_WORLD_SIZE"]) < world
    except ValueError:
        return False
    addr = env.get("MASTER_ADDR", "")
    return not (addr in _LOOPBACK or addr.startswith("127."))


def _digest(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def _job_place(env: Mapping[str, str], launcher: str | None) -> tuple[str | None, str]:
    """(the directory the job directory is in, or None for this user's private directory;
    the job directory's name). Raises JobSummaryUnavailable when the ranks cannot meet."""
    if not (env.get("TORCHELASTIC_RUN_ID") or env.get("MASTER_PORT")):
        raise JobSummaryUnavailable(
            "no process group at exit and the launcher set neither TORCHELASTIC_RUN_ID nor "
            "MASTER_PORT, which tell this job's ranks apart"
        )
    ident = [env.get(v, "") for v in JOB_VARS]
    if may_span_hosts(env):
        files = [t for t in events._state.settings.log_targets if t != "stderr"]
        if files:
            base = os.path.dirname(os.path.abspath(files[0]))
            while "{" in base:
                base = os.path.dirname(base)
            uid = os.geteuid() if hasattr(os, "geteuid") else 0
            return base, f".attnguard-job-{uid}-{_digest(*ident)}"
        if env.get("LOCAL_WORLD_SIZE"):
            raise JobSummaryUnavailable(
                "no process group at exit and ranks on several nodes: set ATTNGUARD_LOG to a "
                "file path on a shared file system for a job-wide summary"
            )
    # One host: the ranks one launcher started (two jobs alike in every variable are two
    # launches), in a directory only this user can write to.
    return None, f"job-{_digest(*ident, launcher or launch.launcher_id())}"


def job_dir_path(environ: Mapping[str, str] | None = None, launcher: str | None = None) -> str:
    """Where this job's ranks meet (see :func:`open_job_dir`); ``launcher``: the
    :func:`attnguard.launch.launcher_id` of the ranks (this process's by default). Makes this
    user's private directory when it is the place. Raises JobSummaryUnavailable."""
    env = os.environ if environ is None else environ
    base, name = _job_place(env, launcher)
    if base is None:
        try:
            with safefiles.private_dir(env) as own:
                base = own.path
        except OSError as exc:
            raise JobSummaryUnavailable(str(exc)) from None
    return os.path.join(base, name)


def open_job_dir() -> safefiles.PrivateDir:
    """The rendezvous directory, created if need be and checked (JobSummaryUnavailable).

    The ranks of a job on one host meet in this user's private directory
    (:func:`attnguard.safefiles.private_dir`), under a name made of the job's identity and its
    launcher: another user can neither create it first nor write into it, and another job with
    the same identity has another launcher. Ranks that may run on several hosts meet beside the
    ATTNGUARD_LOG file (a shared file system), under a name made of the job's identity."""
    base, name = _job_place(os.environ, None)
    path = name if base is None else os.path.join(base, name)
    try:
        if base is None:
            with safefiles.private_dir() as own:
                path = os.path.join(own.path, name)
                return own.sub(name)
        return safefiles.PrivateDir(path)
    except safefiles.UnsafeFile as exc:
        raise JobSummaryUnavailable(f"the rendezvous directory is not safe to use: {exc}") from None
    except OSError as exc:
        raise JobSummaryUnavailable(f"cannot create {path}: {exc.strerror or exc}") from None


def alive_name(rank: int) -> str:
    return f"alive-{rank}"


def announce_alive() -> None:
    """Called when a rank other than 0 activates under a launcher: its host and pid in the
    rendezvous directory, so that rank 0 waits for it while it runs. Never raises."""
    try:
        ctx = events.launch_context()
        if events.is_helper() or ctx["world_size"] <= 1:
            return
        launch.launcher_id()  # read now: the launcher may end before this rank does
        if ctx["rank"] == 0:
            return
        with open_job_dir() as d:
            d.write(alive_name(ctx["rank"]), f"{socket.gethostname()} {os.getpid()}".encode())
    except Exception:
        pass


def retire_alive(rank: int, directory: safefiles.PrivateDir | None) -> None:
    """At a rank's exit: it no longer runs, whatever it reports."""
    try:
        if directory is not None:
            directory.remove(alive_name(rank))
        else:
            with open_job_dir() as d:
                d.remove(alive_name(rank))
    except Exception:
        pass


def runs_here(pid: int) -> bool:
    """Process ``pid`` of this host exists and has not ended (a zombie waiting for its parent to
    reap it has ended)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # exists, another user's
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as fh:
            return fh.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return True
