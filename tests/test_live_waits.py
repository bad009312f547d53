"""A rank stuck outside a collective, named by the live view from the watchdog's wait records: the rule on
hand-made samples (who is the culprit, what is left to the 30 s stall rule, a record that is not trusted),
the records read from a run directory, and a real 2-rank gloo job under `torchrun -m ciuic_doctor watch`
whose rank 1 sleeps forever inside forward while rank 0 waits in the all-reduce: its watchdog writes
rank 0's wait record (the all_reduce), and the live view names rank 1 stalled and rank 0 waiting. The
same job's evaluation pause on both ranks leaves no wait record and every rank `ok`."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import textwrap
import time
from pathlib import Path

import pytest

from ciuic_doctor.live.sample import RankSample
from ciuic_doctor.live.verdicts import Thresholds, stalled
from ciuic_doctor.live.waits import WAIT_MIN_S, Wait, culprits, read_waits
from tests.test_live_job import TORCHRUN, lines_in, wait_for

NOW = 10_000.0


def _sample(rank: int, *, cpu: float = 0.0, state: str = "sleeping", up: bool = True) -> RankSample:
    return RankSample(rank=rank, pid=1000 + rank, up=up, state=state, cpu_percent=cpu)


def _figures(ages: dict[int, float]) -> dict[int, dict]:
    return {r: {"step": 50, "step_time_s": 0.25, "since_last_step_s": age} for r, age in ages.items()}


def _waits(ranks: list[int], waited_s: float) -> dict[int, Wait]:
    return {r: Wait(rank=r, pid=1000 + r, t_since=NOW - waited_s, op="all_reduce") for r in ranks}


def test_the_idle_rank_outside_the_collective_is_the_culprit() -> None:
    samples = {r: _sample(r) for r in range(4)}
    found = culprits(_waits([0, 2, 3], 6.0), samples, _figures(dict.fromkeys(range(4), 6.2)), 0.25, NOW)
    assert found[1][0] == "stalled"
    assert "not in the all_reduce" in found[1][1]
    assert {r: kind for r, (kind, _) in found.items() if r != 1} == dict.fromkeys((0, 2, 3), "waiting")
    assert "waiting on rank 1" in found[0][1]
    # through the live verdicts, before the 30 s stall rule would say anything
    limits = Thresholds()
    figures = _figures(dict.fromkeys(range(4), 6.2))
    assert stalled(samples, figures, limits, waits=_waits([0, 2, 3], 6.0), now=NOW) == found
    assert stalled(samples, figures, limits) == {}


def test_what_is_not_named_in_seconds() -> None:
    samples = {r: _sample(r) for r in range(2)}
    figures = _figures({0: 8.0, 1: 8.0})
    assert culprits(_waits([0], WAIT_MIN_S - 1), samples, figures, 0.25, NOW) == {}  # not long enough
    assert culprits(_waits([0, 1], 8.0), samples, figures, 0.25, NOW) == {}  # every rank waits: no culprit
    busy = {0: _sample(0), 1: _sample(1, cpu=95.0)}  # a rank-0-style save or eval the others wait for
    assert culprits(_waits([0], 8.0), busy, figures, 0.25, NOW) == {}
    disk = {0: _sample(0), 1: _sample(1, state="disk wait")}
    assert culprits(_waits([0], 8.0), disk, figures, 0.25, NOW) == {}
    stepped = _figures({0: 8.0, 1: 0.3})  # rank 1 made a step since rank 0 began to wait
    assert culprits(_waits([0], 8.0), samples, stepped, 0.25, NOW) == {}
    stale = {0: Wait(rank=0, pid=4242, t_since=NOW - 8, op="all_reduce")}  # an earlier process's record
    assert culprits(stale, samples, figures, 0.25, NOW) == {}
    slow_steps = _figures({0: 8.0, 1: 8.0})
    assert culprits(_waits([0], 8.0), samples, slow_steps, 1.0, NOW) == {}  # 10 median steps not reached


def test_wait_records_are_read_as_data(tmp_path: Path) -> None:
    good = {"schema": 1, "rank": 1, "pid": 77, "t_since": 5.0, "op": "all_reduce" + "x" * 500}
    (tmp_path / "hang.rank1.wait.json").write_text(json.dumps(good))
    (tmp_path / "hang.rank2.wait.json").write_text(json.dumps({**good, "rank": 3}))  # not its own rank
    (tmp_path / "hang.rank4.wait.json").write_text(json.dumps({**good, "rank": 4, "pid": "77"}))
    (tmp_path / "hang.rank5.wait.json").write_text("{not json")
    (tmp_path / "elsewhere.json").write_text(json.dumps({**good, "rank": 6}))
    os.symlink(tmp_path / "elsewhere.json", tmp_path / "hang.rank6.wait.json")
    (tmp_path / "hang.rank7.wait.json").write_text(json.dumps({**good, "rank": 7}) + " " * 5000)
    found = read_waits({tmp_path})
    assert list(found) == [1]
    assert (found[1].pid, found[1].t_since, len(found[1].op)) == (77, 5.0, 64)


JOB = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    ctrl, rank = Path(sys.argv[1]), int(os.environ["RANK"])

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 1)
        def forward(self, x):
            while (ctrl / f"stuck.{rank}").exists():
                time.sleep(0.5)
            return self.lin(x)

    model = Model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    (ctrl / f"pid.{rank}").write_text(str(os.getpid()))
    deadline = time.monotonic() + 400  # never outlive the test
    step = 0
    while time.monotonic() < deadline and not (ctrl / "end").exists():
        step += 1
        time.sleep(0.1)
        loss = model(torch.randn(16, 8)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
        opt.step()
        pause = ctrl / "pause"
        if pause.exists() and step == int(pause.read_text()):  # an evaluation on every rank
            (ctrl / f"paused.{rank}").write_text(str(step))
            time.sleep(8.0)
            (ctrl / f"resumed.{rank}").touch()
    """
)


@pytest.mark.slow
def test_a_rank_stuck_in_forward_is_named_and_an_eval_on_every_rank_is_not(tmp_path: Path) -> None:
    from ciuic_doctor.live.view import LiveJob

    ctrl, run = tmp_path / "ctrl", tmp_path / "run"
    ctrl.mkdir()
    script = tmp_path / "job.py"
    script.write_text(JOB)
    log = (tmp_path / "job.log").open("w")
    job = subprocess.Popen(
        [*TORCHRUN, "--nproc-per-node", "2", "-m", "ciuic_doctor", "watch", "--out", str(run), "--",
         str(script), str(ctrl)],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    try:
        wait_for("20 steps on both ranks", lambda: min(lines_in(run / f"steps.rank{r}.jsonl") for r in (0, 1))
                 >= 20 or job.poll() is not None, timeout_s=240, every_s=0.5)  # fmt: skip
        assert job.poll() is None, (tmp_path / "job.log").read_text()[-3000:]
        live = LiveJob(pid=job.pid, rediscover_s=2.0)
        wait_for("both ranks discovered", lambda: len(live.update().rows) == 2, timeout_s=60, every_s=0.5)
        # an evaluation pause on every rank: nobody is in a collective, nothing is named
        at = max(lines_in(run / f"steps.rank{r}.jsonl") for r in (0, 1)) + 20  # both ranks see it in time
        (ctrl / "pause").write_text(str(at))
        wait_for("the pause on both ranks", lambda: all((ctrl / f"paused.{r}").exists() for r in (0, 1)),
                 timeout_s=120, every_s=0.2)  # fmt: skip
        looks = 0
        while not all((ctrl / f"resumed.{r}").exists() for r in (0, 1)):
            rows = live.update().rows
            assert len(rows) == 2
            assert not [row.verdict.why for row in rows if row.verdict.stalled or row.verdict.waiting]
            assert not list(run.glob("hang.rank*.wait.json"))
            looks += 1
            time.sleep(0.5)
        assert looks >= 3  # the pause was looked at, not slept through
        # rank 1 stuck inside forward: rank 0 waits in the all-reduce
        (ctrl / "stuck.1").touch()
        record = wait_for("rank 0's wait record", lambda: _read(run / "hang.rank0.wait.json"), timeout_s=120)
        assert record["op"] == "all_reduce"
        assert record["pid"] == int((ctrl / "pid.0").read_text())
        assert not (run / "hang.rank1.wait.json").exists()

        def named() -> dict | None:
            rows = {row.rank: row.verdict for row in live.update().rows}
            return rows if rows.get(1) and rows[1].stalled else None

        verdicts = wait_for("rank 1 named by the live view", named, timeout_s=120, every_s=0.5)
        assert "not in the all_reduce" in " ".join(verdicts[1].why)
        assert verdicts[0].waiting
        assert not verdicts[0].stalled
        assert "waiting on rank 1" in " ".join(verdicts[0].why)
        # the wait ends: rank 0's record goes with it
        (ctrl / "stuck.1").unlink()
        wait_for("the record removed", lambda: not (run / "hang.rank0.wait.json").exists(), timeout_s=60)
    finally:
        (ctrl / "end").touch()
        with contextlib.suppress(FileNotFoundError):
            (ctrl / "stuck.1").unlink()
        try:
            job.wait(timeout=60)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(job.pid, signal.SIGKILL)
            job.wait()
        log.close()


def _read(path: Path) -> dict | None:
    with contextlib.suppress(OSError, ValueError):
        return json.loads(path.read_text())
    return None
