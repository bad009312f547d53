"""The live view's pieces on constructed data: the steps tail, the verdicts, GPUs from NVML and the
environment, the collapsed screen and the Prometheus series (no processes beyond this one)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from ciuic_doctor.live import streams
from ciuic_doctor.live.discover import gpus_from_env
from ciuic_doctor.live.render import as_text, clean, distribution, visible_rows
from ciuic_doctor.live.sample import RankSample
from ciuic_doctor.live.streams import StepsTail, StepWindow
from ciuic_doctor.live.verdicts import (
    MemoryHistory,
    RankVerdict,
    Thresholds,
    memory_climbing,
    overflow_storms,
    stalled,
    stragglers,
)
from ciuic_doctor.live.view import Frame, Row
from ciuic_doctor.machine.nvml import Nvml


def _line(step: int, **fields) -> str:
    return json.dumps({"schema": 1, "t": 1000.0 + step, "step": step, **fields}) + "\n"


def test_tail_reads_only_new_whole_lines(tmp_path: Path) -> None:
    path = tmp_path / "steps.rank0.jsonl"
    path.write_text(_line(1, loss=2.0) + _line(2, loss=1.9) + '{"step": 3, "lo')  # a torn last line
    tail = StepsTail(tmp_path)
    window = tail.poll()[0]
    assert [r["step"] for r in window.records] == [1, 2]
    with path.open("a") as f:
        f.write('ss": 1.8, "t": 1003.0}\n' + "not json\n" + _line(4, loss=1.7))
    window = tail.poll()[0]
    assert [r["step"] for r in window.records] == [1, 2, 3, 4]
    assert window.bad_lines == 1
    assert window.steps_seen == 4


def test_tail_never_follows_a_symlink_and_starts_near_the_end(tmp_path: Path, monkeypatch) -> None:
    secret = tmp_path / "elsewhere.jsonl"
    secret.write_text(_line(1, loss=1.0))
    run = tmp_path / "run"
    run.mkdir()
    (run / "steps.rank1.jsonl").symlink_to(secret)
    monkeypatch.setattr(streams, "START_TAIL_BYTES", 200)
    (run / "steps.rank0.jsonl").write_text("".join(_line(s, loss=1.0) for s in range(1, 101)))
    tail = StepsTail(run)
    windows = tail.poll()
    assert 1 not in windows
    assert "symlink" in tail.refused["steps.rank1.jsonl"]
    steps = [r["step"] for r in windows[0].records]
    assert steps[-1] == 100
    assert len(steps) < 5
    (run / "steps.rank0.jsonl").write_text(_line(1, loss=3.0))  # truncated: read again from the start
    assert [r["step"] for r in tail.poll()[0].records][-1] == 1


def test_tail_reads_at_most_the_cap_a_look_and_catches_up(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(streams, "MAX_READ_BYTES", 200)
    (tmp_path / "steps.rank0.jsonl").write_text("".join(_line(s, loss=1.0) for s in range(1, 11)))
    tail = StepsTail(tmp_path)
    seen = [len(tail.poll()[0].records) for _ in range(6)]
    assert seen[0] < 10  # a burst is not read in one look...
    assert seen[-1] == 10  # ...but over several, every record, none twice
    assert [r["step"] for r in tail.windows[0].records] == list(range(1, 11))


def _window(rank: int, pre_backward_s: float, n: int = 30, skipped: set[int] | None = None) -> StepWindow:
    window = StepWindow(rank=rank)
    for step in range(1, n + 1):
        jitter = 0.002 * ((step * 7 + rank) % 5)
        window.records.append(
            {
                "step": step,
                "t": 1000.0 + step,
                "step_time_s": 0.5 + jitter,
                "pre_backward_s": pre_backward_s + jitter,
                "skipped": step in (skipped or set()),
            }
        )
    return window


def test_straggler_is_the_rank_whose_own_pace_is_behind() -> None:
    windows = {r: _window(r, 0.20) for r in range(8)}
    windows[5] = _window(5, 0.26)  # 30 % slower before backward; step times equal (DDP evens them)
    assert list(stragglers(windows)) == [5]
    windows[5] = _window(5, 0.205)  # within noise and under 10 %
    assert stragglers(windows) == {}


def test_a_7_percent_straggler_is_named_among_8_alike_ranks_and_not_among_2() -> None:
    """The report's floor (crossrank.slow_floor): 5 % where >= 8 ranks keep one pace, else 10 %."""
    windows = {r: _window(r, 0.20) for r in range(8)}
    windows[3] = _window(3, 0.214)
    found = stragglers(windows)
    assert list(found) == [3]
    assert "6.9 % above the typical rank" in found[3]  # 0.218 s over 0.204 s (jitter included)
    assert stragglers({0: _window(0, 0.20), 1: _window(1, 0.214)}) == {}


def test_overflow_storm_leaves_calibration_out() -> None:
    calibration = {1, 2, 3, 4, 5, 6}  # back to back from step 1: GradScaler finding its scale
    assert overflow_storms({0: _window(0, 0.2, n=60, skipped=calibration)}) == {}
    storm = calibration | {40, 42, 45, 47, 50}
    assert list(overflow_storms({0: _window(0, 0.2, n=60, skipped=storm)})) == [0]
    assert overflow_storms({0: _window(0, 0.2, n=60, skipped={40, 42, 45, 47})}) == {}


def _sample(rank: int, state: str = "sleeping", rss: int | None = None) -> RankSample:
    return RankSample(rank=rank, pid=1000 + rank, up=True, state=state, rss_bytes=rss)


def test_stalled_names_the_culprit_and_the_waiters() -> None:
    limits = Thresholds(stall_median_steps=20, stall_min_s=30)
    samples = {r: _sample(r) for r in range(4)}
    samples[2] = _sample(2, state="stopped")
    figures = {r: {"step": 10, "step_time_s": 0.5, "since_last_step_s": 40.0} for r in range(4)}
    found = stalled(samples, figures, limits)
    assert found[2][0] == "stalled"
    assert "SIGSTOP" in found[2][1]
    assert {r for r, (kind, _) in found.items() if kind == "waiting"} == {0, 1, 3}
    # no stopped process: the rank one step behind is the culprit, the others wait for it
    samples[2] = _sample(2)
    figures[2]["step"] = 9
    found = stalled(samples, figures, limits)
    assert found[2][0] == "stalled"
    assert found[0][0] == "waiting"
    for f in figures.values():
        f["since_last_step_s"] = 5.0  # under 30 s: nothing is stalled yet
    assert stalled(samples, figures, limits) == {}


def test_memory_climbing_needs_a_steady_rise() -> None:
    history = MemoryHistory()
    for i in range(40):
        history.add(
            float(i), {0: _sample(0, rss=2**30 + i * 4 * 2**20), 1: _sample(1, rss=2**30 + (i % 3) * 2**20)}
        )
    assert list(memory_climbing(history)) == [0]


def test_gpus_from_nvml_by_pid_else_from_the_environment() -> None:
    assert gpus_from_env("4,5,6,7", 2, nvml_listed_any=False) == [6]
    assert gpus_from_env("GPU-1f2e", 0, nvml_listed_any=False) == []  # a UUID needs NVML
    assert gpus_from_env("4,5", 0, nvml_listed_any=True) == []  # NVML lists others, not this PID


class _FakePynvml:
    """nvidia-ml-py's calls, answering like a 2-GPU box (figures from an H100's nvidia-smi -q)."""

    class NVMLError(Exception):
        pass

    NVML_CLOCK_SM = 1

    def nvmlDeviceGetUtilizationRates(self, h):  # noqa: N802 - the library\'s names
        return SimpleNamespace(gpu=[97, 3][h], memory=40)

    def nvmlDeviceGetMemoryInfo(self, h):  # noqa: N802 - the library\'s names
        return SimpleNamespace(total=80 * 2**30, used=[61 * 2**30, 2**30][h])

    def nvmlDeviceGetPowerUsage(self, h):  # noqa: N802 - the library\'s names
        if h == 1:
            raise self.NVMLError("Not Supported")
        return 612_000  # milliwatts

    def nvmlDeviceGetClockInfo(self, h, kind):  # noqa: N802 - the library\'s names
        return 1980

    def nvmlDeviceGetUUID(self, h):  # noqa: N802 - the library\'s names
        return f"GPU-0000000{h}"


def test_nvml_device_figures_from_a_constructed_library() -> None:
    nvml = Nvml(lib=_FakePynvml(), handles=[0, 1])
    first, second = nvml.device_figures()
    assert first == {
        "index": 0,
        "uuid": "GPU-00000000",
        "utilization_ratio": 0.97,
        "memory_used_bytes": 61 * 2**30,
        "memory_total_bytes": 80 * 2**30,
        "power_watts": 612.0,
        "sm_clock_hertz": 1980e6,
    }
    assert second["power_watts"] is None
    assert second["utilization_ratio"] == 0.03
    assert Nvml(reason="no driver").device_figures() == []


def _frame(n: int, stalled_rank: int | None = None) -> Frame:
    rows = []
    for r in range(n):
        verdict = RankVerdict(
            rank=r, stalled=r == stalled_rank, why=["no step for 40 s"] if r == stalled_rank else []
        )
        sample = RankSample(
            rank=r,
            pid=5000 + r,
            up=True,
            state="running",
            cpu_percent=99.0,
            cpu_seconds=12.5,
            rss_bytes=3 << 30,
        )
        figures = {"step": 100, "steps_per_s": 2.0, "step_time_s": 0.5, "since_last_step_s": 0.2, "loss": 2.5}
        rows.append(
            Row(rank=r, pid=5000 + r, host="node-0", local_rank=r % 8, gpu=str(r % 8), sample=sample,
                figures=figures, verdict=verdict)
        )  # fmt: skip
    return Frame(t=time.time(), script="train.py", world_size=n, hosts=["node-0"], run_id="j1",
                 run_dir=None, agents=[1], rows=rows, step=100, step_time_series=[0.5, 0.6, 0.5],
                 loss_series=[3.0, 2.5])  # fmt: skip


def test_past_a_screen_the_stalled_rank_stays_and_the_rest_is_one_line() -> None:
    frame = _frame(1024, stalled_rank=700)
    shown, folded = visible_rows(frame, "rank", 10)
    assert len(shown) == 9
    assert 700 in [r.rank for r in shown]
    assert len(folded) == 1015
    assert distribution(folded).startswith("... 1015 more ranks (1015 ok): steps/s min 2.00 p50 2.00")
    text = as_text(frame, sort="rank", max_rows=10)
    assert "STALLED" in text
    assert "... 1015 more ranks" in text
    assert "rank 700: no step for 40 s" in text


def test_strings_from_the_job_cannot_drive_the_terminal() -> None:
    assert clean("train\x1b[2J.py\n") == "train?[2J.py?"
    frame = _frame(2)
    frame.script = "[bold red]x\x1b]0;pwned\x07"
    text = as_text(frame)
    assert "[bold red]x?]0;pwned?" in text
    assert "\x1b" not in text


def test_metrics_follow_prometheus_conventions_and_the_rank_cap() -> None:
    from prometheus_client import generate_latest
    from prometheus_client.registry import CollectorRegistry

    from ciuic_doctor.live.metrics import ExportConfig, Sampled

    frame = _frame(12, stalled_rank=11)
    live = SimpleNamespace(tails={}, host="node-0", update=lambda: frame)
    sampled = Sampled(live, ExportConfig(job="j1", max_ranks=4))
    sampled.sample_once()
    registry = CollectorRegistry(auto_describe=False)
    registry.register(sampled)
    text = generate_latest(registry).decode()
    samples = [line for line in text.splitlines() if line.startswith("ciuic_rank_stalled{")]
    assert len(samples) == 4  # capped, and the stalled rank is among those kept
    assert any('rank="11"' in s and s.endswith(" 1.0") for s in samples)
    assert 'ciuic_ranks_omitted{host="node-0",job="j1"} 8.0' in text
    for line in text.splitlines():
        if line.startswith("ciuic_rank_"):
            labels = line[line.index("{") + 1 : line.index("}")]
            assert sorted(kv.split("=")[0] for kv in labels.split(",")) == sorted(
                ["job", "host", "rank", "local_rank", "gpu"]
            )
    assert "# TYPE ciuic_rank_cpu_seconds_total counter" in text
    assert "ciuic_rank_cpu_seconds_total{" in text
    assert 'pid="' not in text
    assert 'step="' not in text


def test_tokens_per_second_per_rank_for_the_job_and_as_series(tmp_path: Path) -> None:
    """Rank 0 trains 512 tokens a step, one step a second (step 6 without the field: no tokens counted);
    rank 1's records carry no tokens: shown "-", no series, and the header says the total is partial."""
    from prometheus_client import generate_latest
    from prometheus_client.registry import CollectorRegistry

    from ciuic_doctor.live.metrics import ExportConfig, Sampled
    from ciuic_doctor.live.view import _job_figures

    (tmp_path / "steps.rank0.jsonl").write_text(
        "".join(_line(s, step_time_s=1.0, **({} if s == 6 else {"tokens": 512})) for s in range(1, 12))
    )
    (tmp_path / "steps.rank1.jsonl").write_text("".join(_line(s, step_time_s=1.0) for s in range(1, 12)))
    tail = StepsTail(tmp_path)
    windows = tail.poll()
    figures = {r: windows[r].figures(1012.0) for r in (0, 1)}
    assert figures[0]["tokens_per_s"] == pytest.approx(9 * 512 / 10)  # steps 2..11 less 6, over 10 s
    assert figures[1]["tokens_per_s"] is None
    frame = _frame(2)
    for row in frame.rows:
        row.figures = figures[row.rank]
    _job_figures(frame, windows)
    text = as_text(frame)
    assert "tokens/s 461 (1 of 2 ranks)" in text
    header = next(line for line in text.splitlines() if line.split()[:2] == ["RANK", "PID"]).split()
    cells = {line.split()[0]: dict(zip(header, line.split(), strict=False)) for line in text.splitlines()
             if line.split()[:2] in (["0", "5000"], ["1", "5001"])}  # fmt: skip
    assert (cells["0"]["TOK/S"], cells["1"]["TOK/S"]) == ("461", "-")
    live = SimpleNamespace(tails={tmp_path: tail}, host="node-0", update=lambda: frame)
    sampled = Sampled(live, ExportConfig(job="j1"))
    sampled.sample_once()
    registry = CollectorRegistry(auto_describe=False)
    registry.register(sampled)
    series = [line for line in generate_latest(registry).decode().splitlines() if "tokens" in line]
    assert "# TYPE ciuic_rank_tokens_per_second gauge" in series
    assert "# TYPE ciuic_rank_tokens_total counter" in series
    values = {line.split("{")[0]: line for line in series if not line.startswith("#")}
    assert 'rank="0"' in values["ciuic_rank_tokens_per_second"]
    assert values["ciuic_rank_tokens_per_second"].endswith(" 460.8")
    assert values["ciuic_rank_tokens_total"].endswith(" 5120.0")  # 10 records with tokens
    assert not any('rank="1"' in line for line in series)


def test_environ_reading_keeps_only_the_rank_keys() -> None:
    from ciuic_doctor.live.discover import read_environ

    env = read_environ(os.getpid())
    assert env is not None
    assert set(env) <= {
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "GROUP_RANK",
        "TORCHELASTIC_RUN_ID",
        "CUDA_VISIBLE_DEVICES",
    }


def _exported_names() -> set[str]:
    from ciuic_doctor.live.metrics import GPU_METRICS, RANK_METRICS

    job_level = {"ciuic_ranks_omitted", "ciuic_job_finished", "ciuic_job_world_size", "ciuic_exporter_up"}
    return {m[0] for m in RANK_METRICS} | {m[0] for m in GPU_METRICS} | job_level


def test_the_dashboard_and_the_alert_rules_name_only_series_the_exporter_serves() -> None:
    import re

    repo = Path(__file__).resolve().parents[1]
    dashboard = json.loads((repo / "deploy/grafana/ciuic-doctor-ranks.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    rules = (repo / "deploy/prometheus/ciuic-alerts.yml").read_text()
    named = set(re.findall(r"ciuic_\w+", " ".join(exprs) + rules))
    assert named
    assert named <= _exported_names(), named - _exported_names()
    assert {
        "CiuicRankStalled",
        "CiuicRankStraggler",
        "CiuicOverflowStorm",
        "CiuicRankDown",
        "CiuicExporterDown",
    } <= set(re.findall(r"alert: (\w+)", rules))


def test_promtool_accepts_the_rules_and_the_scrape_config() -> None:
    import shutil
    import subprocess

    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip(
            "Debian's prometheus (promtool) is not installed (scripts/ensure-test-tools.sh installs it)"
        )
    deploy = Path(__file__).resolve().parents[1] / "deploy/prometheus"
    for args in (["check", "rules", "ciuic-alerts.yml"], ["check", "config", "prometheus.yml"]):
        done = subprocess.run([promtool, *args], cwd=deploy, capture_output=True, text=True, check=False)
        assert done.returncode == 0, done.stdout + done.stderr


def test_a_rank_gets_the_gpu_nvml_lists_its_pid_on_and_the_endpoint_labels_it() -> None:
    """NVML by PID wins over CUDA_VISIBLE_DEVICES; the device's figures land on that rank's line and on
    ciuic_gpu_* series labelled gpu="1" (a constructed NVML: no GPU on this machine)."""
    import subprocess
    import sys

    from prometheus_client import generate_latest
    from prometheus_client.registry import CollectorRegistry

    from ciuic_doctor.live.metrics import ExportConfig, Sampled
    from ciuic_doctor.live.view import LiveJob
    from ciuic_doctor.machine.nvml import ProcessGpuMemory

    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "CUDA_VISIBLE_DEVICES": "0,1"}
    rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=env)
    try:
        nvml = Nvml(lib=_FakePynvml(), handles=[0, 1])
        nvml.process_memory = lambda: {
            rank.pid: ProcessGpuMemory(pid=rank.pid, used_bytes=2**30, devices=[1])
        }
        live = LiveJob(pid=rank.pid, nvml=nvml)
        row = live.update().rows[0]
        assert row.gpu == "1"  # NVML's answer, not CUDA_VISIBLE_DEVICES[LOCAL_RANK] = 0
        assert row.sample.gpus[0]["utilization_ratio"] == 0.03
        assert "1:3%/1.0G/-W" in as_text(live.update())
        sampled = Sampled(live, ExportConfig(job="g"))
        sampled.sample_once()
        registry = CollectorRegistry(auto_describe=False)
        registry.register(sampled)
        text = generate_latest(registry).decode()
        assert 'ciuic_gpu_utilization_ratio{gpu="1",host=' in text
        assert "ciuic_gpu_power_watts" not in text  # device 1 does not report power: no series, not a 0
    finally:
        rank.kill()
        rank.wait()


def test_the_job_label_is_never_torchruns_placeholder_run_id(tmp_path: Path) -> None:
    from ciuic_doctor.live.discover import JobLayout
    from ciuic_doctor.live.ending import job_label

    def layout(run_id, run_dir=None):
        return JobLayout(ranks={}, agents=[], script="train.py", world_size=2, run_id=run_id, run_dir=run_dir)

    assert job_label(given=None, run_arg=None, layout=layout("none"), pid=42) == "train.py-42"
    assert job_label(given=None, run_arg=None, layout=layout("none", tmp_path / "r1"), pid=42) == "r1"
    assert job_label(given=None, run_arg=str(tmp_path / "r2"), layout=layout("abc"), pid=42) == "r2"
    assert job_label(given=None, run_arg=None, layout=layout("abc", tmp_path / "r1"), pid=42) == "abc"
    assert job_label(given="mine", run_arg=str(tmp_path / "r2"), layout=layout("none"), pid=42) == "mine"
