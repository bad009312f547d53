"""Shared pieces of the importers: reading big logs in chunks (in parallel) and launcher line prefixes.

Logs are read in chunks cut at line ends, so a 1,000,000-line log is parsed a few MB at a time with
whole-text regexes and pandas' C parser, and memory stays flat. A file over PARALLEL_BYTES is split into
byte ranges, one per usable CPU (affinity and cgroup quota, envinfo.cpu_budget), each parsed in a forked
worker; a range owns the lines that start in it, so every line is read exactly once. Bytes that are not
UTF-8 become U+FFFD; a carriage return (tqdm progress bars) ends a line like a newline does.
"""

from __future__ import annotations

import itertools
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

CHUNK_BYTES = 8 << 20
PARALLEL_BYTES = 64 << 20  # below this a worker costs more than it saves
MAX_WORKERS = 8

# Line prefixes added by launchers, not by the framework: torchrun `--tee`/`--local-ranks-filter`
# (`[rank3]: `, `[default3]:`), srun --label / pdsh (`3: `).
RANK_PREFIX = r"(?:\[(?:rank|default|RANK)\s*(\d+)\]:[ \t]?|(\d{1,5}):[ \t]+)?"
TIMESTAMP = r"\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d(?:[.,]\d+)?"
# A line's leading blanks and launcher prefix, matched once (an atomic group): three adjacent blank runs
# that may share a line's blanks otherwise split a line of N blanks O(N^2) ways before each of the N
# positions a lazy `[^\n]*?` then tries, and a 2,000-blank line took over 100 s (time ~ N^3).
LINE_HEAD = r"(?>[ \t]*" + RANK_PREFIX + r"[ \t]*)"


def byte_chunks(path: Path, start: int = 0, end: int | None = None) -> Iterator[bytes]:
    """The lines that *start* in [start, end) of `path`, in pieces of about CHUNK_BYTES that each end
    with a newline (one is added after a last line that lacks it)."""
    with open(path, "rb") as fh:
        if start > 0:
            fh.seek(start - 1)
            if fh.read(1) != b"\n":
                fh.readline()  # the line in progress belongs to the range before
        position = fh.tell()
        rest = b""
        while end is None or position < end:
            size = CHUNK_BYTES if end is None else min(CHUNK_BYTES, end - position)
            block = fh.read(size)
            if not block:
                break
            position += len(block)
            data = rest + block
            cut = data.rfind(b"\n")
            if cut < 0:
                rest = data
                continue
            yield data[: cut + 1]
            rest = data[cut + 1 :]
        if rest:
            rest += fh.readline() if end is not None else b""  # finish the line that crosses `end`
            yield rest if rest.endswith(b"\n") else rest + b"\n"


def text_chunks(path: Path, start: int = 0, end: int | None = None) -> Iterator[str]:
    for data in byte_chunks(path, start, end):
        text = data.decode("utf-8", errors="replace")
        yield text.replace("\r\n", "\n").replace("\r", "\n") if "\r" in text else text


def count_lines(text: str) -> int:
    """Lines in a chunk (every chunk ends with a newline)."""
    return text.count("\n")


def workers_for(path: Path) -> int:
    """How many processes to parse `path` with: 1 below PARALLEL_BYTES, else the usable CPUs
    ($CIUIC_IMPORT_WORKERS overrides; 1 turns the parallel reading off)."""
    try:
        size = path.stat().st_size
    except OSError:
        return 1
    wanted = os.environ.get("CIUIC_IMPORT_WORKERS", "")
    if size < PARALLEL_BYTES or wanted == "1":
        return 1
    if wanted.isdigit() and int(wanted) > 0:
        usable = int(wanted)
    else:
        from ciuic_doctor.machine.envinfo import cpu_budget

        usable = cpu_budget()["usable"]
    return max(1, min(usable, MAX_WORKERS, size // CHUNK_BYTES))


def map_ranges(path: Path, parse: Callable[..., Any], *args: Any) -> list[Any]:
    """`parse(path, start, end, *args)` over byte ranges of `path`, in file order.

    One range (in this process) for a small file or a single usable CPU; otherwise one range per
    worker in forked processes (`parse` must be a module-level function; its result is pickled back).
    """
    workers = workers_for(path)
    if workers == 1:
        return [parse(path, 0, None, *args)]
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    size = path.stat().st_size
    bounds = [size * i // workers for i in range(workers + 1)]
    context = multiprocessing.get_context(
        "fork" if "fork" in multiprocessing.get_all_start_methods() else None
    )
    with ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
        futures = [pool.submit(parse, path, a, b, *args) for a, b in itertools.pairwise(bounds)]
        return [f.result() for f in futures]


def unix_seconds(stamps):  # pandas Series of str -> float seconds (NaN where absent)
    """`2024-05-01 12:00:00(.123|,123)` -> unix seconds; naive stamps are read as UTC."""
    import pandas as pd

    first = stamps.dropna()
    plain = len(first) and re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", str(first.iloc[0]))
    if plain:  # the common case, parsed by pandas' fast path for an exact format
        parsed = pd.to_datetime(stamps, format="%Y-%m-%d %H:%M:%S", errors="coerce", utc=True)
    else:
        text = stamps.astype("str").str.replace(",", ".", regex=False)
        parsed = pd.to_datetime(text, format="ISO8601", errors="coerce", utc=True)
    seconds = (parsed - pd.Timestamp(0, tz="UTC")).dt.total_seconds()
    return seconds.astype("float64")


NUMBER = r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?|[-+]?nan|NaN|[-+]?inf"
EVAL_POINTS_MAX = 10_000  # eval losses kept (a run evaluates every few hundred steps: ample)


def line_format(
    pattern: str,
    *,
    name: str,
    framework: str,
    eval_pattern: str | None = None,
    loss_kind: str = "mean",
    eval_as_loss: bool = False,
) -> Callable[[Path], Any]:
    """An importer's `load(path)` for a plain-text log whose training rows one regex reads (after any
    launcher prefix): see read_rows for the groups it needs. `eval_pattern` reads the eval-loss lines
    (groups `loss` and, where the line has one, `step`); `loss_kind` says whether a row's loss is one step's
    ("sample") or the mean over the logging interval ("mean"); with `eval_as_loss`, a log that prints no
    training loss at all is judged on its eval loss (the one loss curve it has), and a note says so."""
    head = r"^" + LINE_HEAD
    line = re.compile(head + pattern, re.M)
    evals = re.compile(head + eval_pattern, re.M) if eval_pattern else None

    def load(path: Path):  # -> StepLog
        log = read_rows(path, line, source=f"{name}:{path.name}", framework=framework, eval_line=evals)
        log.loss_kind = loss_kind
        if eval_as_loss and log.eval_loss and not log.table["loss"].notna().any():
            log = _eval_as_rows(log, source=f"{name}:{path.name}")
        return log

    return load


def read_rows(
    path: Path, line: re.Pattern, *, source: str, framework: str, eval_line: re.Pattern | None = None
):  # -> StepLog
    """A plain-text log with one regex a training row: groups `step` (or `epoch` + `batch` + `batches`),
    `loss`, and optionally `lr` and `grad_norm` (a second spelling of a line may use `step2`, `loss2`,
    `lr2`, `grad_norm2`); `loss nan`/`inf` is counted as non-finite. ANSI colour escapes are removed first.
    Eval lines (`eval_line`) give StepLog.eval_loss; one without a step belongs to the last training step
    before it. Logs people paste in bug reports are small, so this reads the whole file in chunks with
    one regex and no fast path."""
    import math

    from ciuic_doctor.importers import ANSI, StepLog, intervals, normalize

    columns: dict[str, list] = {
        "step": [],
        "rank": [],
        "loss": [],
        "lr": [],
        "grad_norm": [],
        "nonfinite": [],
    }
    evals: list[tuple[int, float]] = []
    read = eval_lines = 0
    for chunk in text_chunks(path):
        read += count_lines(chunk)
        text = ANSI.sub("", chunk) if "\x1b" in chunk else chunk
        rows = [(m.start(), "train", m) for m in line.finditer(text)]
        if eval_line is not None:
            rows += [(m.start(), "eval", m) for m in eval_line.finditer(text)]
            rows.sort(key=lambda row: row[0])
        for _, kind, match in rows:
            found = match.groupdict()
            if kind == "eval":
                eval_lines += 1
                last = columns["step"][-1] if columns["step"] else 0
                step = int(found["step"]) if found.get("step") is not None else last
                if len(evals) < EVAL_POINTS_MAX:
                    evals.append((step, _float(found.get("loss"))))
                continue
            step = _step(found)
            raw_loss = found.get("loss") if found.get("loss") is not None else found.get("loss2")
            loss = _float(raw_loss)
            columns["step"].append(step)
            columns["rank"].append(_float(match.group(1) or match.group(2)))
            columns["loss"].append(loss)
            columns["lr"].append(_float(found.get("lr") or found.get("lr2")))
            columns["grad_norm"].append(_float(found.get("grad_norm") or found.get("grad_norm2")))
            columns["nonfinite"].append(int(not math.isfinite(loss) and raw_loss is not None))
    import pandas as pd

    step_series = pd.Series(columns["step"], dtype="float64")
    rank_series = pd.Series(columns["rank"], dtype="float64")
    columns["interval_steps"] = intervals(step_series, rank_series).tolist() if len(step_series) else []
    table = normalize(columns, source=source)
    used = len(table) + eval_lines
    return StepLog(
        table=table, read_lines=read, unread_lines=max(0, read - used), framework=framework, eval_loss=evals
    )


def _step(found: dict[str, Any]) -> int:
    if found.get("step") is not None:
        return int(found["step"])
    if found.get("step2") is not None:
        return int(found["step2"])
    return (int(found["epoch"]) - 1) * int(found["batches"]) + int(found["batch"])


def _eval_as_rows(log, *, source: str):  # StepLog -> StepLog
    """The eval losses as the rows of a log that prints no training loss (later modded-nanogpt records)."""
    import math

    from ciuic_doctor.importers import normalize

    steps = [s for s, _ in log.eval_loss]
    losses = [v for _, v in log.eval_loss]
    spacing = [b - a if b > a else 1 for a, b in zip([0, *steps], steps, strict=False)]
    log.table = normalize(
        {
            "step": steps,
            "loss": losses,
            "nonfinite": [int(not math.isfinite(v)) for v in losses],
            "interval_steps": spacing,
        },
        source=source,
    )
    log.loss_kind = "sample"
    log.notes.append("the log prints no training loss: judged on its validation loss")
    return log


def _float(text: str | None) -> float:
    try:
        return float(text) if text is not None else float("nan")
    except ValueError:
        return float("nan")
