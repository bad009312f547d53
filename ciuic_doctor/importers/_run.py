"""An imported log as a run directory: the normalized rows as the `steps` stream the watch probe writes,
and meta.json["source"] saying where they came from, so `report`, `analyze` and `report --reanalyze`
read an imported log like any other run (GUIDE: "Imported logs and watched scripts are runs like any
other").

    RUN/steps.jsonl   one record per imported row: rank, step, t, loss, lr, grad_norm, loss_scale,
                      attempted_scale, skipped, interval_steps, series, nonfinite (every line the same
                      keys, so importers/ours.py reads it on its fast path); a NaN/inf loss is
                      "nan"/"inf", a loss the log did not print is null; `t` is the log's time stamp,
                      or the import's time where the log prints none (the schema needs one)
    RUN/meta.json     source: {paths, formats, import: StepLog.summary()} (what ours.load restores: the
                      framework, the scaler's configuration, events, engines and series names), observed:
                      {precision, loss_scaler}

A run directory whose steps the watch probe wrote keeps them: only its findings are merged.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ciuic_doctor.importers import StepLog
    from ciuic_doctor.rundir.store import RunDir

STREAM = "steps"


def is_import(run: RunDir) -> bool:
    """True when RUN's steps came from `stability LOG --out RUN` (meta.json["source"]["import"])."""
    source = run.read_meta().get("source")
    return isinstance(source, dict) and isinstance(source.get("import"), dict)


def write_run(run: RunDir, log: StepLog, paths: list[str | Path]) -> bool:
    """Write `log` into RUN as its steps stream and meta.json source; False (nothing written) when RUN
    holds steps of its own (a watched run) or when the log is RUN's own steps stream."""
    resolved = {Path(p).resolve() for p in paths}
    if run.path.resolve() in resolved or (run.has_stream(STREAM) and not is_import(run)):
        return False
    if run.has_stream(STREAM) and (before := _imported_paths(run)) != {str(p) for p in resolved}:
        from ciuic_doctor.errors import UserError

        raise UserError(
            f"{run.path} already holds the import of {', '.join(sorted(before)) or 'another log'}; "
            "give another --out (or import every log in one command); nothing was changed"
        )
    for old in run.stream_files(STREAM):  # the same logs imported again (a new --clip): replaced
        old.unlink()
    summary = log.summary()
    with run.writer(STREAM) as writer:
        for record in _records(log):
            writer.write(record)
    run.update_meta(
        source={
            "paths": [str(p) for p in paths],
            "resolved": sorted(str(p) for p in resolved),  # what a second import into RUN is checked against
            "formats": summary["formats"],
            "import": summary,
        },
        observed={"precision": log.precision, "loss_scaler": dict(log.scaler)},
    )
    return True


def _imported_paths(run: RunDir) -> set[str]:
    """The logs RUN was imported from, resolved (older runs recorded the paths as given)."""
    source = run.read_meta().get("source")
    paths = source.get("resolved") or source.get("paths") if isinstance(source, dict) else None
    return {str(Path(p).resolve()) for p in paths if isinstance(p, str)} if isinstance(paths, list) else set()


def _records(log: StepLog):  # -> Iterator[dict]
    table = log.table
    columns = {
        name: table[name].to_numpy()
        for name in ("step", "t", "loss", "lr", "grad_norm", "loss_scale", "attempted_scale")
    }
    rank = table["rank"].to_numpy(dtype="float64", na_value=math.nan)
    counts = {name: table[name].to_numpy() for name in ("skipped", "nonfinite", "interval_steps", "series")}
    for i in range(len(table)):
        loss = float(columns["loss"][i])
        bad = int(counts["nonfinite"][i])
        record: dict[str, Any] = {
            "t": _value(columns["t"][i]),
            "host": None,  # the log's host is not known; this machine's name would mislead
            "rank": int(rank[i]) if math.isfinite(rank[i]) else None,
            "step": int(columns["step"][i]),
            "loss": loss if math.isfinite(loss) else ("nan" if bad else None),
            "lr": _value(columns["lr"][i]),
            "grad_norm": _value(columns["grad_norm"][i]),
            "loss_scale": _value(columns["loss_scale"][i]),
            "attempted_scale": _value(columns["attempted_scale"][i]),
            "skipped": int(counts["skipped"][i]),
            "interval_steps": int(counts["interval_steps"][i]),
            "series": int(counts["series"][i]),
            "nonfinite": bad,
        }
        if record["t"] is None:  # a log without time stamps: the stream's schema needs a time, so the
            del record["t"]  # writer stamps the import's own (the report then draws the rows)
        yield record


def _value(number: Any) -> float | None:
    value = float(number)
    return value if math.isfinite(value) else None
