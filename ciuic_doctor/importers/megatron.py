"""Megatron-LM training logs: one ` | `-separated line per logging interval.

    [2024-05-01 12:00:00] iteration      100/  500000 | consumed samples: 51200 | elapsed time per
    iteration (ms): 1254.3 | learning rate: 1.500000E-05 | global batch size: 512 | lm loss: 7.425780E+00 |
    loss scale: 65536.0 | grad norm: 2.345 | number of skipped iterations:   0 | number of nan iterations: 0 |

What varies between versions and runs, and is handled: the time stamp is optional; the learning rate is
`%.3E` before 2024-03 and `%.6E` after; optional fields (throughput, consumed tokens, num zeros, params
norm, MoE and other losses) come and go. The loss is the mean over the interval's applied iterations and is
*absent* when every iteration was skipped, and also when one of them had a NaN loss (Megatron prints only
a loss average > 0), which the `number of nan iterations` field then counts. `grad norm` is the last
iteration's and is absent when that iteration was skipped. bf16 runs print `loss scale: 1.0`.
Megatron-DeepSpeed's pipeline engine writes the loss as `lm-loss:` and prints `loss scale: -1.0` and
`grad norm: 0.000` where it does not compute them (placeholders, read as missing: importers.normalize).
The arguments block at the top (`loss_scale_window ..... 1000`, `hysteresis`, `min_loss_scale`,
`initial_loss_scale`, `fp16`/`bf16`) and a DeepSpeed config dump give the scaler's configuration, and the
job settings it prints (global batch size, LR, warm-up: StepLog.settings); `padded_vocab_size` gives the
uniform-guess loss. `validation loss at iteration N | lm loss value: X |` lines are the eval loss.

Fast path: one regex over a few MB of text at a time, the captures joined into CSV for pandas' C parser
(about 3 µs a line; a big log is split across the usable CPUs). A chunk with an iteration line the regex
did not take goes line by line instead, where fields may come in any order.
"""

from __future__ import annotations

import io
import re
from pathlib import Path

from ciuic_doctor.importers import SNIFF_BYTES, StepLog, intervals, normalize
from ciuic_doctor.importers._config import head_text, megatron_settings, precision, scaler_config
from ciuic_doctor.importers._text import (
    LINE_HEAD,
    TIMESTAMP,
    count_lines,
    map_ranges,
    text_chunks,
    unix_seconds,
)

MIN_SCALE = 1.0  # Megatron's DynamicGradScaler min_scale default
_SKIP = r"(?:[^|\n]*\|)*?"  # any fields in between, lazily
# Lines are found by their leading newline (a literal the regex engine searches for quickly; `^` with
# re.M would be tried at every character), so each chunk is matched with a "\n" put in front.
_LINE = re.compile(
    r"\n" + LINE_HEAD + r"(?:\[(" + TIMESTAMP + r")\][ \t]*)?"
    r"[^\n|]*?\biteration\s+(\d+)\s*/\s*\d+\s*\|"
    + _SKIP + r" learning rate: ([^ |\n]+) \|"
    + r"(?:" + _SKIP + r" lm[ -]loss: ([^ |\n]+) \|)?"
    + r"(?:" + _SKIP + r" loss scale: ([^ |\n]+) \|)?"
    + r"(?:" + _SKIP + r" grad norm: ([^ |\n]+) \|)?"
    + r"(?:" + _SKIP + r" number of skipped iterations: *(\d+) \|)?"
    + r"(?:" + _SKIP + r" number of nan iterations: *(\d+) \|)?",
    re.M,
)  # fmt: skip
_EVAL = re.compile(r"validation loss at iteration (\d+)[^\n|]*\| lm[ -]loss value: ([^ |\n]+)")
_VOCAB = re.compile(
    r"^[ \t]*padded_vocab_size[ \t]+\.+[ \t]+(\d+)"
    r"|padded vocab \(size: \d+\) with \d+ dummy tokens \(new size: (\d+)\)",
    re.M,
)
_COLUMNS = ["rank_a", "rank_b", "ts", "step", "lr", "loss", "loss_scale", "grad_norm", "skipped", "nan"]
_SLOW_HEAD = re.compile(
    r"^" + LINE_HEAD + r"(?:\[(" + TIMESTAMP + r")\][ \t]*)?[^\n|]*?\biteration\s+(\d+)\s*/"
)
_FIELD_NAMES = {
    "learning rate": "lr",
    "lm loss": "loss",
    "lm-loss": "loss",
    "loss scale": "loss_scale",
    "grad norm": "grad_norm",
    "number of skipped iterations": "skipped",
    "number of nan iterations": "nan",
}


def load(path: Path) -> StepLog:
    import pandas as pd

    parts = map_ranges(path, _parse_range)
    columns = pd.concat([frame for frame, _, _, _ in parts], ignore_index=True)
    read = sum(lines for _, lines, _, _ in parts)
    evals = [point for _, _, _, found in parts for point in found]
    used = sum(rows for _, _, rows, _ in parts) + len(evals)
    step, rank = columns["step"], columns["rank"]
    head = head_text(path, SNIFF_BYTES)
    vocab = _VOCAB.search(head)
    return StepLog(
        table=normalize(
            {**{k: columns[k] for k in columns.columns}, "interval_steps": intervals(step, rank)},
            source=f"megatron:{path.name}",
        ),
        read_lines=read,
        unread_lines=read - used,
        framework="megatron",
        min_scale=MIN_SCALE,
        precision=precision(head),
        scaler=scaler_config(head),
        eval_loss=evals,
        vocab_size=int(vocab.group(1) or vocab.group(2)) if vocab else None,
        settings=megatron_settings(head),
    )


def _parse_range(path: Path, start: int, end: int | None):  # -> (DataFrame, lines, rows, eval points)
    """The iteration lines of one byte range as numbers (what a worker sends back is plain arrays)."""
    import pandas as pd

    frames = []
    lines = 0
    evals: list[tuple[int, float]] = []
    for text in text_chunks(path, start, end):
        lines += count_lines(text)
        if "validation loss at iteration" in text:
            evals += [(int(a), _loss_value(b)) for a, b in _EVAL.findall(text)]
        frame = _fast(text)
        frame = _slow(text) if frame is None else frame
        if len(frame):
            frames.append(_numeric(frame))
    if not frames:
        return _numeric(pd.DataFrame(columns=_COLUMNS)), lines, 0, evals
    columns = pd.concat(frames, ignore_index=True)
    return columns, lines, len(columns), evals


def _loss_value(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return float("nan")


def _fast(text: str):  # -> DataFrame | None
    import pandas as pd

    found = _LINE.findall("\n" + text)
    if len(found) != text.count(" learning rate: ") or not _same_fields(text):
        return None  # an iteration line the fast regex could not take: read this chunk line by line
    if not found:
        return pd.DataFrame(columns=_COLUMNS)
    # Captures never hold tabs or newlines (the patterns exclude them): tab-separated CSV is safe.
    csv = "\n".join(map("\t".join, found))
    return pd.read_csv(
        io.StringIO(csv),
        sep="\t",
        header=None,
        names=_COLUMNS,
        dtype={"ts": "str"},
        na_values=["NAN", "-NAN"],  # Megatron's `%E` of NaN (pandas already reads INF)
    )


_OPTIONAL = ((5, (" lm loss: ", " lm-loss: ")), (6, (" loss scale: ",)), (7, (" grad norm: ",)),
             (8, (" number of skipped",)))  # fmt: skip


def _same_fields(text: str) -> bool:
    """The fast regex expects Megatron's field order; check on the chunk's first and last iteration lines
    that every optional field a line has was captured (a fork that prints `lm loss` first would not be)."""
    for pos in (text.find(" learning rate: "), text.rfind(" learning rate: ")):
        if pos < 0:
            continue
        start = text.rfind("\n", 0, pos) + 1
        end = text.find("\n", pos)
        line = text[start : end if end >= 0 else len(text)]
        match = _LINE.match("\n" + line)
        if match is None:
            return False
        for group, names in _OPTIONAL:
            if any(name in line for name in names) != bool(match.group(group)):
                return False
    return True


def _slow(text: str):  # -> DataFrame
    import pandas as pd

    rows = []
    for line in text.split("\n"):
        head = _SLOW_HEAD.match(line)
        if head is None or "|" not in line:
            continue
        row = {"rank_a": head.group(1), "rank_b": head.group(2), "ts": head.group(3), "step": head.group(4)}
        for part in line.split("|")[1:]:
            name, sep, value = part.partition(":")
            key = _FIELD_NAMES.get(name.strip())
            if sep and key:
                row[key] = value.strip()
            elif sep and "loss" not in row and name.strip().endswith(" loss") and "value" not in name:
                row["loss"] = value.strip()  # forks that name the main loss differently
        rows.append(row)
    return pd.DataFrame.from_records(rows, columns=_COLUMNS)


def _numbers(series):  # -> float Series; anything that is not a number becomes NaN
    import pandas as pd

    if series.dtype.kind in "fiu":
        return series.astype("float64")
    return pd.to_numeric(series.astype("str").str.strip(), errors="coerce")


def _numeric(raw):  # captured text -> the table's columns as numbers (intervals come later, over all)
    import numpy as np
    import pandas as pd

    loss = _numbers(raw["loss"])
    nan_iters = _numbers(raw["nan"]).fillna(0)
    # A non-finite average is either printed (inf) or dropped (NaN is not > 0); both count as such.
    loss_bad = (~np.isfinite(loss) & loss.notna()).astype("float64")
    has_time = raw["ts"].notna().any()
    return pd.DataFrame(
        {
            "step": _numbers(raw["step"]),
            "rank": _numbers(raw["rank_a"]).fillna(_numbers(raw["rank_b"])),
            "t": unix_seconds(raw["ts"]) if has_time else np.full(len(raw), np.nan),
            "loss": loss.where(nan_iters <= 0, np.nan),
            "lr": _numbers(raw["lr"]),
            "grad_norm": _numbers(raw["grad_norm"]),
            "loss_scale": _numbers(raw["loss_scale"]),
            "skipped": _numbers(raw["skipped"]).fillna(0),
            "nonfinite": np.maximum(nan_iters.to_numpy(dtype="float64"), loss_bad.to_numpy()),
        }
    )
