"""`hang --pid` on what users really run, and on a job whose user is not the caller (issue 22).

- as root on a job owned by another uid, whose Flight Recorder file (the default NCCL path the job's
  environment names) is a payload: nothing runs, nothing of it is copied unless it parses as data;
- an unwatched 2-rank DDP job whose rank 1 sleeps: rank 0 is blocked in DDP's all_reduce inside
  backward, seen only in C++ frames (py-spy --native): named a stall of rank 1;
- `hang --pid --out D` on a watched job: the ranks' own dumps (in their run directory) are read.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import pwd
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import run_cli
from test_hang import _kill_tree, _launch

from ciuic_doctor.rundir.hang.files import py_spy_binary

USER = "ciuic-hang-other"


class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _other_user() -> pwd.struct_passwd:
    if os.geteuid() != 0:
        pytest.skip("needs root: the case is root running hang --pid on another user's job")
    if shutil.which("useradd") is None:
        pytest.skip("useradd is not installed")
    with contextlib.suppress(KeyError):
        return pwd.getpwnam(USER)
    done = subprocess.run(
        ["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", USER],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"useradd failed: {done.stderr.strip()}")
    return pwd.getpwnam(USER)


def test_hang_pid_as_root_on_another_users_job_never_runs_its_dump(tmp_path):
    if py_spy_binary() is None:
        pytest.skip("py-spy is not installed")
    other = _other_user()
    home = tmp_path / "theirs"
    home.mkdir()
    os.chown(home, other.pw_uid, other.pw_gid)
    marker = tmp_path / "PWNED"
    prefix = home / "nccl_trace_rank_"
    dump = Path(f"{prefix}0")
    dump.write_bytes(pickle.dumps({"entries": [_Payload(marker)]}))
    os.chown(dump, other.pw_uid, other.pw_gid)  # the job's user owns it, as on a shared /tmp
    env = {"PATH": os.environ["PATH"], "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(prefix)}
    python = shutil.which("python3", path="/usr/bin:/usr/local/bin") or sys.executable  # one they may run
    job = subprocess.Popen(
        [python, "-c", "import time\nwhile True: time.sleep(0.5)"],
        env=env, user=other.pw_uid, group=other.pw_gid, cwd="/",
    )  # fmt: skip
    try:
        time.sleep(1.0)  # the interpreter is up when its stack is read (py-spy needs its symbols)
        out = tmp_path / "out"
        done = run_cli("hang", "--pid", str(job.pid), "--out", str(out), "--json", "--wait", "1", timeout=120)
    finally:
        job.kill()
        job.wait()
    assert "Traceback" not in done.stderr, done.stderr
    assert not marker.exists(), "hang --pid ran the job user's payload as root"
    assert not (out / "hang.fr" / "rank0").exists(), "a payload that is not data was copied into the run"
    spy = json.loads((out / "hang.pyspy.json").read_text())
    assert spy["ranks"]["0"]["pid"] == job.pid
    assert "fr_file" not in spy["ranks"]["0"]


DDP = """
import time, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
dist.init_process_group("gloo")
rank = dist.get_rank()
model = DDP(torch.nn.Linear(64, 64))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(100000):
    if rank == 1 and step == 3:
        time.sleep(3600)
    loss = model(torch.randn(8, 64)).sum()
    loss.backward()
    opt.step()
    opt.zero_grad()
"""


@pytest.mark.slow
@pytest.mark.parametrize("native", ["1", "0"], ids=["py-spy-native", "kernel-wchan"])
def test_hang_pid_names_ddps_all_reduce_inside_backward_on_an_unwatched_job(tmp_path, native):
    """With CIUIC_PYSPY_NATIVE=0 (as when py-spy --native is refused), /proc/<pid>/task/*/wchan says it."""
    if py_spy_binary() is None:
        pytest.skip("py-spy is not installed")
    script = tmp_path / "ddp_sleep.py"
    script.write_text(DDP)
    proc = _launch([str(script)], env={"HANG_PG_TIMEOUT": "300"})
    try:
        deadline, ev, done = time.monotonic() + 150, {}, None
        while time.monotonic() < deadline and ev.get("kind") != "stall":
            time.sleep(3)  # until both ranks exist and rank 0 waits (observable: the judgement)
            done = run_cli(
                "hang", "--pid", str(proc.pid), "--out", str(tmp_path / "pid"), "--json", timeout=120,
                env={"CIUIC_PYSPY_NATIVE": native},
            )  # fmt: skip
            if done.returncode == 2 and "ptrace" in done.stderr:
                pytest.skip(done.stderr.strip())
            if done.stdout.startswith("["):
                ev = json.loads(done.stdout)[0]["evidence"]
    finally:
        _kill_tree(proc)
    assert (ev.get("kind"), ev.get("culprit_ranks")) == ("stall", [1]), done and done.stdout + done.stderr
    assert "ddp_sleep.py:10" in ev["culprit_frame"], ev["culprit_frame"]
    rows = {row["rank"]: row for row in ev["ranks"]}
    assert rows[0]["in_collective"], rows[0]
    assert rows[0]["op"] == "all_reduce", rows[0]
    assert "ddp_sleep.py:12" in rows[0]["call_site"], rows[0]  # loss.backward()
    if native == "0":  # no C++ frame: the kernel's word for the wait is kept and shown
        assert "futex" in rows[0]["kernel_wait"], rows[0]
        assert "CIUIC_PYSPY_NATIVE=0" in rows[0]["kernel_wait"], rows[0]
        spy = json.loads((tmp_path / "pid" / "hang.pyspy.json").read_text())
        assert spy["ranks"]["0"]["native_error"] == "CIUIC_PYSPY_NATIVE=0"
        assert any(t["name"].startswith("gloo") for t in spy["ranks"]["0"]["kernel"]), spy["ranks"]["0"]
    else:
        assert "kernel_wait" not in rows[0], rows[0]
