"""Command line: ``attnguard run -- CMD``, ``attnguard doctor``, ``attnguard summary FILES``."""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import sys
from collections.abc import Sequence

DESCRIPTION = (
    "Runtime guard for attention backends in PyTorch / transformers. Commands: attnguard run -- "
    "CMD (run CMD with ATTNGUARD=1), attnguard doctor (this machine's facts and plan), attnguard "
    "summary FILES (merge per-rank event files)."
)


def _run(cmd: Sequence[str], verify: str | None = None) -> int:
    """Exec ``cmd`` with ATTNGUARD=1 (children such as torchrun's workers inherit it);
    ``verify``: ATTNGUARD_VERIFY for it (the opt-in numbers check)."""
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        print(
            "attnguard run: give a command, e.g. attnguard run -- python train.py", file=sys.stderr
        )
        return 2
    from .config import check
    from .runtime import PARENT_VAR

    # A bad value of a setting that chooses what the guard does is a usage error, said here
    # before anything ran (exit 2), as for a bad option. One that only says where events go
    # (ATTNGUARD_LOG and its kin, the kernel cache) is no reason to refuse: the command's guard
    # says it once and uses its substitute (README "Configuration").
    environ = dict(os.environ)
    if verify is not None:
        environ["ATTNGUARD_VERIFY"] = verify
    env = dict(environ, ATTNGUARD="1")  # this command's own switch
    usage = [p for p in check(env) if p.usage]
    if usage:
        for problem in usage:
            print(problem.error, file=sys.stderr)
        return 2
    env.pop(PARENT_VAR, None)  # the command is a program of its own, never a guarded helper
    exe = shutil.which(cmd[0], path=env.get("PATH"))
    if exe is None:
        print(f"attnguard run: command not found: {cmd[0]}", file=sys.stderr)
        return 127
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvpe(exe, list(cmd), env)  # replaces this process: the exit code is the command's


def _version() -> str:
    try:
        from importlib import metadata

        return metadata.version("attnguard")
    except Exception:
        from . import __version__

        return __version__


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="attnguard", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"attnguard {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    p_run = sub.add_parser("run", help="run a command with ATTNGUARD=1")
    p_run.add_argument(
        "--verify",
        metavar="RATE",
        help="check a sample of attention calls against their reference (ATTNGUARD_VERIFY: "
        "a rate such as 0.001, first:N, all, on, off)",
    )
    p_run.add_argument("cmd", nargs=argparse.REMAINDER, help="-- command and its arguments")
    p_doc = sub.add_parser("doctor", help="this machine's facts, backends and the plan for flash")
    p_doc.add_argument("--json", action="store_true", help="machine-readable output")
    p_sum = sub.add_parser(
        "summary",
        help="merge per-rank JSON event files into one report (exit 1: no events in them)",
    )
    p_sum.add_argument("files", nargs="+", help="JSON-lines files written with ATTNGUARD_LOG")
    p_sum.add_argument("--json", action="store_true", help="machine-readable output")
    args = parser.parse_args(argv)
    # what is printed may hold any name (a file's, a directory's under the caches doctor reads,
    # a summary file's text): never a codec error on the way out, whatever the stream's encoding
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.reconfigure(errors="backslashreplace")  # type: ignore[union-attr]
    try:
        if args.command == "run":
            return _run(args.cmd, args.verify)
        if args.command == "doctor":
            from .doctor import render

            print(render(as_json=args.json))
            return 0
        from .observability.eventfiles import summarise_files

        result = summarise_files(args.files, as_json=args.json)  # none readable: ValueError
        print(result.text)
        return 0 if result.usable else 1
    except ValueError as exc:
        print(str(exc), file=sys.stderr)
        return 2


def run_as_command() -> None:
    """The ``attnguard`` command and ``python -m attnguard``: :func:`main` in a process of its
    own, with the signals a command-line tool has. Python ignores SIGPIPE and SIGXFSZ; a tool
    whose reader went away (``attnguard summary ... | head -1``) ends quietly by SIGPIPE as cat
    does, and ``attnguard run`` hands its command the dispositions it would get from a shell."""
    for name in ("SIGPIPE", "SIGXFSZ"):
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), signal.SIG_DFL)
    sys.exit(main())


if __name__ == "__main__":
    run_as_command()
