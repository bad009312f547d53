"""Sizes and rates, with the units the GUIDE fixes: K/M/G are powers of 1024, GB/s is 1e9 bytes/s.

>>> parse_size("64M")
67108864
>>> format_bytes(1536)
'1.5 KiB'
"""

from __future__ import annotations

import re

from ciuic_doctor.errors import UserError

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b)?\s*$", re.IGNORECASE)
_POWERS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}


def parse_size(text: str | int) -> int:
    """Bytes from `8`, `1K`, `64M`, `1.5G`, `256KiB` (suffixes are powers of 1024, as in nccl-tests).

    Raises UserError with the accepted forms when the text is not a size.
    """
    if isinstance(text, int):
        if text < 0:
            raise UserError(f"size must not be negative: {text}")
        return text
    match = _SIZE.match(text)
    if not match:
        raise UserError(
            f"malformed size {text!r}: expected bytes with an optional K/M/G/T suffix "
            "(powers of 1024), e.g. 1K, 64M, 1G"
        )
    number, suffix = float(match.group(1)), match.group(2).lower()
    value = number * 1024 ** _POWERS[suffix]
    if value != int(value):
        raise UserError(f"size {text!r} is not a whole number of bytes")
    return int(value)


def format_bytes(n: float) -> str:
    """Human-readable size in powers of 1024 (`1.5 KiB`, `64 MiB`); exact below 1 KiB."""
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            # 4 significant digits: 1020 MiB stays "1020 MiB", never "1.02e+03 MiB".
            return f"{sign}{int(n)} B" if unit == "B" else f"{sign}{n:.4g} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def format_size_short(n: int) -> str:
    """nccl-tests-like compact size for table rows and plot ticks: `1K`, `64M`, `3000`."""
    for unit, power in (("G", 3), ("M", 2), ("K", 1)):
        step = 1024**power
        if n >= step and n % step == 0:
            return f"{n // step}{unit}"
    return str(n)
