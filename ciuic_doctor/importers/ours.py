"""Our own steps stream (`RUN/steps.jsonl`, `RUN/steps.rank<R>.jsonl`), written by the watch probe.

One record per rank per optimizer step: rank, step, t, step_time_s, loss, lr, grad_norm, loss_scale,
skipped, plus memory fields this analysis does not read. NaN/inf are stored as the strings "nan"/"inf"
(store.dumps). PATH may be the run directory (every steps file, shared file first then per rank, as
`RunDir.read("steps")` merges them) or one .jsonl file; meta.json beside it gives the job's clip threshold
(`job.optim.clip_max_norm`) and precision (`job.precision.mode`).

Reading is semantically `store.read_jsonl` (a line that is not a JSON object is counted and skipped;
records without a `step` are not step records), made fast for 10^6 lines: our writer emits compact
JSON with the same keys in the same order on every line, so after turning `,` into `:` and dropping the
braces a chunk is a `:`-separated table that pandas' C parser reads at about 2 µs a line. Every row's
wanted keys are checked against the expected key order; a line that differs (other keys, a string with
a comma, a torn last line) is parsed on its own with json. A big file is split across the usable CPUs.
"""

from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path
from typing import Any

from ciuic_doctor.importers import StepLog, normalize, rank_intervals
from ciuic_doctor.importers._text import byte_chunks, map_ranges
from ciuic_doctor.rundir.store import RunDir, as_float

# interval_steps, series, nonfinite, attempted_scale: written by `stability LOG --out RUN` for an imported
# log (a row per logging interval, several engines or runs, NaN counts, the scale an overflow attempted),
# absent from the watch probe's records.
WANTED = ("rank", "step", "t", "loss", "lr", "grad_norm", "loss_scale", "skipped", "clip_max_norm",
          "interval_steps", "series", "nonfinite", "attempted_scale")  # fmt: skip
IMPORTED_ONLY = ("interval_steps", "series", "attempted_scale")
_NUMERIC = ("rank", "step", "t", "loss", "lr", "grad_norm", "loss_scale", "clip_max_norm",
            "interval_steps", "series", "attempted_scale")  # fmt: skip
# watch records the scale update() set after a step, and which optimizer stepped.
WANTED = (*WANTED, "loss_scale_next", "optimizer")
_NUMERIC = (*_NUMERIC, "loss_scale_next", "optimizer")
_FLATTEN = bytes.maketrans(b",", b":")


def load(path: Path) -> StepLog:
    import pandas as pd

    if path.is_dir():
        files = RunDir(path).stream_files("steps")
        meta_dir = path
    else:
        files, meta_dir = [path], path.parent
    parts, read, unread = [], 0, 0
    for file in files:
        frame, lines, bad = _read_file(file)
        parts.append(frame)
        read += lines
        unread += bad
    raw = pd.concat(parts, ignore_index=True) if parts else pd.DataFrame(columns=list(WANTED))
    return to_steplog(raw, read_lines=read, unread_lines=unread, meta_dir=meta_dir, name=path.name)


def to_steplog(raw, *, read_lines: int, unread_lines: int, meta_dir: Path, name: str) -> StepLog:
    """Our step records -> the StepLog: shared by this row reader and the columnar one many-rank runs use
    (ours_columnar), so both judge alike. `raw` maps WANTED's columns (and "nonfinite") to their values:
    this reader's DataFrame, or the columnar reader's numpy arrays (read-only views of its pyarrow table
    where they can be); a column may be absent, or None. Nothing of `raw` is written to or copied that
    the table does not need (at 10,000 ranks × 1,000 steps a column is 80 MB)."""
    import numpy as np

    # what is read and let go first, while nothing of the table is held: a column with nulls is a copy
    clip = _last_number(raw.get("clip_max_norm"))
    series, series_names = _optimizer_series(raw)
    # watch records the scale a step used (loss_scale) and the one update() set after it
    # (loss_scale_next); the table's loss_scale is the latter, as Megatron and DeepSpeed logs print it.
    scale = raw.get("loss_scale")
    next_scale = _numbers(raw.get("loss_scale_next"))
    if next_scale is not None and not np.isnan(next_scale).all():
        before = _numbers(scale)
        scale = next_scale if before is None else np.where(np.isnan(next_scale), before, next_scale)
        del before
    del next_scale
    interval = rank_intervals(raw.get("step"), raw.get("rank"))
    written = _numbers(raw.get("interval_steps"))
    if written is not None and not np.isnan(written).all():  # an imported log's own (its first row: from 0)
        interval = np.where(np.isnan(written), interval, written)
    del written
    columns = {k: raw.get(k) for k in WANTED if k not in ("clip_max_norm", "interval_steps", *_WATCH_ONLY)}
    columns.update(loss_scale=scale, interval_steps=interval)
    if series is not None:
        columns["series"] = series
    del scale, series, interval
    table = normalize(
        columns,
        source=f"ours:{name}",
        placeholders=(),  # watch writes null for what it did not measure: 0.0 is a value
    )
    del columns
    log = StepLog(table=table, read_lines=read_lines, unread_lines=unread_lines, framework="gradscaler")
    log.series_names = series_names
    if clip is not None:  # the watch probe records the max_norm a script passed to clip_grad_norm_
        log.clip_max_norm = clip
    _apply_meta(log, meta_dir)
    if table["loss_scale"].notna().any() and log.precision is None:
        log.precision = "fp16"  # only torch.amp.GradScaler gives a scale
    return log


_WATCH_ONLY = ("loss_scale_next", "optimizer")  # read to build the table, not columns of it


def _numbers(value):  # -> float64 numpy array (a view where it is float64 already) | None
    """A column as `pd.to_numeric(errors="coerce")` reads it, as float64: what the table's float columns
    become (normalize), without a copy of a float64 column."""
    import numpy as np
    import pandas as pd

    if value is None:
        return None
    array = np.asarray(value)
    if array.dtype.kind in "fiub":
        return array.astype(np.float64, copy=False)
    return pd.to_numeric(pd.Series(value, dtype=object), errors="coerce").to_numpy(
        np.float64, na_value=np.nan
    )


def _last_number(value) -> float | None:
    """The column's last value that is a number (not NaN), or None."""
    import numpy as np

    values = _numbers(value)
    if values is None or not len(values):
        return None
    missing = np.isnan(values[::-1])
    at = int(missing.argmin())
    return None if missing[at] else float(values[len(values) - 1 - at])


def _optimizer_series(raw):  # -> (series column | None, names)
    """A watched script with several optimizers (a GAN's D and G, two-phase training) records a step per
    optimizer; each optimizer is a series of its own, judged apart, as several engines in one log are.
    Returns the series column (None: as `raw` has it) and the series' names ([] for one optimizer)."""
    import numpy as np
    import pandas as pd

    optimizer, written = _numbers(raw.get("optimizer")), _numbers(raw.get("series"))
    if optimizer is None or (written is not None and not np.isnan(written).all()):
        return None, []
    del written
    low, high = np.fmin.reduce(optimizer, initial=np.inf), np.fmax.reduce(optimizer, initial=-np.inf)
    if low > high or (low == high and np.isfinite(low)):  # no optimizer index, or one: nothing to hash
        return None, []
    values = pd.unique(optimizer)  # a hash of the few distinct values, not a sorted copy of the column
    found = sorted(int(i) for i in values[~np.isnan(values)])
    if len(found) < 2:
        return None, []
    series = np.zeros(len(optimizer), dtype=np.int64)  # an optimizer not found (0.5) is series 0
    for i, n in {i: n for n, i in enumerate(found)}.items():  # (a repeated index: the last n)
        series[optimizer == i] = n
    return series, [f"optimizer {i}" for i in found]


def _apply_meta(log: StepLog, folder: Path) -> None:
    """Clip threshold and precision from the job spec recorded in meta.json, when there is one; for a run
    written by `stability LOG --out RUN`, what the import knew (meta.json["source"]["import"])."""
    meta = RunDir(folder).read_meta() if (folder / "meta.json").is_file() else {}
    source = meta.get("source") if isinstance(meta, dict) else None
    if isinstance(source, dict) and isinstance(source.get("import"), dict):
        _apply_import(log, source["import"])
    _apply_coupled(log, meta)
    job = meta.get("job") if isinstance(meta, dict) else None
    if not isinstance(job, dict):
        return
    optim, precision = job.get("optim"), job.get("precision")
    if isinstance(optim, dict):
        clip = as_float(optim.get("clip_max_norm"))
        log.clip_max_norm = clip if clip is not None and math.isfinite(clip) else None
    if isinstance(precision, dict) and isinstance(precision.get("mode"), str):
        log.precision = precision["mode"]


def _apply_coupled(log: StepLog, meta: Any) -> None:
    """The optimizers whose losses watch saw coupled (observed.optim.coupled_optimizers: [i, j] = i's loss
    goes through j's parameters, a GAN) are adversarial series: the stability analysis judges them apart."""
    observed = meta.get("observed") if isinstance(meta, dict) else None
    optim = observed.get("optim") if isinstance(observed, dict) else None
    pairs = optim.get("coupled_optimizers") if isinstance(optim, dict) else None
    if not isinstance(pairs, list):
        return
    coupled = {i for pair in pairs if isinstance(pair, list) for i in pair if isinstance(i, int)}
    log.adversarial = [name for name in log.series_names if _index(name) in coupled]


def _index(series_name: str) -> int | None:
    tail = series_name.rsplit(" ", 1)[-1]
    return int(tail) if tail.isdigit() else None


def _apply_import(log: StepLog, summary: dict[str, Any]) -> None:
    """Restore the StepLog facts an imported log's table does not carry (StepLog.to_meta wrote them)."""
    log.formats = {str(k): str(v) for k, v in (summary.get("formats") or {}).items()} or log.formats
    log.framework = summary.get("framework") or log.framework
    log.precision = summary.get("precision") or log.precision
    floor = as_float(summary.get("min_scale"))
    log.min_scale = floor if floor is not None and math.isfinite(floor) else None
    log.steps_known = bool(summary.get("steps_known", True))
    log.scaler = dict(summary.get("scaler") or {})
    log.events = [e for e in summary.get("events") or [] if isinstance(e, dict)]
    names = summary.get("series") or []
    log.series_names = [str(n) for n in names] if len(names) > 1 else []
    log.engines = int(summary.get("engines") or 1)
    log.notes = [str(n) for n in summary.get("notes") or []]
    log.read_lines = int(summary.get("read_lines") or log.read_lines)
    log.unread_lines = int(summary.get("unread_lines") or 0)
    log.eval_loss = _eval_points(summary.get("eval_loss"))
    kind = summary.get("loss_kind")
    log.loss_kind = kind if kind in ("mean", "sample") else log.loss_kind
    vocab = as_float(summary.get("vocab_size"))
    log.vocab_size = int(vocab) if vocab is not None and math.isfinite(vocab) and vocab > 1 else None
    log.settings = dict(summary.get("settings") or {}) if isinstance(summary.get("settings"), dict) else {}
    clip = as_float(summary.get("clip_max_norm"))
    if clip is not None and math.isfinite(clip) and clip > 0:  # else the steps' own (watch's) stands
        log.clip_max_norm = clip


def _eval_points(raw: Any) -> list[tuple[int, float]]:
    """meta.json's [[step, loss], ...] back as pairs; anything else is left out."""
    points = []
    for pair in raw if isinstance(raw, list) else []:
        if not (isinstance(pair, list) and len(pair) == 2):
            continue
        step, loss = as_float(pair[0]), as_float(pair[1])
        if step is not None and loss is not None and math.isfinite(step) and abs(step) < 2**62:
            points.append((int(step), loss))
    return points


def _read_file(path: Path):  # -> (DataFrame, lines, unread lines)
    first = next(byte_chunks(path), b"")
    layout = _layout(first[: 1 << 16]) or _layout(first)
    parts = map_ranges(path, _parse_range, layout)
    frame = pd_concat([p[0] for p in parts])
    return frame, sum(p[1] for p in parts), sum(p[2] for p in parts)


def _parse_range(path: Path, start: int, end: int | None, layout: list[str] | None):
    frames, lines, unread = [], 0, 0
    for chunk in byte_chunks(path, start, end):
        layout = layout or _layout(chunk)
        frame, n_lines, bad = _parse_chunk(chunk, layout)
        frames.append(frame)
        lines += n_lines
        unread += bad
    return pd_concat(frames), lines, unread


def pd_concat(frames: list):  # -> DataFrame with the columns the table needs, even when empty
    import pandas as pd

    frames = [f for f in frames if len(f)]
    if not frames:
        return pd.DataFrame(columns=list(WANTED))
    return pd.concat(frames, ignore_index=True)


def _layout(chunk: bytes) -> list[str] | None:
    """Key order of the first step record in `chunk` (the writer keeps one order for every line)."""
    for line in chunk.split(b"\n", 64)[:64]:
        record = _record(line)
        if record is not None and "step" in record:
            return list(record)
    return None


def _record(line: bytes) -> dict[str, Any] | None:
    try:
        record = json.loads(line)
    except (ValueError, RecursionError):
        return None
    return record if isinstance(record, dict) else None


def _parse_chunk(chunk: bytes, layout: list[str] | None):  # -> (DataFrame, lines, unread)
    import numpy as np
    import pandas as pd

    fast = _fast(chunk, layout) if layout else None
    if fast is not None and fast[1].all():
        return fast[0].drop(columns="line"), len(fast[1]), 0
    lines = chunk.split(b"\n")[:-1]
    if fast is None:
        ok = np.zeros(len(lines), dtype=bool)
        frame = pd.DataFrame(columns=[*WANTED, "line"])
    else:
        frame, ok = fast
    blank = [i for i, line in enumerate(lines) if not line.strip()] if b"\n\n" in chunk else []
    ok[blank] = True  # blank lines: nothing to read, nothing lost
    odd = np.flatnonzero(~ok)
    records = []
    for i in odd:
        record = _record(lines[i])
        if record is not None and "step" in record:
            records.append({**_from_record(record), "line": i})
    unread = len(odd) - len(records)
    if records:
        frame = pd.concat([frame, pd.DataFrame.from_records(records)], ignore_index=True)
        frame = frame.sort_values("line", kind="stable")
    return frame.drop(columns="line"), len(lines) - len(blank), unread


def _fast(chunk: bytes, layout: list[str]):  # -> (DataFrame, ok mask) | None
    """The chunk as a `:`-separated table; None when pandas cannot read it that way."""
    import numpy as np
    import pandas as pd

    position = {key: i for i, key in enumerate(layout)}
    keys = [k for k in WANTED if k in position]
    flat = chunk.translate(_FLATTEN, b"{}")
    table = _read_flat(flat, layout, keys, as_text=False)
    as_text = table is None
    if as_text:  # a "nan" string in a number column (a NaN loss): read those columns as text
        table = _read_flat(flat, layout, keys, as_text=True)
        if table is None:
            return None
    n_lines = len(table)
    ok = np.ones(n_lines, dtype=bool)
    for key in _checked(keys, position):
        ok &= (table[2 * position[key]] == f'"{key}"').to_numpy(dtype=bool, na_value=False)
    out = {"line": np.arange(n_lines)}
    for key in WANTED:
        if key in position:
            out[key] = table[2 * position[key] + 1]
        elif key not in IMPORTED_ONLY:  # (a million NaNs per absent imported-only key is 8 MB each)
            out[key] = np.nan
    frame = pd.DataFrame(out)
    written = (
        pd.to_numeric(frame["nonfinite"].astype("str").str.strip('"'), errors="coerce").fillna(0)
        if "nonfinite" in position
        else 0
    )
    if as_text:
        text = frame["loss"].astype("str").str.strip('" ').str.lower()
        seen = text.isin(["nan", "inf", "-inf", "infinity", "-infinity"]).astype("int64")
        frame["nonfinite"] = np.maximum(seen, written)
        for key in _NUMERIC:
            if key in frame:
                frame[key] = pd.to_numeric(frame[key].astype("str").str.strip('"'), errors="coerce")
    else:
        frame["nonfinite"] = written  # a non-finite loss is a quoted string, which only the text path reads
    if "skipped" in position:
        frame["skipped"] = _skipped(frame["skipped"])
    return frame[ok], ok


def _checked(keys: list[str], position: dict[str, int]) -> list[str]:
    """The key columns compared on every row: every wanted key's, in the layout's order. Comparing only
    the first and the last wanted key missed a line without a middle key and with an extra one in its
    place: both ends stayed where they were and the next key's value went into the missing one's column
    (and a line with two middle keys swapped). Reading every key column costs about a fifth of the parse
    (10^6 lines: 2.5 -> 3.2 s on 2 shared cores; counting each key's occurrences in a chunk instead cost
    more, 2.5 -> 3.9 s)."""
    return sorted(keys, key=position.__getitem__)


def _read_flat(flat: bytes, layout: list[str], keys: list[str], *, as_text: bool):  # -> DataFrame | None
    import pandas as pd

    position = {key: i for i, key in enumerate(layout)}
    usecols, dtype = [], {}
    for key in _checked(keys, position):
        usecols.append(2 * position[key])
        dtype[2 * position[key]] = "category"
    for key in keys:
        usecols.append(2 * position[key] + 1)
        number = "str" if as_text else "float64"
        dtype[2 * position[key] + 1] = "category" if key == "skipped" else number
    usecols.sort()
    try:
        return pd.read_csv(
            io.BytesIO(flat),
            sep=":",
            header=None,
            names=list(range(2 * len(layout))),
            usecols=usecols,
            dtype=dtype,
            skip_blank_lines=False,  # row i is line i
            keep_default_na=False,  # only JSON null is missing; "nan" is a value (and a finding)
            na_values=["null"],
            quoting=csv.QUOTE_NONE,  # quotes are characters: a line can never run into the next one
            lineterminator="\n",  # nor can a stray carriage return split one
            engine="c",
        )
    except (ValueError, pd.errors.ParserError):  # a line with more fields, or text in a number column
        return None


def _skipped(values):  # category Series of "true"/"false"/numbers/NaN -> int Series
    """Map the few distinct values, not a million strings (skipped is a bool, or a count per row)."""
    import numpy as np
    import pandas as pd

    values = values.astype("category")
    lookup = np.array([_count(c) for c in values.cat.categories] + [0], dtype="int64")
    codes = values.cat.codes.to_numpy()  # -1 (missing) indexes the trailing 0
    return pd.Series(lookup[codes], index=values.index)


def _count(value: Any) -> int:
    if isinstance(value, bool):
        return int(value)
    text = str(value).strip().lower()
    if text in ("true", "false"):
        return int(text == "true")
    number = as_float(text)
    return int(number) if number is not None and math.isfinite(number) and number > 0 else 0


def _from_record(record: dict[str, Any]) -> dict[str, Any]:
    """One record parsed by json (the slow path), in the fast path's columns."""
    out = {key: as_float(record.get(key)) for key in _NUMERIC}
    loss = out["loss"]
    out["nonfinite"] = int(loss is not None and not math.isfinite(loss))
    out["skipped"] = _count(record.get("skipped"))
    written = as_float(record.get("nonfinite"))
    if written is not None and math.isfinite(written) and written > out["nonfinite"]:
        out["nonfinite"] = int(written)
    return out
