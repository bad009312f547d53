"""memwatch keeps watching a target whose children come and go (issue 11): a child vanishing while the
tree was walked was taken for the root exiting, and the watch ended at once ("target exited", 0-1
samples, exit 0) while the target ran on."""

from __future__ import annotations

import json
import subprocess
import sys

# Eight short-lived children at a time, replaced as fast as they end: some vanish mid-walk every sample.
CHURN = """
import subprocess, sys, time
print("up", flush=True)
end = time.time() + 30
while time.time() < end:
    kids = [subprocess.Popen(["sleep", "0.01"]) for _ in range(8)]
    for kid in kids:
        kid.wait()
"""


def test_children_coming_and_going_do_not_end_the_watch(cli, tmp_path):
    target = subprocess.Popen([sys.executable, "-c", CHURN], stdout=subprocess.PIPE, text=True)
    try:
        target.stdout.readline()
        result = cli(
            "memwatch", "--pid", str(target.pid), "--interval", "0.02", "--duration", "3",
            "--out", str(tmp_path / "run"), timeout=60,
        )  # fmt: skip
        assert target.poll() is None  # still running: the watch had no reason to stop
    finally:
        target.kill()
        target.wait()
    assert result.returncode == 0, result.stderr
    assert "ended: duration reached" in result.stdout
    events = [
        json.loads(line) for line in (tmp_path / "run" / "memwatch_events.jsonl").read_text().splitlines()
    ]
    end = next(e for e in events if e.get("kind") == "end")
    assert end["reason"] == "duration reached"
    assert end["samples"] >= 20  # ~150 at 50 Hz alone; a loaded machine still makes dozens
