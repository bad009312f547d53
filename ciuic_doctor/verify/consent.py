"""Whether `verify` may start what RUN recorded, before anything runs or is written.

A signed run (this user's key over the fields verify re-runs: ciuic_doctor/rundir/trust.py) runs
without a question. Anything else, a run recorded by someone else, edited or planted, or one in a folder
another user owns or anyone may write, runs only after verify has shown the exact command line, working
directory and environment and the user said yes: `--yes`, or `y` at the prompt on a terminal. Without
either: one line and exit 2, nothing started.

The rank count verify reads is checked here too: a whole number from 1 to this machine's CPUs (more
ranks than cores only when the user asked with `--nproc`).
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ciuic_doctor.errors import UserError
from ciuic_doctor.render_text import terminal

MAX_RANKS = 131072  # a count above this is no rank count (rundir/hang/shapes.py: the same bound)


@dataclass(kw_only=True)
class Consent:
    """How this verify is allowed to run the job: `yes` given, or `ask` (a terminal prompt) to call."""

    yes: bool = False
    ask: Callable[[str], bool] | None = None
    notes: list[str] = field(default_factory=list)  # why it was asked, for verification.json


def ranks(value: Any, where: str, *, asked: bool = False) -> int:
    """A recorded rank count as an int from 1 to the CPUs here; a UserError naming `where` otherwise."""
    ok = isinstance(value, int) and not isinstance(value, bool)
    if not ok and isinstance(value, float) and value.is_integer():
        value, ok = int(value), True
    if not ok or not 1 <= value <= MAX_RANKS:
        raise UserError(f"{where} = {terminal(repr(value))[:60]}: not a rank count (a whole number from 1)")
    cpus = os.cpu_count() or 1
    if value > cpus and not asked:
        raise UserError(
            f"{where} = {value}: more ranks than this machine's {cpus} CPUs; "
            f"pass --nproc N (N <= {cpus}) to verify on fewer ranks, or --nproc {value} to mean it"
        )
    return value


def describe(argv: list[str], cwd: str | None, env: dict[str, str]) -> str:
    """The command exactly as it would start, escaped for the terminal."""
    shown = f"`{terminal(shlex.join(argv))}` in {terminal(cwd or os.getcwd())}"
    extra = " ".join(f"{terminal(k)}={terminal(shlex.quote(v))}" for k, v in sorted(env.items()))
    return shown + (f" with {extra}" if extra else " with your own environment")


def decide(
    why: list[str],
    what: str,
    run: Path,
    consent: Consent,
    say: Callable[[str], None],
) -> None:
    """Return when it may run: nothing to ask (`why` empty), --yes, or a yes at the prompt; else a
    UserError (one line, exit 2) and nothing has run."""
    if not why:
        return
    reason = "; ".join(why)
    consent.notes = list(why)
    if consent.yes:
        say(f"verify {terminal(run)}: {reason}; running it as you said (--yes): {what}")
        return
    if consent.ask is not None:
        say(f"verify {terminal(run)}: {reason}. It would run {what}")
        if consent.ask("run it? [y/N] "):
            return
        raise UserError(f"verify {run}: not run (you said no)")
    raise UserError(
        f"verify {terminal(run)}: not run: {reason}; it would run {what}; check it and pass --yes to run it"
    )
