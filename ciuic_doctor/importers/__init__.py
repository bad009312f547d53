"""Other frameworks' training logs -> one normalized step table the stability analysis reads.

    load(paths, fmt="auto") -> StepLog      table + lines read / lines that belonged to nothing

The table (a pandas DataFrame, one row per logged step or logging interval, in file order):

    step            int     last optimizer step the row covers (Megatron logs an interval, the others a step)
    rank            Int64   rank that wrote the row, <NA> when the log does not say
    t               float   unix seconds, NaN when the log has no time stamps
    loss            float   training loss (mean over the interval); NaN when absent, or non-finite itself
    lr              float   learning rate
    grad_norm       float   total gradient norm before clipping
    loss_scale      float   dynamic loss scale (fp16); NaN when unknown
    attempted_scale float   the scale the row's first overflow attempted (DeepSpeed prints it): the scale the
                            row started at, which a silent growth since the last overflow has raised; NaN
                            where the log does not say
    skipped         int     optimizer steps the loss scaler skipped in the row (0/1 for a per-step row)
    nonfinite       int     iterations whose loss was NaN/inf (Megatron counts them, drops the loss value)
    interval_steps  int     optimizer steps the row covers (> 1 for Megatron/HF/Lightning logging intervals)
    series          int     which curve the row belongs to: 0, or the engine (DeepSpeed-Chat's actor and
                            critic print `step=N` each) or the separate run (several paths that are not one
                            resumed run); StepLog.series_names names them
    source          str     "<format>:<file name>"

A value a text log prints when it did not compute it is missing, not a number: a loss scale ≤ 0
(Megatron-DeepSpeed's pipeline engine prints `loss scale: -1.0`) and a grad norm ≤ 0 (`grad norm: 0.000`)
become NaN (`normalize(placeholders=...)`). Our own steps stream has no placeholders: watch writes null for
what it did not measure, so a 0.0 (or -0.0) loss or grad norm there is a value, and judged as one.

Formats: `ours` (the steps stream of a run directory), `megatron`, `deepspeed` (+ apex and fairseq
overflow lines), `hf` (trainer_state.json), `lightning` (CSVLogger metrics.csv), `nanogpt` (`iter N: loss
X, time Yms, mfu Z%`), `wordlm` (PyTorch examples word_language_model `| epoch 1 | 200/2983 batches |
... | loss 5.12 |`), `torchtitan` (`step: N  loss: X  grad_norm: G  memory: ...`, ANSI colours and all),
`llmc` (llm.c's main.log `s:N trl:X lr:Y norm:Z` and its stdout), `modded-nanogpt` (`step:N/M
train_loss:X train_time:...`). `auto` sniffs each path.
Every importer survives arbitrary bytes: what it cannot read it counts and skips, and a file with nothing
it recognises ends in one `UserError` line, never a traceback.
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ciuic_doctor.errors import UserError
from ciuic_doctor.importers._table import (  # the common table every importer gives (re-exported)
    COLUMNS,
    FLOAT_COLUMNS,
    PLACEHOLDERS,
    intervals,
    normalize,
    rank_intervals,
)

__all__ = [
    "COLUMNS",
    "FLOAT_COLUMNS",
    "PLACEHOLDERS",
    "StepLog",
    "intervals",
    "load",
    "normalize",
    "rank_intervals",
]

if TYPE_CHECKING:
    import pandas as pd

FORMATS: tuple[str, ...] = (
    "ours", "megatron", "deepspeed", "hf", "lightning", "nanogpt", "wordlm", "torchtitan", "llmc",
    "modded-nanogpt",
)  # fmt: skip
_MODULES = {"modded-nanogpt": "modded_nanogpt"}  # a format whose module name differs
SNIFF_BYTES = 4 << 20  # Megatron prints thousands of argument lines before the first iteration

# What a text log of each kind always contains somewhere (Megatron: the per-interval iteration line;
# DeepSpeed: an overflow, progress or scaler line, with apex's and fairseq's overflow messages).
_MEGATRON_SIGN = re.compile(r"iteration\s+\d+\s*/\s*\d+\s*\|")
_DEEPSPEED_SIGN = re.compile(
    r"OVERFLOW!|step=\d+, skipped=\d+|Gradient overflow\.|overflow detected, setting loss scale"
    r"|loss scale already at minimum|Minimum loss scale reached|\[deepspeed\]|\[deepscale\]"
)
_NANOGPT_SIGN = re.compile(r"^iter \d+: loss [-+0-9.eEnaif]+, time ", re.M)
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")  # colour escapes (torchtitan colours every field)
_WORDLM_SIGN = re.compile(r"^\| epoch +\d+ \| +\d+/ *\d+ batches \|", re.M)
_TORCHTITAN_SIGN = re.compile(r"(?:^|[ \]:-])step: *\d+ +loss: *\S+ +(?:grad_norm: *\S+ +)?memory: ", re.M)
_LLMC_SIGN = re.compile(
    r"^s:\d+ t[re]l:[-+0-9.naif]+|^step +\d+/\d+ \| (?:train )?loss \S+ [^\n]*\| norm ", re.M
)
_MODDED_SIGN = re.compile(r"^step:\d+/\d+ (?:train|val)_loss:\S+ train_time:", re.M)


@dataclass(kw_only=True)
class StepLog:
    """What the importers read: the normalized table and what they had to leave aside.

    `events` holds what is not a step row, e.g. {"kind": "scale_at_minimum", "step": 812} (DeepSpeed's
    fatal "already at minimum"). `min_scale` is the framework's loss-scale floor (Megatron and DeepSpeed 1,
    fairseq 1e-4; None for torch.amp.GradScaler, which has none). `steps_known` is False when a log places
    events only in order (DeepSpeed overflow lines without any `step=` line).

    `eval_loss` holds the (step, loss) pairs of the log's validation lines (HF `eval_loss`, Lightning
    `val_loss`, torchtitan `validate step:`, llm.c `tel:`, nanoGPT/modded-nanogpt `val loss`). `loss_kind`
    says what a row's loss is: "mean" over the logging interval (Megatron, HF, word_language_model) or one
    step's "sample" (torchtitan, llm.c, nanoGPT, Lightning `_step`, DeepSpeed's pipeline): a sampled row
    every 50 steps that doubles is one batch, a mean that doubles hides a far bigger step. `vocab_size`
    is what the log prints (nanoGPT `found vocab_size`, Megatron `padded_vocab_size`): ln of it is the loss
    of a uniform guess. `settings` are the job settings the log prints (Megatron's arguments block,
    DeepSpeed's config dump: batch size, LR, warm-up), shown in the report, never judged as a spec.

    `scaler` is the loss scaler's configuration where the log prints it (importers/_config.py:
    window_steps, hysteresis, min_scale, initial_scale, source "log"); the analysis infers what is missing
    from the skip pattern. `series_names` names the table's series (["actor", "critic"], or the files of
    separate runs); `notes` says what the import had to decide (several engines, runs not merged).
    """

    table: Any  # pandas.DataFrame with COLUMNS
    formats: dict[str, str] = field(default_factory=dict)
    read_lines: int = 0
    unread_lines: int = 0
    events: list[dict[str, Any]] = field(default_factory=list)
    framework: str | None = None
    min_scale: float | None = None
    precision: str | None = None
    clip_max_norm: float | None = None
    steps_known: bool = True
    scaler: dict[str, Any] = field(default_factory=dict)
    series_names: list[str] = field(default_factory=list)
    adversarial: list[str] = field(default_factory=list)  # series that are coupled (GAN) losses
    engines: int = 1
    notes: list[str] = field(default_factory=list)
    eval_loss: list[tuple[int, float]] = field(default_factory=list)
    loss_kind: str = "mean"
    vocab_size: int | None = None
    settings: dict[str, Any] = field(default_factory=dict)

    @property
    def rows(self) -> int:
        return len(self.table)

    def summary(self) -> dict[str, Any]:
        """What was imported, for `--json`, meta.json and the report: format per file, rows, lines."""
        table = self.table
        steps = table["step"] if table is not None and len(table) else None
        return {
            "formats": dict(self.formats),
            "rows": self.rows if table is not None else 0,
            "read_lines": self.read_lines,
            "unread_lines": self.unread_lines,
            "first_step": int(steps.min()) if steps is not None else None,
            "last_step": int(steps.max()) if steps is not None else None,
            "engines": self.engines,
            "series": list(self.series_names) or ["main"],
            "framework": self.framework,
            "precision": self.precision,
            "scaler": dict(self.scaler),
            "min_scale": self.min_scale,
            "steps_known": self.steps_known,
            "events": list(self.events[:100]),
            "notes": list(self.notes),
            "eval_loss": [[int(s), _json_number(v)] for s, v in _thinned(self.eval_loss, 2000)],
            "loss_kind": self.loss_kind,
            "vocab_size": self.vocab_size,
            "settings": dict(self.settings),
            "clip_max_norm": self.clip_max_norm,  # the log's, or `stability --clip`'s: analyze needs it again
        }


def _thinned(points: list, most: int) -> list:
    """At most `most` of `points`, evenly spaced, the last one always kept."""
    if len(points) <= most:
        return list(points)
    every = -(-len(points) // most)
    return [*points[:-1:every], points[-1]]


def _json_number(value: float) -> float | str:
    """NaN/inf as "nan"/"inf" strings (meta.json is strict JSON), finite values as they are."""
    import math

    value = float(value)
    return value if math.isfinite(value) else ("nan" if math.isnan(value) else str(value))


def empty_table() -> pd.DataFrame:
    return normalize({})


def sniff(path: str | Path) -> str:
    """The format of `path`, from its name and its first bytes (UserError when nothing fits)."""
    path = Path(path)
    if path.is_dir():
        return _sniff_dir(path)
    if not path.exists():
        raise UserError(f"{path}: no such file or directory")
    if not path.is_file():  # a FIFO or a device would block the read forever
        raise UserError(f"{path}: not a regular file (a pipe or device cannot be read as a log)")
    name = path.name.lower()
    if name.endswith(".jsonl"):
        return "ours"
    if name == "trainer_state.json":
        return "hf"
    try:
        with open(path, "rb") as fh:
            head = fh.read(SNIFF_BYTES)
    except OSError as exc:
        raise UserError(f"{path}: cannot read ({exc.strerror})") from None
    text = head.decode("utf-8", errors="replace")
    if "\x1b" in text:
        text = ANSI.sub("", text)
    stripped = text.lstrip()
    if stripped.startswith("{") and '"log_history"' in text:
        return "hf"
    if name.endswith(".csv") or _csv_header_has_step(text):
        return "lightning"
    if stripped.startswith("{") and '"step"' in text.split("\n", 1)[0]:
        return "ours"
    if _MEGATRON_SIGN.search(text):
        return "megatron"
    if _TORCHTITAN_SIGN.search(text):
        return "torchtitan"
    if _MODDED_SIGN.search(text):
        return "modded-nanogpt"
    if _LLMC_SIGN.search(text):
        return "llmc"
    if _DEEPSPEED_SIGN.search(text):
        return "deepspeed"
    if _NANOGPT_SIGN.search(text):
        return "nanogpt"
    if _WORDLM_SIGN.search(text):
        return "wordlm"
    raise UserError(f"{path}: not a training log this tool knows (formats: {', '.join(FORMATS)})")


def _csv_header_has_step(text: str) -> bool:
    header = text.split("\n", 1)[0].strip()
    return "," in header and "step" in [c.strip() for c in header.split(",")]


def _sniff_dir(path: Path) -> str:
    from ciuic_doctor.rundir.store import RunDir

    if RunDir(path).has_stream("steps"):
        return "ours"
    if (path / "trainer_state.json").is_file():
        return "hf"
    if (path / "metrics.csv").is_file():
        return "lightning"
    raise UserError(
        f"{path}: a directory without steps.jsonl, trainer_state.json or metrics.csv; "
        "pass the log file itself"
    )


def check_format(fmt: str) -> str:
    if fmt != "auto" and fmt not in FORMATS:
        raise UserError(f"unknown log format {fmt!r}; known formats: auto, {', '.join(FORMATS)}")
    return fmt


def load(paths: str | Path | list[str | Path], fmt: str = "auto") -> StepLog:
    """Read every path (each sniffed when `fmt` is "auto") into one StepLog, in the order given.

    Several paths are one run only when each continues the one before (`continues`): the same format,
    starting after the previous one starts, within reach of where it ended, at the same loss level. Then
    they are concatenated and a later file wins where it repeats a (rank, step), which is what a resumed
    run's second log means. Paths that are not one run are kept apart as series of their own (judged one by
    one) and a note says so: merging two different runs makes a curve that neither of them was.
    """
    check_format(fmt)
    if isinstance(paths, str | Path):
        paths = [paths]
    if not paths:
        raise UserError("no log path given")
    parts = [_load_one(Path(raw), fmt) for raw in paths]
    if len(parts) == 1:
        return parts[0]
    return _combine(parts)


def _load_one(path: Path, fmt: str) -> StepLog:
    kind = sniff(path) if fmt == "auto" else fmt
    if not path.exists():
        raise UserError(f"{path}: no such file or directory")
    if not path.is_file() and not path.is_dir():  # a FIFO named with --format: a read would block forever
        raise UserError(f"{path}: not a regular file (a pipe or device cannot be read as a log)")
    module = importlib.import_module(f"{__name__}.{_MODULES.get(kind, kind)}")
    try:
        part = module.load(path)
    except (OSError, MemoryError) as exc:
        raise UserError(f"{path}: cannot read ({getattr(exc, 'strerror', None) or exc})") from None
    if part.table.empty:
        raise UserError(
            f"{path}: no training steps found as {kind} "
            f"({part.read_lines} lines read, {part.unread_lines} not recognised)"
        )
    part.formats = {str(path): kind}
    return part


RESUME_REACH_STEPS = 1000  # a resumed log may start this far past the previous one's end (lost lines)
RESUME_LOSS_RATIO = 1.5  # and within this factor of the loss the previous one ended at


def continues(before: StepLog, after: StepLog) -> str | None:
    """None when `after` reads as the resumption of `before`, else why not (for the note)."""
    import numpy as np

    kind_a, kind_b = set(before.formats.values()), set(after.formats.values())
    if kind_a != kind_b:
        return f"formats differ ({', '.join(sorted(kind_a))} then {', '.join(sorted(kind_b))})"
    a, b = before.table, after.table
    first_a, last_a, first_b = int(a["step"].min()), int(a["step"].max()), int(b["step"].min())
    if first_b <= first_a:
        return f"the second starts at step {first_b}, not after the first's start (step {first_a})"
    reach = max(RESUME_REACH_STEPS, int(a["interval_steps"].median()) * 10)
    if first_b > last_a + reach:
        return f"the second starts at step {first_b}, {first_b - last_a} steps after the first ends"
    end_a = a.loc[a["step"] >= first_b - reach, "loss"].to_numpy()[-10:]
    start_b = b["loss"].to_numpy()[:10]
    end_a, start_b = end_a[np.isfinite(end_a) & (end_a > 0)], start_b[np.isfinite(start_b) & (start_b > 0)]
    if len(end_a) and len(start_b):
        ratio = float(np.median(start_b) / np.median(end_a))
        if not 1 / RESUME_LOSS_RATIO <= ratio <= RESUME_LOSS_RATIO:
            return f"the loss jumps {ratio:.2f}× where the second begins"
    return None


def _combine(parts: list[StepLog]) -> StepLog:
    """Chain the parts that resume each other; every chain becomes one series."""
    import pandas as pd

    chains: list[list[StepLog]] = [[parts[0]]]
    notes: list[str] = []
    for part in parts[1:]:
        why = continues(chains[-1][-1], part)
        if why is None:
            chains[-1].append(part)
        else:
            names = (next(iter(chains[-1][-1].formats)), next(iter(part.formats)))
            notes.append(f"{names[1]} is not a resumption of {names[0]} ({why}): judged as a separate run")
            chains.append([part])
    tables, names = [], []
    for index, chain in enumerate(chains):
        for part in chain:
            table = part.table
            if len(chains) > 1:  # (engines inside separate runs are not told apart)
                table = table.assign(series=index)
            tables.append(table)
        names.append(Path(next(iter(chain[0].formats))).name)
    frameworks = {p.framework for p in parts if p.framework}
    floors = [p.min_scale for p in parts if p.min_scale is not None]
    table = pd.concat(tables, ignore_index=True)
    table["series"] = table["series"].astype("int16")
    if len(chains) > 1:
        notes.insert(0, f"{len(parts)} paths, {len(chains)} separate runs: each is judged on its own")
    else:
        notes.insert(0, f"{len(parts)} paths read as one resumed run")
    return StepLog(
        table=table,
        formats={k: v for p in parts for k, v in p.formats.items()},
        read_lines=sum(p.read_lines for p in parts),
        unread_lines=sum(p.unread_lines for p in parts),
        events=[
            {**e, "series": i} if len(chains) > 1 else e
            for i, chain in enumerate(chains)
            for p in chain
            for e in p.events
        ],
        framework=frameworks.pop() if len(frameworks) == 1 else ("mixed" if frameworks else None),
        min_scale=max(floors) if floors else None,
        precision=next((p.precision for p in parts if p.precision), None),
        clip_max_norm=next((p.clip_max_norm for p in parts if p.clip_max_norm is not None), None),
        steps_known=all(p.steps_known for p in parts),
        scaler=next((p.scaler for p in parts if p.scaler), {}),
        series_names=names if len(chains) > 1 else list(parts[0].series_names),
        engines=max(p.engines for p in parts),
        notes=notes + [n for p in parts for n in p.notes],
    )
