"""The per-rank JSON files through a real log shipper: rsyslog's ``imfile`` (the one of Debian's
packages that ships one: ``apt-get install rsyslog``; Fluent Bit, Vector, Fluentd and Filebeat
are not among Debian 12's packages) tailing ``attnguard-*.jsonl`` of a real torchrun job (two
ranks, gloo, the group destroyed before exit), ``mmjsonparse`` reading each line's fields, and
an ``omfile`` template writing the fields a pipeline groups by: the rules of docs/observability.md's
recipe G, read from there. Skipped where rsyslogd is not installed.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from helpers.processes import PY, subprocess_env

RSYSLOGD = shutil.which("rsyslogd") or (
    "/usr/sbin/rsyslogd" if Path("/usr/sbin/rsyslogd").exists() else None
)

WORKER = """
import torch.distributed as dist
import attnguard
from attnguard.observability import events

dist.init_process_group("gloo")
rank = dist.get_rank()
for _ in range(rank + 1):
    events.emit("device_map_rewritten", site="transformers.load",
                reason_code="device_map_per_rank", reason="one replica per rank", applied=True)
dist.barrier()
dist.destroy_process_group()
"""

DOC = Path(__file__).resolve().parent.parent / "docs" / "observability.md"


def recipe_config(logs: Path, out: Path, work: Path) -> str:
    """docs/observability.md's rsyslog recipe (recipe G) as written, its paths moved to the
    test's directories and a work directory of its own (rsyslogd runs as this user here)."""
    match = re.search(r"<!-- recipe: rsyslog -->\s*```text\n(.*?)```", DOC.read_text(), re.S)
    assert match, "docs/observability.md lost its rsyslog recipe"
    config = match.group(1)
    for path, here in (("/var/log/train/", f"{logs}/"), ("/var/log/attnguard-fields.log", out)):
        assert path in config
        config = config.replace(path, str(here))
    return f'global(workDirectory="{work}")\n{config}'


@pytest.mark.skipif(RSYSLOGD is None, reason="rsyslogd is not installed (apt-get install rsyslog)")
def test_rsyslog_imfile_ships_every_rank_and_the_job_summary(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    (tmp_path / "worker.py").write_text(WORKER)
    # recipe A's per-rank files, as recipe G's rsyslog rules read them
    env = subprocess_env(ATTNGUARD_LOG=str(logs / "attnguard-{rank}.jsonl"), OMP_NUM_THREADS="1")
    cmd = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    res = subprocess.run(
        [*cmd, str(tmp_path / "worker.py")], env=env, capture_output=True, text=True, timeout=240
    )
    assert res.returncode == 0, res.stderr[-3000:]

    work, out = tmp_path / "rsyslog", tmp_path / "shipped.txt"
    work.mkdir()
    conf = tmp_path / "rsyslog.conf"
    conf.write_text(recipe_config(logs, out, work))
    shipper = subprocess.Popen(
        [str(RSYSLOGD), "-n", "-f", str(conf), "-i", str(work / "pid")],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        lines: list[list[str]] = []
        deadline = time.monotonic() + 60  # a watchdog: the lines come within a second here
        while time.monotonic() < deadline and shipper.poll() is None:
            if out.exists():
                lines = [line.split("|") for line in out.read_text().splitlines()]
                if any(row[0] == "summary" for row in lines) and len(lines) >= 3:
                    break
            time.sleep(0.2)
    finally:
        shipper.terminate()
        shipper.wait(timeout=30)
    rows = {(row[0], row[1], row[2]): row for row in lines}
    assert rows[("device_map_rewritten", "0", "transformers.load")][3] == "device_map_per_rank"
    assert rows[("device_map_rewritten", "1", "transformers.load")][3] == "device_map_per_rank"
    summary = rows[("summary", "0", "job")]
    assert summary[3] == "exit_all_ranks" and summary[5].replace(" ", "") == "[0,1]"
