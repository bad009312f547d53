"""What `ciuic-doctor hang` says next to what torch's own analyzer (torchfrtrace) says, on the same dumps.

    .venv/bin/python -m pytest tests/test_hang.py --basetemp=/tmp/hang-cases      # makes the five runs
    .venv/bin/python benchmarks/hang_vs_torchfrtrace.py /tmp/hang-cases/*current/*/

For each run directory: our finding (kind, culprit, the culprit's frame, the collective), then
`python -m torch.distributed.flight_recorder.fr_trace RUN/hang.fr --allow-incomplete-ranks` as it is,
then the same on a copy whose pg_config names the default group as the entries do (gloo's dump names it
"" in pg_config and "0" in the entries, and torchfrtrace 2.13 raises KeyError on that), so its own
judgement is shown too.
"""

from __future__ import annotations

import pickle
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from ciuic_doctor.analysis.hang import judge
from ciuic_doctor.rundir.hang.files import load
from ciuic_doctor.rundir.store import RunDir

_JUDGEMENT = re.compile(
    r"Not all ranks|missing ranks|sequence number|^collective:|input sizes|Culprit|[Mm]ismatch|cannot decide"
)


def torchfrtrace(folder: Path) -> str:
    """What torchfrtrace concludes: its error line, or the lines that carry its judgement (each once)."""
    if not folder.is_dir() or not any(folder.iterdir()):
        return "no Flight Recorder dump to read (every rank died before dumping)"
    command = [sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", str(folder)]
    done = subprocess.run(
        [*command, "--allow-incomplete-ranks"], capture_output=True, text=True, timeout=300, check=False
    )
    lines = [line.strip() for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    if done.returncode != 0:
        return f"exit {done.returncode}: {lines[-1] if lines else 'no output'}"
    said = [line for line in dict.fromkeys(lines) if _JUDGEMENT.search(line)]
    return "\n    ".join(said[:6]) or "(no judgement printed)"


def patched_copy(folder: Path, into: Path) -> Path:
    """The dumps with pg_config keyed by the group names the entries use."""
    into.mkdir()
    for dump_file in folder.iterdir():
        dump = pickle.loads(dump_file.read_bytes())
        names = {e["process_group"][0] for e in dump.get("entries", [])}
        config = dump.get("pg_config", {})
        if "" in config and len(names) == 1:
            config[names.pop()] = config.pop("")
        (into / dump_file.name).write_bytes(pickle.dumps(dump))
    return into


def main(runs: list[str]) -> None:
    for path in runs:
        run = RunDir.open(path)
        finding = judge(load(run))[0]
        ev = finding.evidence
        print(f"== {run.path.name}")
        print(
            f"  ours: {ev.get('kind')}: culprits {ev.get('culprit_ranks')}, frame {ev.get('culprit_frame')}"
        )
        print(f"    {finding.summary}")
        folder = run.path / "hang.fr"
        print(f"  torchfrtrace as is:\n    {torchfrtrace(folder)}")
        if folder.is_dir() and any(folder.iterdir()):
            with tempfile.TemporaryDirectory() as tmp:
                patched = torchfrtrace(patched_copy(folder, Path(tmp) / "fr"))
                print(f"  torchfrtrace, pg_config patched:\n    {patched}")


if __name__ == "__main__":
    main(sys.argv[1:])
