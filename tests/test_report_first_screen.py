"""The report's first screen (the answer and one picture above the tables): what it lists, the overview
picture's marks read back from the SVG itself, the collapsed verdict table, the closing line, and the
first screen measured in headless Chromium at 1400 × 900 on the three kinds of run a user reports on
(the embedded job, a watched script, an imported log). tests/test_checkup.py checks a real checkup's."""

from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from ciuic_doctor.recommend import Plan
from ciuic_doctor.report import build_report, first_screen
from ciuic_doctor.report.blocks import Section
from ciuic_doctor.rundir.findings import Finding, Recommendation
from ciuic_doctor.rundir.store import RunDir
from tests.conftest import run_cli
from tests.test_report import chromium, console_lines, copy_run, needs_chromium

SCRIPTS = Path(__file__).parent / "data" / "user_scripts"
SVG = "{http://www.w3.org/2000/svg}"
WIDTH, HEIGHT = 1400, 900
# What must be on the first screen, by element id: the verdict line, the changes, the picture.
FIRST_SCREEN = ("headline", "changes", "look-at", "overview")
BOXES = (
    "<script>var out={w:innerWidth,h:innerHeight};"
    "['headline','changes','look-at','overview'].forEach(function(id){var e=document.getElementById(id);"
    "if(e){var r=e.getBoundingClientRect();out[id]=[r.left,r.top,r.right,r.bottom];}});"
    "document.body.setAttribute('data-boxes',JSON.stringify(out));</script></body>"
)


# ---- the overview picture ----------------------------------------------------------------------------
def planted_run(path: Path) -> tuple[Path, dict[str, int]]:
    """16 ranks × 300 steps (tests/scalesynth.py): a straggler from step 150, a rank leaking 1 MiB a step
    from the first step, and a loss spike planted at step 100 on every rank."""
    from tests.scalesynth import Plan as SynthPlan
    from tests.scalesynth import generate

    plan = SynthPlan(ranks=16, steps=300, slow_host=False)
    generate(path, plan)
    for f in path.glob("steps.rank*.jsonl"):
        rows = [json.loads(line) for line in f.read_text().splitlines()]
        for r in rows:
            if 100 <= r["step"] <= 103:
                r["loss"] *= (4.0, 2.5, 1.6, 1.2)[r["step"] - 100]
        f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path, {"loss_spike": 100, "straggler_onset": plan.straggler_from_step, "memory_leak": 1}


def overview_of(html: str) -> ET.Element:
    match = re.search(r'<svg [^>]*class="plot overview".*?</svg>', html, re.DOTALL)
    assert match is not None, "no overview picture"
    return ET.fromstring(match.group(0))  # well-formed XML: every string in it was escaped


def test_the_overview_marks_a_planted_spike_straggler_and_leak_at_their_steps(tmp_path):
    run, planted = planted_run(tmp_path / "run")
    build_report(RunDir.open(run), analyze=True)
    html = (run / "report.html").read_text()
    svg = overview_of(html)
    assert html.index('class="plot overview"') < html.index('<section id="verdicts"')  # above the tables
    first, last = float(svg.get("data-step-first")), float(svg.get("data-step-last"))
    x0, x1 = float(svg.get("data-x0")), float(svg.get("data-x1"))

    def x_of(step: float) -> float:
        return x0 + (step - first) / (last - first) * (x1 - x0)

    marks = {g.get("data-check"): g for g in svg.iter(f"{SVG}g") if g.get("class") == "mark"}
    for check, step in planted.items():
        assert check in marks, (check, sorted(marks))
        mark = marks[check]
        assert int(mark.get("data-step")) == step, check
        line = mark.find(f"{SVG}line")
        assert float(line.get("x1")) == pytest.approx(x_of(step), abs=0.01), check  # drawn where it says
    # Nothing else is marked: the run has these three problems and no other at a step.
    assert set(marks) == set(planted)
    # The loss line peaks where the spike mark is (its highest point: the smallest y).
    panels = {g.get("data-series"): g for g in svg.iter(f"{SVG}g") if g.get("class") == "panel"}
    assert set(panels) == {"step time (ms) across 16 ranks: band min–max, line median", "loss", "USS (MiB)"}
    points = [
        tuple(map(float, p.split(","))) for p in panels["loss"].find(f"{SVG}polyline").get("points").split()
    ]
    peak_x = min(points, key=lambda p: p[1])[0]
    assert peak_x == pytest.approx(x_of(100), abs=(x1 - x0) / 300 + 0.01)
    # Each mark links to the section with its evidence.
    links = {a.find(f"{SVG}g").get("data-check"): a.get("href") for a in svg.iter(f"{SVG}a")}
    assert links == {"loss_spike": "#stability", "straggler_onset": "#job", "memory_leak": "#memory"}


def test_the_overview_of_an_imported_log_is_its_loss_and_lr_with_the_spike(tmp_path):
    from ciuic_doctor.analysis.stability import analyze_log, write_findings
    from ciuic_doctor.importers import load
    from ciuic_doctor.importers._run import write_run
    from tests.test_report_imported import write_log

    path = write_log(tmp_path, "megatron")  # a loss spike at step 250
    out = RunDir.create(tmp_path / "run")
    write_run(out, load(path), [path])
    write_findings(out, analyze_log(load(path)))
    result = build_report(out)
    svg = overview_of((out.path / "report.html").read_text())
    panels = [g.get("data-series") for g in svg.iter(f"{SVG}g") if g.get("class") == "panel"]
    assert panels == ["loss", "learning rate (log scale)"]
    marks = [
        (g.get("data-check"), g.get("data-step")) for g in svg.iter(f"{SVG}g") if g.get("class") == "mark"
    ]
    assert ("loss_spike", "250") in marks
    assert result.closing_line() == "nothing left to verify: no change to try"


# ---- what the first screen lists ---------------------------------------------------------------------
def rec(setting, value, current, **evidence) -> Recommendation:
    return Recommendation(
        setting=setting,
        value=value,
        current=current,
        why=f"why {setting}",
        evidence=evidence,
        confidence="medium",
    )


def test_changes_proved_untried_and_findings_to_look_at():
    helps = {"status": "helps", "target_metric": "step time", "ratio": 0.88, "ci_low": 0.84, "ci_high": 0.92,
             "rounds": 6}  # fmt: skip
    plan = Plan(
        recommendations=[
            rec("dataloader.num_workers", 0, 2, verification=helps),
            rec(
                "dataloader.prefetch_factor",
                None,
                2,
                verification={**helps, "follows": "dataloader.num_workers=0"},
            ),
            rec("precision.init_scale", 4096, 65536, verification={"status": "not verified"}),
            rec("NCCL_ALGO", None, "Tree", verification={"status": "not verified"}),  # unset: a change
            rec("optim.lr_scaling", "sqrt", "none"),  # arithmetic: goes into the files without a trial
            rec("straggler (from a step on)", "rank 0 (+34 %)", None),  # a finding, not a setting
            Recommendation(
                setting="slow rank",
                value="rank 0",
                current=None,
                why="rank 0 slower",
                evidence={},
                confidence="low",
            ),  # repeats the finding: listed once, as the finding
            rec("optim.clip_max_norm", 1.6, 1.0, verification={"status": "no measurable effect"}),
        ]
    )
    findings = [
        Finding(probe="loader", check="loader_throughput", verdict="warn", summary="w4 faster"),
        Finding(probe="steps", check="straggler_onset", verdict="warn", summary="rank 0 slower",
                where={"rank": 0, "step": 40}),
        Finding(probe="memory", check="memory_leak", verdict="fail", summary="rank 3 leaks"),
        Finding(probe="stability", check="loss_spike", verdict="pass", summary="none"),
    ]  # fmt: skip
    sections = [
        Section(id="job", title="", command="job", probes=("steps",), streams=(), ran=True),
        Section(id="memory", title="", command="memwatch", probes=("memory",), streams=(), ran=True),
        Section(id="loader", title="", command="loader-sweep", probes=("loader",), streams=(), ran=False),
    ]
    meta = {"probes": {"job": {"status": "ok"}}, "spec": {"optim": {}}, "checkup": {"phases": []}}
    screen = first_screen.build(
        overall="fail", findings=findings, plan=plan, sections=sections, meta=meta,
        run_path="reports/my run", step_s=0.5, steps_run=40,
    )  # fmt: skip
    assert [(c.setting, c.value, c.note) for c in screen.proved] == [
        ("dataloader.num_workers", "0", "step time −12 % (95 % CI −16 … −8 %, 6 rounds)"),
        ("dataloader.prefetch_factor", "unset", "comes with dataloader.num_workers=0"),  # not a second proof
    ]
    assert [(c.setting, c.value) for c in screen.untried] == [
        ("precision.init_scale", "4096"),
        ("NCCL_ALGO", "unset"),
    ]
    assert screen.tried_no_gain == ["optim.clip_max_norm (no measurable effect)"]
    assert screen.command == "ciuic-doctor verify 'reports/my run'"  # quoted for the shell
    assert screen.alternative == "ciuic-doctor checkup --verify"
    # Look at: the fail first, then what happened at a step, then what a listed change answers; last, the
    # advice "straggler (from a step on)": something to look at, never a change.
    assert [(lk.what, lk.anchor, lk.step) for lk in screen.look_at] == [
        ("memory/memory_leak", "memory", None),
        ("steps/straggler_onset", "job", 40),
        ("loader/loader_throughput", "verdicts", None),  # its section did not run
        ("straggler (from a step on)", "settings", None),
    ]
    assert screen.headline == (
        "1 fail, 2 warn of 4 checks that ran; 2 change(s) proved to help on this job; 2 not yet tried; "
        "4 thing(s) to look at"
    )
    est = screen.estimate
    round_s = 3 * (22 * 0.5 + first_screen.DEFAULT_STARTUP_S)  # 78 s: 6 rounds fit verify's 480 s
    assert (est.rounds, est.runs_per_round, est.startup_measured) == (6, 3, False)
    assert est.seconds == pytest.approx(6 * round_s)
    assert screen.closing_line() == (
        "2 changes not yet tried on this job: `ciuic-doctor verify 'reports/my run'` tries them "
        f"({est.short}, estimated)"
    )


def test_the_estimate_follows_verify_and_its_measured_start_up():
    from ciuic_doctor import verify
    from ciuic_doctor.verify.runner import Schedule

    assert first_screen.VERIFY_BUDGET_S == verify.DEFAULT_BUDGET_S
    assert first_screen.VERIFY_STEPS == verify.DEFAULT_STEPS
    assert first_screen.VERIFY_WARMUP == verify.WARMUP_STEPS
    assert first_screen.MAX_ROUNDS == verify.Options().max_rounds == Schedule(budget_s=1).max_rounds
    meta = {"checkup": {"phases": [{"name": "job", "status": "ok", "seconds": 30.0}]}}
    est = first_screen.estimate(1, 0.1, meta, steps_run=100)  # 30 s for 100 steps of 0.1 s: 20 s start-up
    assert est.startup_measured
    assert est.startup_s == pytest.approx(20.0)
    round_s = 2 * (22 * 0.1 + 20.0)  # 44.4 s: pairs of rounds fit the 480 s budget up to 10 rounds
    assert (est.rounds, est.seconds) == (10, pytest.approx(10 * round_s))
    assert est.how == "10 rounds × 2 runs × (22 steps × 0.10 s + 20 s start-up)"
    assert first_screen.estimate(0, 0.1, meta, steps_run=100) is None


def test_the_verdict_table_shows_warn_and_fail_and_collapses_the_rest(tmp_path):
    run = copy_run(tmp_path)
    build_report(RunDir.open(run), analyze=False)
    html = (run / "report.html").read_text()
    verdicts = html[html.index('<section id="verdicts"') : html.index('<section id="settings"')]
    shown, rest = verdicts.split('<details class="verdicts-more"', 1)
    counts = {
        v: int(n)
        for n, v in re.findall(r'<span class="badge v-\w+">(\d+) (fail|warn|pass|not run)</span>', shown)
    }
    assert min(counts["fail"], counts["warn"], counts["pass"]) > 0, counts
    assert shown.count('<tr class="v-warn">') == counts["warn"]
    assert shown.count('<tr class="v-fail">') == counts["fail"]
    assert '<tr class="v-pass">' not in shown
    assert '<tr class="v-not_run">' not in shown
    # pass and not run: a count that opens on click (<details>), every row still in the DOM
    assert f"<summary>{counts['pass']} pass</summary>" in rest
    assert f"<summary>{counts['not run']} not run</summary>" in rest
    assert rest.count('<tr class="v-pass">') == counts["pass"]
    assert rest.count('<tr class="v-not_run">') == counts["not run"]


# ---- the first screen in a browser -------------------------------------------------------------------
def first_screen_boxes(page: Path, tmp_path: Path) -> dict:
    """Bounding boxes of the first screen's parts in Chromium at WIDTH × HEIGHT (and a screenshot)."""
    probe = page.with_name("first-screen-probe.html")
    probe.write_text(page.read_text().replace("</body>", BOXES))
    size = f"--window-size={WIDTH},{HEIGHT}"
    shot = chromium(
        tmp_path, "--hide-scrollbars", size, f"--screenshot={page.with_suffix('.png')}", page.as_uri()
    )
    assert page.with_suffix(".png").stat().st_size > 20_000, shot.stderr[-2000:]
    dom = chromium(tmp_path, size, "--dump-dom", probe.as_uri())
    assert console_lines(shot.stderr + dom.stderr) == []
    match = re.search(r"data-boxes=\"([^\"]*)\"", dom.stdout)
    assert match is not None, dom.stdout[-500:]
    return json.loads(match.group(1).replace("&quot;", '"'))


def assert_first_screen(page: Path, tmp_path: Path) -> dict:
    boxes = first_screen_boxes(page, tmp_path)
    assert boxes["w"] == WIDTH, boxes
    assert boxes["h"] <= HEIGHT, boxes
    for part in FIRST_SCREEN:
        assert part in boxes, (part, boxes)
        _left, top, right, bottom = boxes[part]
        assert 0 <= top < bottom <= boxes["h"], (part, boxes)  # wholly within the first screen
        assert right <= WIDTH, (part, boxes)
    return boxes


@needs_chromium
def test_first_screen_of_the_embedded_jobs_report(tmp_path):
    run = copy_run(tmp_path)
    build_report(RunDir.open(run), analyze=False)
    assert_first_screen(run / "report.html", tmp_path)
    html = (run / "report.html").read_text()
    first = html[html.index('<section id="first"') : html.index('<nav class="toc"')]
    assert "Not yet tried on the job (5)" in first
    assert f"ciuic-doctor verify {run}" in first
    assert re.search(r"<strong>about \d+ min</strong>", first)


@needs_chromium
def test_first_screen_of_a_watched_script(tmp_path):
    run = tmp_path / "run"
    done = run_cli(
        "watch", "--out", str(run), "--", str(SCRIPTS / "plain_train.py"), cwd=SCRIPTS, timeout=240
    )
    assert done.returncode == 0, done.stderr[-2000:]
    shown = run_cli("report", str(run), timeout=240)
    assert shown.returncode == 0, shown.stderr[-2000:]
    assert shown.stdout.strip().splitlines()[-1] == first_screen_line(run)
    assert_first_screen(run / "report.html", tmp_path)


@needs_chromium
def test_first_screen_of_an_imported_log(tmp_path):
    from tests.test_report_imported import write_log

    path = write_log(tmp_path, "nanogpt")
    run = tmp_path / "run"
    assert run_cli("stability", str(path), "--out", str(run), timeout=120).returncode in (0, 1)
    assert run_cli("report", str(run), "--quiet", timeout=120).returncode == 0
    assert_first_screen(run / "report.html", tmp_path)


def first_screen_line(run: Path) -> str:
    """The closing line as the page's data block gives it back (what `report` printed last)."""
    html = (run / "report.html").read_text()
    data = json.loads(re.search(r'id="report-data">(.*?)</script>', html, re.DOTALL).group(1))
    return data["first_screen"]["closing_line"]
