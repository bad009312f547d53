"""DeepSpeed logs (and the overflow lines of apex and fairseq): what the loss scaler did, step by step.

Lines read (after any python-logging prefix `[date time,ms] [LEVEL] [file.py:line:func] ` and any
launcher prefix `[rank3]: ` / `3: `):

    [deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 65536, reducing to 32768
        (ints since 2023-03, floats such as `128.0, reducing to 64.0` before; `[deepscale]` in 2021 logs)
    [deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 65536, but hysteresis is 2.
        Reducing hysteresis to 1                       (a skip that does not lower the scale)
    Current loss scale already at minimum - cannot decrease scale anymore. Exiting run.   (fatal)
    [Rank 0] step=40, skipped=2, lr=[5e-05], mom=[[0.9, 0.999]]    (every steps_per_print; skipped is
                                                                    cumulative, steps count skipped ones)
    Gradient overflow.  Skipping step, loss scaler 0 reducing loss scale to 32768.0     (apex)
    overflow detected, setting loss scale to: 0.0625                                     (fairseq)
    Minimum loss scale reached (0.0001). ...                                             (fairseq, fatal)
    steps: 40 loss: 7.3121 iter time (s): 0.651 samples/sec: 98.343     (the pipeline engine: the loss)

DeepSpeed's plain engine prints no loss, so the rows carry the scaler's story; the pipeline engine
(PipelineEngine.train_batch, every steps_per_print) prints `steps: N loss: X`, that step's loss averaged over
its micro-batches, which fills the loss column (a step of its own where no `step=` line has it).
Otherwise one row per `step=` line
(skips in the interval, the scale after its last overflow). Overflow lines carry no step, so they are
placed in the interval that ends at the next `step=` line; without any `step=` line each overflow is its
own row numbered in order (`steps_known` False). Several ranks printing the same overflow count once.

The engine's own start line `step=0, skipped=0` covers no step: it is the count's origin, not a row (as a
row it would hide the calibration burst that follows it). Several engines in one process (DeepSpeed-Chat
step 3: actor and critic) each print `step=N` with their own cumulative `skipped`, and their overflow lines
interleave without saying whose they are: the k-th `step=N` line of a rank is engine k, each engine's skip
count per interval comes from its own cumulative count, and each overflow goes to the engine whose scale
it continues (`Attempted loss scale` equal to that engine's last scale, or above it after a silent growth).
Engines are named from the command line where it gives each a learning rate (`--actor_learning_rate`),
matched by their peak LR, else "engine 0", "engine 1".
"""

from __future__ import annotations

import itertools
import math
import re
from dataclasses import dataclass
from pathlib import Path

from ciuic_doctor.importers import SNIFF_BYTES, StepLog, normalize
from ciuic_doctor.importers._config import (
    head_text,
    learning_rate_names,
    megatron_settings,
    precision,
    scaler_config,
)
from ciuic_doctor.importers._text import LINE_HEAD, TIMESTAMP, count_lines, text_chunks

_NUM = r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?"
_LINE = re.compile(
    r"^" + LINE_HEAD + r"(?:\[(?P<ts>" + TIMESTAMP + r")\])?[^\n]*?(?:"
    r"(?P<ovf>(?:OVERFLOW!|overflow!|Overflow detected\.)(?: Rank (?P<orank>\d+))? Skipping step\.?"
    r"(?: Attempted loss scale: (?P<attempted>" + _NUM + r"),? (?:reducing to (?P<reduced>" + _NUM + r")"
    r"|but hysteresis is (?P<hyst>\d+)\. Reducing hysteresis to \d+))?)"
    r"|(?P<min>loss scale already at minimum)"
    r"|(?P<prog>(?:\[Rank (?P<grank>\d+)\] )?step=(?P<gstep>\d+), skipped=(?P<gskipped>\d+)"
    r"(?:, lr=\[(?P<glr>[^\]\n]*)\])?)"
    r"|(?P<apex>Gradient overflow\.\s+Skipping step, (?:loss scaler \d+ )?reducing loss scale to "
    r"(?P<apex_scale>" + _NUM + r"))"
    r"|(?P<fairseq>overflow detected, setting loss scale to: (?P<fs_scale>" + _NUM + r"))"
    r"|(?P<fsmin>Minimum loss scale reached)"
    r"|(?P<pipe>steps: (?P<pstep>\d+) loss: (?P<ploss>" + _NUM + r"|nan|-?inf))"
    r")",
    re.M,
)  # fmt: skip
_FLOORS = {"deepspeed": 1.0, "fairseq": 1e-4, "apex": None}  # DeepSpeed min_loss_scale, fairseq default


@dataclass(kw_only=True)
class _Event:
    kind: str  # overflow | minimum | progress
    rank: float
    t: float
    attempted: float = math.nan
    new_scale: float = math.nan
    step: int = 0
    skipped_total: int = 0
    lr: float = math.nan
    hysteresis: int = 0  # the "but hysteresis is N" of a skip that kept the scale
    engine: int = 0
    loss: float = math.nan  # the pipeline engine's `steps: N loss: X`


def load(path: Path) -> StepLog:
    events: list[_Event] = []
    read = 0
    frameworks: set[str] = set()
    for text in text_chunks(path):
        read += count_lines(text)
        for match in _LINE.finditer(text):
            events.append(_event(match, frameworks))
    pipe = [e for e in events if e.kind == "pipe"]
    events = [e for e in events if e.kind != "pipe"]
    framework = "deepspeed" if "deepspeed" in frameworks or not frameworks else sorted(frameworks)[0]
    log = StepLog(
        table=None,
        read_lines=read,
        unread_lines=read - len(events),
        framework=framework,
        min_scale=_FLOORS.get(framework, 1.0),
    )
    head = head_text(path, SNIFF_BYTES)
    log.precision = precision(head)
    attempted = [e.attempted for e in events if e.kind == "overflow" and math.isfinite(e.attempted)]
    if attempted and log.precision is None:
        log.precision = "fp16"
    log.scaler = scaler_config(head)
    log.settings = megatron_settings(head)
    hysteresis = max((e.hysteresis for e in events if e.kind == "overflow"), default=0)
    if hysteresis and "hysteresis" not in log.scaler:
        log.scaler["hysteresis"] = hysteresis  # "but hysteresis is 2" says it outright
        log.scaler.setdefault("source", "log")
    if attempted and "initial_scale" not in log.scaler:
        log.scaler["initial_scale"] = attempted[0]  # the first overflow tried the scale it started at
        log.scaler.setdefault("source", "log")
    source = f"deepspeed:{path.name}"
    if any(e.kind == "progress" for e in events):
        engines = _assign_engines(events)
        log.engines = engines
        if engines > 1:
            log.series_names = _engine_names(events, engines, head)
            log.notes.append(
                f"{engines} DeepSpeed engines in one log ({', '.join(log.series_names)}): "
                "one series each, judged apart"
            )
            log.table = _by_engine(events, engines, log, source)
        else:
            log.table = _by_progress(events, log, source)
    else:
        log.steps_known = False
        log.table = _by_order(events, log, source)
    if pipe:
        log.table = _with_pipe_losses(log.table, pipe, source)
        log.steps_known = True
        log.loss_kind = "sample"
    return log


def _with_pipe_losses(table, pipe: list[_Event], source: str):
    """The pipeline engine's losses on the rows of their steps; a step without a row becomes one.
    Several ranks (the last pipeline stage of each data-parallel replica) printing one step: the mean."""
    import pandas as pd

    losses = (
        pd.DataFrame(
            {"step": [e.step for e in pipe], "loss": [e.loss for e in pipe], "t": [e.t for e in pipe]}
        )
        .groupby("step", sort=True)
        .agg(loss=("loss", "mean"), t=("t", "first"))
        .reset_index()
    )
    nonfinite = (~losses["loss"].map(math.isfinite)).astype(int)
    if table is None or table.empty or len(table.loc[table["series"] == 0]) == 0:
        spacing = losses["step"].diff().where(lambda d: d > 0)
        return normalize(
            {
                "step": losses["step"], "t": losses["t"], "loss": losses["loss"], "nonfinite": nonfinite,
                "interval_steps": spacing.fillna(spacing.median() if spacing.notna().any() else 1),
            },
            source=source,
        )  # fmt: skip
    by_step = dict(zip(losses["step"], losses["loss"], strict=True))
    bad = dict(zip(losses["step"], nonfinite, strict=True))
    table = table.copy()
    own = table["series"] == 0
    table.loc[own, "loss"] = table.loc[own, "step"].map(by_step).astype("float64")
    table.loc[own, "nonfinite"] = table.loc[own, "step"].map(bad).fillna(0).astype("int64")
    extra = losses[~losses["step"].isin(table.loc[own, "step"])]
    if len(extra):
        gaps = losses["step"].diff().where(lambda d: d > 0)
        spacing = int(gaps.median()) if gaps.notna().any() else 1  # steps_per_print
        bad_extra = (~extra["loss"].map(math.isfinite)).astype(int)
        columns = {"step": extra["step"], "t": extra["t"], "loss": extra["loss"], "nonfinite": bad_extra}
        rows = normalize({**columns, "interval_steps": [spacing] * len(extra)}, source=source)
        table = pd.concat([table, rows], ignore_index=True).sort_values(["step", "series"], kind="stable")
        table = table.reset_index(drop=True)
    return table


def _event(match: re.Match, frameworks: set[str]) -> _Event:
    prefix_rank = match.group(1) or match.group(2)
    t = _stamp(match.group("ts")) if match.group("ts") else math.nan
    if match.group("prog"):
        frameworks.add("deepspeed")
        lrs = match.group("glr") or ""
        return _Event(
            kind="progress",
            rank=_rank(match.group("grank") or prefix_rank),
            t=t,
            step=int(match.group("gstep")),
            skipped_total=int(match.group("gskipped")),
            lr=_float(lrs.split(",")[0]),
        )
    if match.group("ovf"):
        frameworks.add("deepspeed")
        attempted = _float(match.group("attempted"))
        # A hysteresis line skips the step but keeps the scale it attempted.
        new = _float(match.group("reduced")) if match.group("reduced") else attempted
        rank = _rank(match.group("orank") or prefix_rank)
        hysteresis = int(match.group("hyst")) if match.group("hyst") else 0
        return _Event(
            kind="overflow", rank=rank, t=t, attempted=attempted, new_scale=new, hysteresis=hysteresis
        )
    if match.group("pipe"):
        frameworks.add("deepspeed")
        step, loss = int(match.group("pstep")), _float(match.group("ploss"))
        return _Event(kind="pipe", rank=_rank(prefix_rank), t=t, step=step, loss=loss)
    if match.group("apex"):
        frameworks.add("apex")
        scale = _float(match.group("apex_scale"))
        return _Event(kind="overflow", rank=_rank(prefix_rank), t=t, new_scale=scale)
    if match.group("fairseq"):
        frameworks.add("fairseq")
        scale = _float(match.group("fs_scale"))
        return _Event(kind="overflow", rank=_rank(prefix_rank), t=t, new_scale=scale)
    frameworks.add("fairseq" if match.group("fsmin") else "deepspeed")
    return _Event(kind="minimum", rank=_rank(prefix_rank), t=t)


def _float(text: str | None) -> float:
    try:
        return float(text) if text else math.nan
    except ValueError:  # e.g. a learning-rate list that is not numbers
        return math.nan


def _rank(text: str | None) -> float:
    return float(text) if text else math.nan


def _stamp(text: str) -> float:
    from datetime import datetime, timezone

    try:
        return datetime.fromisoformat(text.replace(",", ".")).replace(tzinfo=timezone.utc).timestamp()
    except ValueError:
        return math.nan


def _by_progress(events: list[_Event], log: StepLog, source: str):
    """One row per `step=` line; overflows since the previous one fall into its interval."""
    steps = [e.step for e in events if e.kind == "progress"]
    gaps = sorted(b - a for a, b in itertools.pairwise(steps) if b > a)
    spacing = gaps[len(gaps) // 2] if gaps else 1  # steps_per_print
    has_overflow_lines = any(e.kind == "overflow" for e in events)
    rows: list[dict] = []
    pending: list[_Event] = []
    previous_total: int | None = None
    for event in events:
        if event.kind != "progress":
            pending.append(event)
            continue
        if rows and event.step == rows[-1]["step"]:
            continue  # the same progress line from another rank
        if event.step == 0 and not rows:
            previous_total = event.skipped_total  # the engine's start line: the origin of the count
            continue
        if previous_total is not None and event.skipped_total >= previous_total:
            skipped = event.skipped_total - previous_total
        elif has_overflow_lines:
            skipped = _count(pending)
        elif event.step <= 2 * spacing:
            skipped = event.skipped_total  # a fresh run: every skip so far is in this interval
        else:
            skipped = 0  # resumed with a cumulative count from before this log: unknown, not ours
        interval = event.step - rows[-1]["step"] if rows else min(event.step, spacing)
        rows.append(_row(event, skipped, pending, interval if interval > 0 else spacing))
        _note_minimum(pending, event.step, log)
        previous_total = event.skipped_total
        pending = []
    if pending:  # overflows after the last step= line (a run that died): one more interval
        tail = pending[-1]
        last = _Event(kind="progress", rank=tail.rank, t=tail.t, step=rows[-1]["step"] + spacing)
        rows.append(_row(last, _count(pending), pending, spacing))
        _note_minimum(pending, last.step, log)
    return _frame(rows, source)


def _by_order(events: list[_Event], log: StepLog, source: str):
    """No step= line at all: each rank's k-th overflow is step k (ranks report the same skips)."""
    rows = []
    ordinal: dict[float, int] = {}
    for event in events:
        key = -1.0 if math.isnan(event.rank) else event.rank
        if event.kind == "minimum":
            log.events.append({"kind": "scale_at_minimum", "step": ordinal.get(key, 0) or None, "rank": None})
            continue
        ordinal[key] = ordinal.get(key, 0) + 1
        place = _Event(kind="progress", rank=event.rank, t=event.t, step=ordinal[key])
        rows.append(_row(place, 1, [event], 1))
    return _frame(rows, source)


def _count(pending: list[_Event]) -> int:
    """Skips in an interval: the most any single rank reported (ranks skip the same steps)."""
    per_rank: dict[float, int] = {}
    for event in pending:
        if event.kind == "overflow":
            key = -1.0 if math.isnan(event.rank) else event.rank
            per_rank[key] = per_rank.get(key, 0) + 1
    return max(per_rank.values(), default=0)


def _row(event: _Event, skipped: int, pending: list[_Event], interval: int) -> dict:
    scales = [e.new_scale for e in pending if e.kind == "overflow" and math.isfinite(e.new_scale)]
    return {
        "step": event.step,
        "rank": event.rank,
        "t": event.t,
        "lr": event.lr,
        "loss_scale": min(scales) if scales else math.nan,  # unknown between overflows (growth is silent)
        "attempted_scale": next(
            (e.attempted for e in pending if e.kind == "overflow" and math.isfinite(e.attempted)), math.nan
        ),
        "skipped": skipped,
        "interval": interval,
    }


def _note_minimum(pending: list[_Event], step: int, log: StepLog) -> None:
    if any(e.kind == "minimum" for e in pending):
        log.events.append({"kind": "scale_at_minimum", "step": step, "rank": None})


def _frame(rows: list[dict], source: str):
    keys = ("step", "rank", "t", "lr", "loss_scale", "attempted_scale", "skipped")
    columns = {key: [r[key] for r in rows] for key in keys}
    columns["interval_steps"] = [r["interval"] for r in rows]
    columns["series"] = [r.get("series", 0) for r in rows]
    return normalize(columns, source=source)


# ---- several engines in one log ------------------------------------------------------------------------


def _assign_engines(events: list[_Event]) -> int:
    """Number each progress line's engine (the k-th `step=N` of a rank is engine k); the engine count is
    the most common number of lines a (rank, step) has, so a stray repeat does not make an engine."""
    from collections import Counter

    seen: Counter = Counter()
    for event in events:
        if event.kind == "progress":
            key = (event.rank if math.isfinite(event.rank) else -1.0, event.step)
            event.engine = seen[key]
            seen[key] += 1
    common = Counter(seen.values()).most_common()
    engines = max(common, key=lambda kv: (kv[1], kv[0]))[0] if common else 1
    if engines > 1:  # the same line printed twice (two log handlers) is one engine, not two
        lines: dict[tuple, set] = {}
        for event in events:
            if event.kind == "progress":
                key = (event.rank if math.isfinite(event.rank) else -1.0, event.step)
                lines.setdefault(key, set()).add((event.skipped_total, repr(event.lr)))
        if all(len(told) == 1 for told in lines.values()):
            for event in events:
                event.engine = 0
            return 1
    return max(1, engines)


def _engine_names(events: list[_Event], engines: int, head: str) -> list[str]:
    """Names from `--<name>_learning_rate` on the command line, matched to each engine's peak LR (each
    within 1.5× of its own, one name per engine); else engine 0, engine 1, ..."""
    fallback = [f"engine {i}" for i in range(engines)]
    named = learning_rate_names(head)
    peaks = []
    for engine in range(engines):
        lrs = [e.lr for e in events if e.kind == "progress" and e.engine == engine and math.isfinite(e.lr)]
        peaks.append(max(lrs) if lrs else math.nan)
    if len(named) < engines or not all(math.isfinite(p) and p > 0 for p in peaks):
        return fallback
    names = []
    for peak in peaks:
        name, value = min(named.items(), key=lambda kv: abs(math.log(kv[1] / peak)))
        if abs(math.log(value / peak)) > math.log(1.5) or name in names:
            return fallback
        names.append(name)
    return names


def _by_engine(events: list[_Event], engines: int, log: StepLog, source: str):
    """One row per engine per `step=` line. Each engine's skips in an interval are the rise of its own
    cumulative count; the interleaved overflow lines are given to the engines that have skips left in
    their current interval, each to the one whose scale it continues."""
    progress = [[e for e in events if e.kind == "progress" and e.engine == k] for k in range(engines)]
    quotas = []
    for lines in progress:
        totals = [e.skipped_total for e in lines]
        quotas.append([max(0, b - a) for a, b in zip([0, *totals], totals, strict=False)])
    overflow_ranks = [e.rank for e in events if e.kind == "overflow" and math.isfinite(e.rank)]
    first_rank = min(overflow_ranks) if overflow_ranks else math.nan
    position = [0] * engines  # index of each engine's next progress line
    scale = [math.nan] * engines
    pending: list[list[_Event]] = [[] for _ in range(engines)]
    rows: list[list[dict]] = [[] for _ in range(engines)]
    for event in events:
        if event.kind == "overflow":
            if math.isfinite(event.rank) and event.rank != first_rank:
                continue  # the same skip printed by another rank
            left = [k for k in range(engines) if _quota_left(quotas[k], position[k], pending[k])]
            owner = min(left or range(engines), key=lambda k: _continuity(scale[k], event.attempted))
            pending[owner].append(event)
            if math.isfinite(event.new_scale):
                scale[owner] = event.new_scale
        elif event.kind == "minimum":
            for k in range(engines):
                pending[k].append(event)
        else:
            k = event.engine
            index = position[k]
            position[k] += 1
            if event.step == 0 and index == 0:
                continue  # the engine's start line
            skipped = quotas[k][index] if index < len(quotas[k]) else _count(pending[k])
            previous = rows[k][-1]["step"] if rows[k] else 0
            row = _row(event, skipped, pending[k], max(1, event.step - previous))
            row["series"] = k
            rows[k].append(row)
            _note_minimum(pending[k], event.step, log)
            pending[k] = []
    merged = sorted((r for engine_rows in rows for r in engine_rows), key=lambda r: (r["step"], r["series"]))
    return _frame(merged, source)


def _quota_left(quota: list[int], index: int, pending: list[_Event]) -> bool:
    if index >= len(quota):
        return True  # after the engine's last step= line: overflows of a run that died
    return sum(1 for e in pending if e.kind == "overflow") < quota[index]


def _continuity(scale: float, attempted: float) -> float:
    """How unlikely `attempted` follows an engine at `scale`: 0 when equal, the doublings of a silent
    growth when above (each costs a window of clean steps), far when below (a scale never falls silently)."""
    if not (math.isfinite(scale) and math.isfinite(attempted)) or scale <= 0 or attempted <= 0:
        return 0.5
    rise = math.log2(attempted / scale)
    return rise if rise >= 0 else 100.0 - rise
