"""report.html and its sibling files, on the recorded GPU run (tests/data/report_gpu): content, escaping of
untrusted strings, secrets, not-run sections, and a real headless Chromium that renders it (skipped with the
reason only when Debian's chromium is absent; `scripts/ensure-browser.sh` installs it)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from ciuic_doctor.report import OUTPUTS, build_report
from ciuic_doctor.report.html import json_for_script
from ciuic_doctor.report.plots import busbw_plot
from ciuic_doctor.rundir.store import RunDir

DATA = Path(__file__).parent / "data" / "report_gpu"
PAYLOAD = '<script>alert("pwned")</script><img src=x onerror="alert(1)">'
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="Debian's chromium is not installed (run scripts/ensure-browser.sh as root)"
)
DATA_BLOCK = re.compile(r'<script type="application/json" id="report-data">(.*?)</script>', re.DOTALL)


def copy_run(tmp_path: Path, name: str = "run") -> Path:
    run = tmp_path / name
    shutil.copytree(DATA, run, ignore=shutil.ignore_patterns("make.py"))
    return run


def edit_jsonl(path: Path, change) -> None:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    path.write_text("".join(json.dumps(change(r)) + "\n" for r in rows))


def plant(run: Path, text: str) -> None:
    """Put `text` where logs, host names and the environment reach the report."""
    findings = json.loads((run / "findings.json").read_text())
    findings["findings"][0]["summary"] = f"log line: {text}"
    findings["findings"][0]["where"] = {"host": text}
    (run / "findings.json").write_text(json.dumps(findings))
    meta = json.loads((run / "meta.json").read_text())
    meta["env"]["env"]["NCCL_SOCKET_IFNAME"] = text
    meta["env"]["host"] = text
    (run / "meta.json").write_text(json.dumps(meta))
    edit_jsonl(run / "steps.rank0.jsonl", lambda r: {**r, "host": text})
    edit_jsonl(run / "memwatch.jsonl", lambda r: {**r, "role": text} if r["role"] == "agent" else r)
    edit_jsonl(
        run / "comm.jsonl", lambda r: {**r, "collective": text} if r["collective"] == "broadcast" else r
    )


def chromium(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    profile = tmp_path / "chromium-profile"
    return subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         f"--user-data-dir={profile}", "--enable-logging=stderr", "--v=0", *args],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


def console_lines(stderr: str) -> list[str]:
    """Anything the page logged: uncaught errors and every console message (the report logs nothing)."""
    return [line for line in stderr.splitlines() if ":CONSOLE" in line or "Uncaught" in line]


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    run = copy_run(tmp_path_factory.mktemp("report"))
    build_report(RunDir.open(run), analyze=False)
    return run


def test_every_output_file_is_written(built):
    for name in OUTPUTS:
        assert (built / name).stat().st_size > 0, name
    html = (built / "report.html").read_text()
    assert len(html.encode()) < 3 * 2**20
    assert html.startswith("<!DOCTYPE html>")
    assert "<?xml" not in html  # SVG prolog stripped
    assert "http://" not in html.replace('xmlns="http://www.w3.org/2000/svg"', "").replace(
        'xmlns:xlink="http://www.w3.org/1999/xlink"', ""
    )  # no CDN or remote resource: the page works offline
    assert "https://" not in html


def test_report_has_every_part(built):
    html = (built / "report.html").read_text()
    assert (
        len(re.findall(r'<svg [^>]*class="plot"', html)) == 6
    )  # busbw, step time, stability, step memory, memwatch, loader
    for section in (
        "verdicts",
        "settings",
        "tips",
        "comm",
        "job",
        "stability",
        "memory",
        "loader",
        "checkpoint",
    ):
        assert f'id="{section}"' in html, section
    assert "A pass covers only these checks" in html
    assert "can exceed the link speed" in html  # busbw explained
    assert "@media (prefers-color-scheme: dark)" in html
    assert "@media print" in html
    # Issue 21: a change not verified on the job stays out of recommended.env (named in a comment);
    # a documented fact (Flight Recorder) is ready to copy.
    assert "export NCCL_ALGO=allreduce:tree" not in html
    assert "Left out, not shown to help on this job" in html
    assert "export TORCH_NCCL_TRACE_BUFFER_SIZE=2000" in html
    assert "torch 2.6.0+cu124" in html
    assert "NCCL 2.26.2" in html
    assert "hosts gpu-node-01, gpu-node-02" in html
    data = json.loads(DATA_BLOCK.search(html).group(1))
    assert data["overall"] == "fail"
    assert len(data["seed_tips"]) == 7
    assert {f["check"] for f in data["findings"]} >= {
        "algo_choice",
        "memory_leak",
        "pg_timeout",
        "loss_spike",
    }


def test_plots_follow_the_page_theme():
    records = [json.loads(line) for line in (DATA / "comm.jsonl").read_text().splitlines()]
    svg = busbw_plot(records)
    assert svg.startswith("<svg ")
    assert "currentColor" in svg
    assert "#010203" not in svg  # the placeholder ink is gone
    assert "fill: #ffffff" not in svg  # transparent background, no white box in dark mode
    assert "<metadata>" not in svg


def test_json_block_cannot_close_its_script_element():
    text = json_for_script({"log": "</script><!-- & -->"})
    assert "</" not in text
    assert "<!--" not in text
    assert json.loads(text) == {"log": "</script><!-- & -->"}


def test_untrusted_strings_appear_as_text(tmp_path):
    run = copy_run(tmp_path)
    plant(run, PAYLOAD)
    build_report(RunDir.open(run), analyze=False)
    html = (run / "report.html").read_text()
    assert PAYLOAD not in html
    assert "&lt;script&gt;alert(&#34;pwned&#34;)&lt;/script&gt;" in html
    assert html.count("<script") == 2  # the data block and our own script, nothing injected
    data = json.loads(DATA_BLOCK.search(html).group(1))
    assert any(PAYLOAD in f["summary"] for f in data["findings"])  # the data keeps the exact text


def test_a_secret_in_the_environment_reaches_no_output(tmp_path, cli):
    secret = "hf_Zq8sQ2vLr5ExampleSecretValue"
    run = copy_run(tmp_path)
    plant(run, f"token={secret}")  # an input written by something that did not scrub
    result = cli("report", str(run), env={"HF_TOKEN": secret}, timeout=120)
    assert result.returncode == 0, result.stderr
    assert secret not in result.stdout
    for name in OUTPUTS:
        text = (run / name).read_text()
        assert secret not in text, name
    assert "token=&lt;redacted&gt;" in (run / "report.html").read_text()


def test_a_probe_that_did_not_run_says_not_run(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(DATA / "comm.jsonl", run)
    meta = json.loads((DATA / "meta.json").read_text())
    meta["checkup"] = {
        "phases": [{"name": "loader-sweep", "status": "failed", "reason": "exit code 2: no CPU"}]
    }
    (run / "meta.json").write_text(json.dumps(meta))
    findings = json.loads((DATA / "findings.json").read_text())
    findings["findings"] = [f for f in findings["findings"] if f["probe"] == "comm"]
    (run / "findings.json").write_text(json.dumps(findings))
    build_report(RunDir.open(run), analyze=False)
    html = (run / "report.html").read_text()
    assert "Not run: exit code 2: no CPU" in html
    assert "Not run: no checkpoint records in this run directory" in html
    assert html.count('class="probe notrun"') == 5  # all but comm
    data = json.loads(DATA_BLOCK.search(html).group(1))
    assert {n["command"] for n in data["not_run"]} == {
        "job", "stability", "memwatch", "loader-sweep", "checkpoint-check"
    }  # fmt: skip
    summary = (run / "summary.md").read_text()
    assert "NOT RUN `loader-sweep`: exit code 2: no CPU" in summary
    recs = json.loads((run / "recommendations.json").read_text())["recommendations"]
    assert not [r for r in recs if r["setting"].startswith("dataloader.")]  # no measurement, no advice


def test_report_command_analyses_a_fresh_run_and_refuses_bad_input(tmp_path, cli):
    run = copy_run(tmp_path)
    (run / "findings.json").unlink()
    result = cli("report", str(run), "--quiet", timeout=180)
    assert result.returncode == 0, result.stderr
    assert "(analyses run first)" in result.stdout
    assert (run / "findings.json").exists()
    missing = cli("report", str(tmp_path / "nope"))
    assert missing.returncode == 2
    assert missing.stderr.strip().splitlines() == [
        f"ciuic-doctor report: error: {tmp_path / 'nope'}: no such run directory"
    ]


@needs_chromium
@pytest.mark.parametrize("scheme", ["light", "dark"])
def test_report_renders_in_headless_chromium(tmp_path, scheme):
    """No console output at all, every plot in the DOM, untrusted text inert; screenshot kept in tmp_path."""
    run = copy_run(tmp_path)
    plant(run, PAYLOAD)
    build_report(RunDir.open(run), analyze=False)
    page = (run / "report.html").as_uri()
    dark = ["--force-dark-mode", "--blink-settings=preferredColorScheme=0"] if scheme == "dark" else []
    shot = tmp_path / f"report-{scheme}.png"
    screenshot = chromium(
        tmp_path, *dark, "--hide-scrollbars", "--window-size=1280,2400", f"--screenshot={shot}", page
    )
    assert shot.stat().st_size > 50_000, screenshot.stderr[-2000:]
    dom = chromium(tmp_path, *dark, "--dump-dom", page)
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert console_lines(screenshot.stderr + dom.stderr) == []
    assert dom.stdout.count('class="plot"') >= 12  # 6 figures and their 6 svg elements
    assert dom.stdout.count("<script") == 2
    assert 'src="x"' not in dom.stdout
    assert "&lt;script&gt;alert" in dom.stdout


@needs_chromium
def test_tables_sort_when_a_header_is_clicked(tmp_path):
    run = copy_run(tmp_path)
    build_report(RunDir.open(run), analyze=False)
    html = (run / "report.html").read_text()
    probe = (
        "<script>var t=document.querySelector('table.recs');var h=t.tHead.rows[0].cells[0];h.click();"
        "var a=t.tBodies[0].rows[0].cells[0].textContent;h.click();"
        "var b=t.tBodies[0].rows[0].cells[0].textContent;"
        "document.body.setAttribute('data-probe',a+'|'+b+'|'+h.getAttribute('aria-sort'));</script></body>"
    )
    (run / "probe.html").write_text(html.replace("</body>", probe))
    dom = chromium(tmp_path, "--dump-dom", (run / "probe.html").as_uri())
    assert console_lines(dom.stderr) == []
    match = re.search(r'data-probe="([^"]*)"', dom.stdout)
    assert match is not None, dom.stdout[-500:]
    first_ascending, first_descending, order = match.group(1).split("|")
    assert first_ascending.startswith("checkpoint contents")
    assert first_descending.startswith("TORCH_NCCL_TRACE_BUFFER_SIZE")
    assert order == "descending"


def test_records_of_the_wrong_shape_do_not_break_the_report(tmp_path):
    """Streams written by other tools or older versions: wrong types, NaN strings, a torn last line."""
    run = tmp_path / "run"
    run.mkdir()
    junk = [
        {"step": "x", "rank": "r", "loss": "nan"},
        {"step": 1, "rank": None, "loss": "inf", "grad_norm": "abc", "rss": -5},
        {"step": 2.0, "rank": 0, "loss": [1]},
        {"collective": None, "bytes": 1.5, "busbw_gbps": "nan"},
        {"collective": "all_reduce", "bytes": 1024, "busbw_gbps": {"a": 1}, "inplace": "yes"},
        {"kind": "measure", "status": "ok", "num_workers": "two", "samples_per_s": 5, "prefetch_factor": "x"},
        {"role": None, "t": "later", "rss": "big"},
        {"step": 3, "rank": 0, "loss": 1.0, "skipped": True},
        "not an object",
    ]
    for stream in ("steps", "comm", "loader", "memwatch", "checkpoint"):
        lines = [json.dumps(r) for r in junk] + ['{"torn": ']
        (run / f"{stream}.jsonl").write_text("\n".join(lines))
    finding = {"probe": "x", "check": "y", "verdict": "warn", "summary": "s", "where": {"step": "not a step"}}
    (run / "findings.json").write_text(json.dumps({"findings": [finding]}))
    result = build_report(RunDir.open(run), analyze=False)
    assert result.overall == "warn"
    html = (run / "report.html").read_text()
    assert 'id="checkpoint"' in html
    assert json.loads(DATA_BLOCK.search(html).group(1))["overall"] == "warn"
