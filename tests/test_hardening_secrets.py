"""Secrets never reach a file of the run directory, and hostile names never reach a shell line (issue 11).

The matrix: a spec's [distributed.env] secret keys, secret-named arguments (`--hf-token X`,
`--api-key=X`), a memwatch target's command line, a secret environment value holding `"`, `\\` and
non-ASCII (so its JSON-escaped form differs from the raw one), and a URL password holding `@`. Real
processes write the run (watch, memwatch, report), then every file under it is searched for each secret
in every form it could be written in.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ciuic_doctor.jobs.spec import load_spec
from ciuic_doctor.machine import envinfo
from ciuic_doctor.recommend import Plan
from ciuic_doctor.report import files
from ciuic_doctor.rundir.findings import Recommendation

SPEC_TOKEN = 'hf_SpecEnv"quo\\te-é-1'
SPEC_KEY = "wandb-SpecKey-7788"
ENV_VALUE = 'sk-Env"Va\\lue-ü-42'  # in the environment of watch, and echoed into a plain argument
ARGV_TOKEN = "hf_ArgvSecret123"
ARGV_KEY = "sk-ArgvEquals456"
CMDLINE_TOKEN = "wt_CmdlineSecret789"
URL_PASSWORD = "p@ss@word99"
SECRETS = [SPEC_TOKEN, SPEC_KEY, ENV_VALUE, ARGV_TOKEN, ARGV_KEY, CMDLINE_TOKEN, URL_PASSWORD]


def forms(secret: str) -> set[str]:
    """Every way a file could spell `secret`: raw, JSON with \\uXXXX, JSON with UTF-8, and its tail
    after an @ (a half-redacted URL password)."""
    out = {secret, json.dumps(secret)[1:-1], json.dumps(secret, ensure_ascii=False)[1:-1]}
    if "@" in secret:
        out |= {part for part in secret.split("@")[1:] if len(part) >= 4}
    return out


def assert_no_secret_in(folder: Path) -> None:
    leaks = []
    for path in sorted(folder.rglob("*")):
        if not path.is_file():
            continue
        text = path.read_bytes().decode("utf-8", errors="replace")
        for secret in SECRETS:
            leaks += [f"{path.name}: {form!r}" for form in forms(secret) if form in text]
    assert leaks == []


@pytest.mark.slow
def test_no_secret_reaches_any_file_of_the_run(tmp_path, cli):
    run = tmp_path / "run"
    spec = tmp_path / "spec.toml"
    spec.write_text(
        "[distributed.env]\n"
        f"HF_TOKEN = {json.dumps(SPEC_TOKEN)}\n"
        f'WANDB_API_KEY = "{SPEC_KEY}"\n'
        'NCCL_ALGO = "Ring"\n'
    )
    script = tmp_path / "train.py"
    script.write_text("import sys\nprint('args', len(sys.argv))\n")
    url = f"https://bob:{URL_PASSWORD}@example.com/data"
    watched = cli(
        "watch", "--out", str(run), "--", str(script),
        "--hf-token", ARGV_TOKEN, f"--api-key={ARGV_KEY}", f"--note={ENV_VALUE}", "--data", url,
        env={"MY_SERVICE_TOKEN": ENV_VALUE}, timeout=120,
    )  # fmt: skip
    assert watched.returncode == 0, watched.stderr
    child = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)", "--wandb-token", CMDLINE_TOKEN, url]
    )
    try:
        watched = cli("memwatch", "--pid", str(child.pid), "--duration", "1", "--out", str(run), timeout=60)
        assert watched.returncode == 0, watched.stderr
    finally:
        child.kill()
        child.wait()
    reported = cli("report", str(run), "--spec", str(spec), timeout=180)
    assert reported.returncode in (0, 1), reported.stderr
    # What a probe records of its command line (watch's argv at start, kept after kill -9) goes through
    # the same store: record one here, as it would.
    from ciuic_doctor.rundir.store import RunDir

    hostile_argv = [
        str(script),
        "--hf-token",
        ARGV_TOKEN,
        f"--api-key={ARGV_KEY}",
        f"--note={ENV_VALUE}",
        url,
    ]
    os.environ["MY_SERVICE_TOKEN"] = ENV_VALUE
    try:
        RunDir.open(run).record_probe("hostile", status="running", argv=hostile_argv)
    finally:
        del os.environ["MY_SERVICE_TOKEN"]
    # The run holds what it should, names and all, only without the values.
    argv = json.dumps(json.loads((run / "meta.json").read_text())["probes"]["hostile"]["argv"])
    assert "--hf-token" in argv
    assert "--api-key=<redacted>" in argv
    assert "https://<redacted>@example.com/data" in argv
    events = (run / "memwatch_events.jsonl").read_text()
    assert "--wandb-token <redacted>" in events
    toml = (run / "recommended.toml").read_text()
    assert "HF_TOKEN" not in toml  # not a training setting: the spec's env is allow-listed (rundir/trust.py)
    assert 'NCCL_ALGO = "Ring"' in toml
    assert_no_secret_in(run)


@pytest.mark.parametrize(
    ("text", "gone", "kept"),
    [
        ('"argv":["t.py","--hf-token","hf_abcd1234"]', "hf_abcd1234", "--hf-token"),
        ('"argv":["t.py", "--API_KEY=k3y-v4lue"]', "k3y-v4lue", "--API_KEY="),
        ("python t.py --db-password s3cr3t!x --lr 1", "s3cr3t!x", "--lr 1"),
        ('"HF_TOKEN": "hf_\\"q\\u00e9"', "hf_", '"HF_TOKEN": "<redacted>"'),
        ("export WANDB_API_KEY=abc123xyz", "abc123xyz", "WANDB_API_KEY="),
        ("https://u:p@ss@host/x?y=a@b", "ss@host", "https://<redacted>@host/x?y=a@b"),
        ('{"u": "https://u:pa\\"ss@host/"}', 'pa\\"ss', "https://<redacted>@host/"),
    ],
)
def test_scrub_matrix(text, gone, kept):
    scrubbed = envinfo.scrub(text)
    assert gone not in scrubbed
    assert kept in scrubbed


def test_scrub_finds_env_values_in_their_json_escaped_forms(monkeypatch):
    monkeypatch.setenv("SOME_SECRET", ENV_VALUE)
    record = json.dumps({"note": f"value {ENV_VALUE} here"})
    assert ENV_VALUE not in record  # the raw value is not in the JSON text as written
    assert "<redacted>" in envinfo.scrub(record)
    assert "Va\\\\lue" not in envinfo.scrub(record)
    utf8 = json.dumps({"note": ENV_VALUE}, ensure_ascii=False)
    assert envinfo.scrub(utf8) == '{"note": "<redacted>"}'


def test_redact_argv_hides_values_of_secret_flags():
    argv = ["t.py", "--hf-token", "v1", "--Secret-Key=v2", "--lr", "3", "--password", "--x", "https://a:b@h/"]
    assert envinfo.redact_argv(argv) == [
        "t.py", "--hf-token", "<redacted>", "--Secret-Key=<redacted>", "--lr", "3", "--password", "--x",
        "https://<redacted>@h/",
    ]  # fmt: skip


def test_sourcing_recommended_env_made_from_hostile_names_runs_nothing(tmp_path):
    """A job name and a run name with newlines, quotes and $(...) become comments; every value is
    quoted; a setting that is not a variable name is never exported. Sourced by a real shell."""
    marker = tmp_path / "pwned"
    hostile = f"x\ntouch {marker}\n$(touch {marker}) `touch {marker}` ';touch {marker};'"
    plan = Plan(
        recommendations=[
            Recommendation(
                setting="NCCL_ALGO", value=f"Tree'; touch {marker}; '", why=hostile, confidence="high",
                evidence={"measured": True},
            ),
            Recommendation(
                setting=f"BAD\ntouch {marker}", value="1", why="x", confidence="high",
                evidence={"measured": True},
            ),
            Recommendation(setting="NCCL_PROTO", value=None, why=hostile, confidence="low", evidence={}),
        ]
    )  # fmt: skip
    text = files.env_text(plan, job=hostile, run=hostile)
    env_file = tmp_path / "recommended.env"
    env_file.write_text(text)
    result = subprocess.run(
        ["bash", "-c", f"set -e; source {env_file}; printf '%s' \"$NCCL_ALGO\""],
        check=False,
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={"PATH": os.environ["PATH"]},
        timeout=30,
    )
    assert result.returncode == 0, result.stderr
    assert not marker.exists()
    assert result.stdout == f"Tree'; touch {marker}; '"  # the value, verbatim
    assert "export BAD" not in text


def test_recommended_toml_stays_valid_toml_with_hostile_names():
    import tomllib

    spec = load_spec()
    spec.job.name = 'tiny" = 1 [evil] \\'  # a name with a newline is refused by the spec check itself
    plan = Plan(
        recommendations=[
            Recommendation(setting="NCCL_ALGO", value='Tr"ee\n[x]', why="w", confidence="high", evidence={}),
        ]
    )
    text = files.spec_toml(spec, plan, run='run\n[evil2]\nkey = "v"')
    data = tomllib.loads(text)
    assert "evil" not in data
    assert "evil2" not in data
    assert data["job"]["name"] == spec.job.name
    changes = files.toml_changes(spec, plan)
    assert tomllib.loads(changes)["distributed"]["env"]["NCCL_ALGO"] == 'Tr"ee\n[x]'
