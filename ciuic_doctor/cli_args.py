"""Argument helpers shared by several sub-commands.

Every number a user types is checked here, once, with one clear line when it is wrong: `inf`, `nan` and
`1e308` are refused before they reach `time.sleep`, `timedelta` or a size loop, where they raised
OverflowError.

>>> positive_float("0.5")
0.5
>>> positive_float("inf")
Traceback (most recent call last):
argparse.ArgumentTypeError: must be a finite number, got 'inf'
"""

from __future__ import annotations

import argparse
import math
from typing import Any

# The largest number any option takes: 1e9 s is 31 years, 1e9 steps or calls more than any run makes.
# Larger values only ever overflowed (timedelta(seconds=1e308), time.sleep(1e308)).
MAX_OPTION_VALUE = 1e9


def add_out(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--out",
        metavar="RUN",
        help="run directory to write into (default: reports/<time>-<command>; created if missing). "
        "A folder that is not empty and not a run directory is refused unless --force",
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help="write into --out even when it is a non-empty folder that is not a run directory "
        "(its files with run-directory names, such as summary.md or report.html, may be replaced)",
    )


def _checked(value: float, text: str, *, minimum: float, inclusive: bool) -> None:
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    if value > MAX_OPTION_VALUE:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_OPTION_VALUE:g}, got {text}")
    if value < minimum or (value == minimum and not inclusive):
        bound = f"at least {minimum:g}" if inclusive else f"greater than {minimum:g}"
        raise argparse.ArgumentTypeError(f"must be {bound}, got {text}")


def _whole(text: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    _checked(value, text, minimum=minimum, inclusive=True)
    return value


def positive_int(text: str) -> int:
    """A whole number from 1 to 1e9."""
    return _whole(text, 1)


def non_negative_int(text: str) -> int:
    """A whole number from 0 to 1e9."""
    return _whole(text, 0)


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def positive_float(text: str) -> float:
    """A finite number greater than 0 and at most 1e9 (`inf`, `nan`, `1e308` are refused)."""
    value = _float(text)
    _checked(value, text, minimum=0.0, inclusive=False)
    return value


def non_negative_float(text: str) -> float:
    """A finite number from 0 to 1e9."""
    value = _float(text)
    _checked(value, text, minimum=0.0, inclusive=True)
    return value


def add_set(parser: argparse.ArgumentParser, what: str) -> None:
    """`--set KEY=VALUE` (repeatable, into args.set_items): one setting changed for the run; `what` says
    which keys the command takes. checkup and watch declare it here, so the two read the same."""
    parser.add_argument(
        "--set",
        dest="set_items",
        metavar="KEY=VALUE",
        action="append",
        default=[],
        help=f"{what} (job-spec key, TOML value; repeatable)",
    )


def add_parallel(parser: argparse.ArgumentParser) -> None:
    """--jobs and --scheduler: where the report's per-block checks run (`ciuic_doctor.parallel`)."""
    group = parser.add_argument_group("where the report's checks run")
    group.add_argument(
        "--jobs",
        type=positive_int,
        metavar="N",
        help="worker processes for the per-block checks and, on a big job, the analyses after them and "
        "the page's job section (default: every usable core; 1: one core). The findings are the same to "
        "the bit",
    )
    group.add_argument(
        "--scheduler",
        metavar="ADDRESS",
        help="run the per-block checks on this Dask scheduler's workers, e.g. tcp://host:8786 "
        "(pip install 'ciuic-doctor[dask]'; ciuic_doctor/parallel/README.md: workers on Slurm)",
    )


def parallel_from_args(args: argparse.Namespace) -> Any:
    """The context the command's report is built in: `parallel.using(jobs, scheduler)`; a scheduler that
    does not answer is refused here, with one line, before anything runs."""
    from ciuic_doctor.parallel import using

    return using(jobs=getattr(args, "jobs", None), scheduler=getattr(args, "scheduler", None))
