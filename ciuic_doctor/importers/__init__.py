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

if TYPE_CHECKING:
    import pandas as pd

FORMATS: tuple[str, ...] = (
    "ours", "megatron", "deepspeed", "hf", "lightning", "nanogpt", "wordlm", "torchtitan", "llmc",
    "modded-nanogpt",
)  # fmt: skip
_MODULES = {"modded-nanogpt": "modded_nanogpt"}  # a format whose module name differs
COLUMNS: tuple[str, ...] = (
    "step", "rank", "t", "loss", "lr", "grad_norm", "loss_scale", "attempted_scale", "skipped", "nonfinite",
    "interval_steps", "series", "source",
)  # fmt: skip
FLOAT_COLUMNS = ("t", "loss", "lr", "grad_norm", "loss_scale", "attempted_scale")
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


PLACEHOLDERS = ("loss_scale", "grad_norm", "attempted_scale")


def normalize(
    columns: dict[str, Any], *, source: str = "", placeholders: tuple[str, ...] = PLACEHOLDERS
) -> pd.DataFrame:
    """A DataFrame with exactly COLUMNS and their dtypes from whatever subset `columns` holds.

    Anything that is not a number becomes NaN (a row without a step is dropped); counts are clipped at 0,
    intervals at 1, and a rank must be a whole number ≥ 0; the `placeholders` columns' values ≤ 0 are NaN.

    A float64 column given is the table's column as it is (no copy: it may be a read-only view of the
    caller's, e.g. of a pyarrow table), and so is an int64 column whose values already fit; an absent
    float column is one shared read-only NaN array. Integers of at most 2**53 are judged as integers,
    which is what their float64 values give (exact), without the float copy; larger ones take the float
    path, so the table is the same either way (tests/test_importers_columnar.py).
    """
    import numpy as np
    import pandas as pd

    n = max((len(v) for v in columns.values() if hasattr(v, "__len__")), default=0)

    def given(name: str) -> np.ndarray | None:  # numbers as they are (int, float, bool), else float64
        value = columns.get(name)
        if value is None:
            return None
        array = np.asarray(value)
        if array.dtype.kind in "fiub":
            return array
        return pd.to_numeric(pd.Series(value, dtype=object), errors="coerce").to_numpy(
            np.float64, na_value=np.nan
        )

    def number(array: np.ndarray | None, fill: float) -> np.ndarray:
        if array is None:
            return np.full(n, fill, dtype=np.float64)
        return array.astype(np.float64, copy=False)

    step = given("step")
    if _exact_ints(step):  # every int of at most 2**53 is finite and below 2**62
        keep, every = None, True
    else:
        step = number(step, np.nan)
        keep = np.isfinite(step) & (np.abs(step) < 2**62)
        every = bool(keep.all())
    rows = len(step) if every else int(keep.sum())

    def kept(array: np.ndarray) -> np.ndarray:
        return array if every else array[keep]

    def whole(name: str, fill: float, low: int, high: int, dtype: Any) -> np.ndarray:
        """A count, interval or series: NaN/inf as `fill`, clipped to [low, high], as `dtype`."""
        array = given(name)
        if array is None and fill == 0:
            return np.zeros(rows, dtype=dtype)  # calloc'ed: no resident memory until written
        top = min(high, np.iinfo(dtype).max)
        if _exact_ints(array) and (not len(array) or (array.min() >= low and array.max() <= top)):
            return kept(array).astype(dtype, copy=False)  # nothing to clip (else the float path's clip)
        value = np.nan_to_num(kept(number(array, fill)), nan=fill, posinf=fill, neginf=fill)
        return np.clip(value, low, high).astype(dtype)

    rank = given("rank")
    if _exact_ints(rank):
        rank = kept(rank)
        if not len(rank) or (rank.min() >= 0 and rank.max() < 2**31):
            ranks = pd.arrays.IntegerArray(rank.astype(np.int64, copy=False), np.zeros(rows, dtype=bool))
        else:
            valid_rank = (rank >= 0) & (rank < 2**31)
            ranks = pd.arrays.IntegerArray(np.where(valid_rank, rank, 0).astype(np.int64), ~valid_rank)
    else:
        rank = kept(number(rank, np.nan))
        valid_rank = np.isfinite(rank) & (rank >= 0) & (rank == np.round(rank)) & (rank < 2**31)
        ranks = pd.arrays.IntegerArray(np.where(valid_rank, rank, 0).astype(np.int64), ~valid_rank)
    del rank
    missing = None  # one NaN array for every absent float column (read-only: the columns share it)
    floats = {}
    for name in FLOAT_COLUMNS:
        array = given(name)
        if array is None:
            if missing is None:
                missing = np.full(rows, np.nan)
                missing.flags.writeable = False
            floats[name] = missing
        else:
            floats[name] = kept(number(array, np.nan))
        del array
    with np.errstate(invalid="ignore"):
        for name in placeholders:  # a text log's placeholders (-1.0, 0.000): no values
            floats[name] = np.where(floats[name] > 0, floats[name], np.nan)
    # in COLUMNS' order, each column its own block (copy=False): pandas' default stacks the float columns
    # into one 2-D copy, and a reindex copied all of them again (3 copies at once: 1.2 GB at 10,000
    # ranks × 1,000 steps). Under copy-on-write a read-only column is a column like any other.
    return pd.DataFrame(
        {
            "step": kept(step).astype(np.int64, copy=False),
            "rank": ranks,
            **floats,
            "skipped": whole("skipped", 0.0, 0, 2**62, np.int64),
            "nonfinite": whole("nonfinite", 0.0, 0, 2**62, np.int64),
            "interval_steps": whole("interval_steps", 1.0, 1, 2**62, np.int64),
            "series": whole("series", 0.0, 0, 2**15, np.int16),
            "source": pd.Categorical.from_codes(np.zeros(rows, dtype=np.int8), [source]),
        },
        copy=False,
    )


def _exact_ints(array: Any) -> bool:
    """A signed-integer array whose values float64 holds exactly (|value| ≤ 2**53): integer arithmetic on
    it gives what the float path gives."""
    if array is None or array.dtype.kind != "i":
        return False
    return not len(array) or (int(array.min()) >= -(2**53) and int(array.max()) <= 2**53)


def intervals(step, rank=None):  # pandas Series -> Series of steps each row covers
    """Steps since the same rank's previous row; the first row takes the next row's spacing."""
    import pandas as pd

    key = rank.fillna(-1) if rank is not None else pd.Series(0, index=step.index)
    diff = step.groupby(key).diff()
    diff = diff.where(diff > 0)  # a restart (iteration going back) gives no spacing
    following = diff.groupby(key).bfill()
    out = diff.fillna(following).fillna(1)
    first = diff.isna() & step.notna()
    out = out.where(~first | (step >= out), step.clip(lower=1))
    return pd.to_numeric(out, errors="coerce").fillna(1)


def rank_intervals(step: Any, rank: Any = None) -> Any:
    """`intervals` of one step and one rank column (numpy arrays or Series; rank None: one rank), as a
    numpy array. Rows grouped by rank (ranks non-decreasing, watch's per-rank files in rank order) with
    integer steps are done in numpy, without pandas' groupby copies (~10 arrays of the table's length,
    which at 10,000 ranks × 1,000 steps are 80 MB each), with the same result; else `intervals` itself."""
    import numpy as np
    import pandas as pd

    fast = _grouped_intervals(np.asarray(step), None if rank is None else np.asarray(rank))
    if fast is not None:
        return fast
    step = step if isinstance(step, pd.Series) else pd.Series(step)
    rank = rank if rank is None or isinstance(rank, pd.Series) else pd.Series(rank, index=step.index)
    return intervals(step, rank).to_numpy()


def _grouped_intervals(step: Any, rank: Any) -> Any:
    """`intervals` as int64 numpy for integer steps (|step| ≤ 2**52, so that a difference is what float64
    gives) and integer ranks (or None) that never decrease, so each rank's rows are one run; None
    otherwise. A row's interval is its step minus the previous row's in the same run; where there is none
    (a rank's first row, a restart: the step did not grow), the next interval of that rank, else 1, and
    no more than the step itself (at least 1)."""
    import numpy as np

    if step.dtype.kind != "i" or (rank is not None and (rank.dtype.kind != "i" or len(rank) != len(step))):
        return None
    n = len(step)
    if not n:
        return np.zeros(0, dtype=np.int64)
    if int(step.min()) < -(2**52) or int(step.max()) > 2**52:
        return None
    if rank is not None and not (rank[1:] >= rank[:-1]).all():
        return None
    out = np.empty(n, dtype=np.int64)
    out[0] = 0
    np.subtract(step[1:], step[:-1], out=out[1:])
    gap = out <= 0  # no spacing: the first row, a restart
    if rank is not None:
        gap[1:] |= rank[1:] != rank[:-1]  # a rank's first row
    where = np.flatnonzero(gap)
    del gap
    # the next row with a spacing: past the run of consecutive gaps each gap is in
    breaks = np.flatnonzero(np.diff(where) != 1)
    ends = np.append(where[breaks], where[-1])
    runs = np.zeros(len(where), dtype=np.int64)
    runs[breaks + 1] = 1
    after = ends[np.cumsum(runs)] + 1
    inside = after < n
    after[~inside] = 0
    same = inside if rank is None else inside & (rank[after] == rank[where])
    value = np.where(same, out[after], 1)
    at = step[where]
    out[where] = np.where(at >= value, value, np.maximum(at, 1))
    return out


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
    from ciuic_doctor.store import RunDir

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
