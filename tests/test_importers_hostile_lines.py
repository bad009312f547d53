"""A log line of blanks is read in time linear in its length, in every text format.

Leading blanks, a launcher prefix and a lazy "anything before the field" matched by three adjacent
quantifiers split a line of N blanks O(N^3) ways: a 2,000-blank line kept `stability` busy for minutes.
The line's head is now matched once (an atomic group), so a 100,000-blank line costs one pass.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap

import logsynth
import logsynth_formats
import pytest

from ciuic_doctor.importers import _text, deepspeed, megatron

FORMATS = ("megatron", "deepspeed", "nanogpt", "torchtitan", "llmc", "modded-nanogpt", "wordlm")


def _log(fmt: str) -> str:
    run = logsynth.make_run(3000 if fmt == "wordlm" else 60)
    return {
        "megatron": lambda: logsynth.megatron_log(run),
        "deepspeed": lambda: logsynth.deepspeed_log(run),
        "nanogpt": lambda: logsynth.nanogpt_log(run),
        "wordlm": lambda: logsynth.wordlm_log(run),
        "torchtitan": lambda: logsynth_formats.torchtitan_log(run),
        "llmc": lambda: logsynth_formats.llmc_main_log(run),
        "modded-nanogpt": lambda: logsynth_formats.modded_log(run),
    }[fmt]()


def test_line_heads_are_atomic():
    """Structure, not timing: every importer regex that starts at a line's beginning takes the blanks and
    launcher prefix in one atomic group, which the engine never re-enters to split them another way."""
    assert _text.LINE_HEAD.startswith("(?>")
    for pattern in (megatron._LINE, megatron._SLOW_HEAD, deepspeed._LINE):
        assert _text.LINE_HEAD in pattern.pattern
        assert r"^[ \t]*" not in pattern.pattern
        assert r"\n[ \t]*" not in pattern.pattern
    # a blank-line match attempt is decided without backtracking into the head: one full-length match
    head = re.compile(r"^" + _text.LINE_HEAD + "x", re.M)
    assert head.search(" " * 100_000 + "\n") is None


@pytest.mark.parametrize(
    "filler", [" " * 100_000, "\t \t" * 33_000, "0: " + " " * 100_000], ids=["blanks", "tabs", "prefixed"]
)
def test_a_100000_blank_line_is_read_in_under_a_second_per_format(tmp_path, filler):
    """Each format, auto-detected and named, reads a log holding one such line. The bound is generous
    (the import of pandas is inside); the cubic head needed hours for this line."""
    paths = []
    for fmt in FORMATS:
        lines = _log(fmt).splitlines()
        path = tmp_path / f"{fmt}.log"
        path.write_text("\n".join([*lines[:5], filler, *lines[5:]]) + "\n")
        paths.append((fmt, str(path)))
    script = textwrap.dedent(
        f"""
        import time
        from pathlib import Path
        from ciuic_doctor.importers import load
        for fmt, path in {paths!r}:
            for name in (fmt, "auto"):
                start = time.perf_counter()
                log = load([Path(path)], name)
                took = time.perf_counter() - start
                assert len(log.table) > 0, (fmt, name)
                print(fmt, name, round(took, 3), flush=True)
                assert took < 1.0 or name == "auto" and took < 3.0, (fmt, name, took)
        """
    )
    # one warm-up import outside the timing: `load` imports pandas on first use
    prelude = "import pandas\n"
    result = subprocess.run(
        [sys.executable, "-c", prelude + script], check=False, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_losses_near_the_float_range_are_judged_without_numpy_warnings(tmp_path):
    """A log alternating ±1.7e308 overflowed numpy's means: RuntimeWarnings reached the user."""
    import warnings

    from ciuic_doctor.analysis.stability import analyze_log
    from ciuic_doctor.importers import load

    big = [1.7e308 if i % 2 else -1.7e308 for i in range(200)]
    lines = [
        f"step: {i}  loss: {big[i]:.6g}  grad_norm: {big[i]:.6g}  memory: 1.0GiB(1.0%)  tps: 1,000"
        for i in range(1, 200)
    ]
    path = tmp_path / "big.log"
    path.write_text("\n".join(lines) + "\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        findings = analyze_log(load([path], "torchtitan"))
    assert findings
