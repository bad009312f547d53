"""The defects still open from earlier hardening rounds (issue 22's "still open from before"), each as what a
user runs: an imported log's warning survives `report --reanalyze`; a `step` of 2**70 or an Infinity where a
time belongs is counted as off schema and the rest analysed; a second `stability --out R` is refused; no
message offers an option its command does not have; a short run gets no false FAIL.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from conftest import run_cli

sys.path.insert(0, str(Path(__file__).parent))
import logsynth


def _steps(path: Path, n: int, *, change: dict[int, str] | None = None) -> Path:
    """A one-rank steps stream of n healthy steps; `change`: step -> the raw JSON text of one field."""
    path.mkdir(parents=True, exist_ok=True)
    lines = []
    for i in range(1, n + 1):
        record = {"schema": 1, "t": 1000.0 + i, "host": "h", "rank": 0, "step": i, "loss": 3.0 - 0.01 * i,
                  "lr": 1e-3, "grad_norm": 1.0, "step_time_s": 0.1}  # fmt: skip
        text = json.dumps(record)
        if change and i in change:
            key, raw = change[i].split("=", 1)
            text = text.replace(f'"{key}": {json.dumps(record[key])}', f'"{key}": {raw}')
        lines.append(text)
    (path / "steps.rank0.jsonl").write_text("\n".join(lines) + "\n")
    return path


def test_report_reanalyze_keeps_an_imported_logs_clip_warning(tmp_path):
    """`stability LOG --clip C --out R` warned; `report --reanalyze R` lost C and said PASS."""
    log = tmp_path / "train.log"
    log.write_text(logsynth.megatron_log(logsynth.make_run(400, warmup=50)))
    out = tmp_path / "R"
    done = run_cli("stability", str(log), "--clip", "0.05", "--out", str(out), timeout=300)
    assert "WARN     stability  clipping" in done.stdout, done.stdout + done.stderr
    run_cli("report", str(out), "--reanalyze", timeout=600)
    summary = (out / "summary.md").read_text()
    assert "WARN `stability/clipping`" in summary, summary
    assert "max\\_norm 0.05" in summary


def test_a_step_of_2_70_or_an_infinite_time_is_counted_and_the_rest_analysed(tmp_path):
    cases = {
        "step": "step=1180591620717411303424",  # 2**70
        "rank": "rank=1180591620717411303424",
        "t": "t=Infinity",
        "duration": "step_time_s=Infinity",
    }
    for name, change in cases.items():
        run = _steps(tmp_path / name, 40, change={20: change})
        done = run_cli("analyze", str(run), "--json", timeout=300)
        assert "Traceback" not in done.stderr, done.stderr
        findings = json.loads(done.stdout)
        quality = [f["summary"] for f in findings if f["check"] == "records_readable"]
        field = change.split("=")[0]
        assert quality, name
        assert f"1 record(s) off schema ({field}:" in quality[0], (name, quality)
        stability = {f["check"]: f for f in findings if f["probe"] == "stability"}
        assert stability["loss_spike"]["verdict"] == "pass", stability["loss_spike"]  # the rest analysed
        assert not [f for f in findings if f["check"] == "analysis_error"], findings
    # an inf loss or grad norm is a measurement, not a broken record: judged, not skipped
    run = _steps(tmp_path / "loss", 40, change={20: "loss=Infinity"})
    findings = json.loads(run_cli("analyze", str(run), "--json", timeout=300).stdout)
    assert not [f for f in findings if f["check"] == "records_readable"]
    assert {f["check"]: f["verdict"] for f in findings}["nonfinite_loss"] == "warn"


def test_a_second_stability_out_into_the_same_run_is_refused_unless_it_is_the_same_log(tmp_path):
    first, second = tmp_path / "a.log", tmp_path / "b.log"
    first.write_text(logsynth.megatron_log(logsynth.make_run(60, seed=1)))
    second.write_text(logsynth.megatron_log(logsynth.make_run(80, seed=2)))
    out = tmp_path / "R"
    assert run_cli("stability", str(first), "--out", str(out), timeout=300).returncode == 0
    steps = (out / "steps.jsonl").read_text()
    done = run_cli("stability", str(second), "--out", str(out), timeout=300)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "already holds the import of" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    assert (out / "steps.jsonl").read_text() == steps  # the first import is intact
    again = run_cli("stability", str(first), "--clip", "1.0", "--out", str(out), cwd=tmp_path, timeout=300)
    assert again.returncode == 0, again.stderr  # the same log again (a new --clip): replaced


def test_no_message_offers_force_to_a_command_without_it(tmp_path):
    """The refusal of a non-empty --out offered --force to stability, compare, merge and hang, which have
    none (argparse then refused it); each command's own parser decides whether it is offered."""
    from ciuic_doctor.cli import build_parser

    parsers = next(a for a in build_parser()._actions if hasattr(a, "choices") and a.choices).choices
    has_force = {name: "--force" in p._option_string_actions for name, p in parsers.items()}
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine\n")
    log = tmp_path / "t.log"
    log.write_text(logsynth.megatron_log(logsynth.make_run(40)))
    a, b = _steps(tmp_path / "a", 5), _steps(tmp_path / "b", 5)
    argvs = {
        "stability": [str(log)],
        "compare": [str(a), str(b)],
        "merge": [str(a), str(b)],
        "hang": ["--pid", "1"],
        "watch": ["--", "train.py"],
    }
    assert {name for name in argvs if not has_force[name]} == {"stability", "compare", "merge", "hang"}
    for name, argv in argvs.items():
        done = run_cli(name, "--out", str(foreign), *argv, timeout=120)
        assert done.returncode == 2, (name, done.stderr)
        assert "not empty and not a run directory" in done.stderr, (name, done.stderr)
        assert ("--force" in done.stderr) == has_force[name], (name, done.stderr)
        assert sorted(p.name for p in foreign.iterdir()) == ["notes.txt"], name


def _rss_run(path: Path, steps: int, mib_per_step: float) -> Path:
    """One rank's steps with host RSS growing steadily from a 1 GiB level (watch's `rss` field)."""
    from ciuic_doctor.rundir.store import RunDir

    run = RunDir.create(path)
    with run.writer("steps", rank=0, per_rank_file=True) as writer:
        for step in range(1, steps + 1):
            rss = 2**30 + int(mib_per_step * 2**20 * step) + (step % 3) * 2**19
            writer.write({"step": step, "t": 1000.0 + 3 * step, "rss": rss, "step_time_s": 3.0})
    return path


def test_a_short_run_gets_no_memory_leak_verdict_a_long_one_does(tmp_path):
    """A 16-step checkup's start-up growth (40 MiB/step, 3 s steps) was a FAIL: an OOM projected in 24 h
    from 12 steady steps. Too short: not_run with the reason. The same growth over 60 steps: a leak."""
    from ciuic_doctor.analysis import memory
    from ciuic_doctor.rundir.store import RunDir

    def host(run):
        (leak,) = [f for f in memory.analyze(RunDir.open(run)) if f.check == "memory_leak"
                   and f.evidence.get("kind") == "host"]  # fmt: skip
        return leak

    short = host(_rss_run(tmp_path / "short", 16, 40))
    assert short.verdict == "not_run", short.summary
    assert "run more steps" in short.summary
    long = host(_rss_run(tmp_path / "long", 60, 40))
    assert long.verdict in ("warn", "fail"), long.summary


SHORT_SGD = """
import sys, torch
seed, lr = int(sys.argv[1]), float(sys.argv[2])
torch.manual_seed(seed)
model = torch.nn.Linear(16, 1)
opt = torch.optim.SGD(model.parameters(), lr=lr)
for step in range(12):
    x = torch.randn(4, 16)  # batches of 4: a loss that jumps 10x from step to step
    loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


def test_a_short_noisy_watched_run_is_not_divergent_a_blown_up_one_is(tmp_path):
    """12 steps: seed 5 at lr 0.01 ends 3.8x its best 2-point block by chance and was a divergence FAIL
    (23 of 40 seeds were); lr 0.3 blows up 400x and still fails."""
    script = tmp_path / "short.py"
    script.write_text(SHORT_SGD)
    verdicts = {}
    for name, lr in (("noisy", "0.01"), ("blown", "0.3")):
        run = tmp_path / name
        done = run_cli("watch", "--out", str(run), "--", str(script), "5" if name == "noisy" else "0", lr,
                       timeout=300)  # fmt: skip
        assert done.returncode == 0, done.stderr
        findings = json.loads(run_cli("analyze", str(run), "--json", timeout=300).stdout)
        verdicts[name] = next(f for f in findings if f["check"] == "divergence")
    assert verdicts["noisy"]["verdict"] != "fail", verdicts["noisy"]
    assert verdicts["blown"]["verdict"] == "fail", verdicts["blown"]
    assert "diverged" in verdicts["blown"]["summary"]
