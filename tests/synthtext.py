"""Vectorised JSONL text for the large-run generators (scalesynth, gpusynth): the same bytes an f-string
per line writes, built a column at a time with pyarrow's string kernels.

Why: formatting 10 M step lines and 10 M memwatch lines one f-string at a time took most of the 39 min a
10,000-rank run took to generate on this 2-core machine. Here a number column becomes text in one kernel
call: `fixed(x, 4)` is `f"{x:.4f}"` (its fraction scaled to an integer and rounded; one within 1e-9 of a half
unit, where the scaled product's own rounding could differ from CPython's rounding of the exact binary
value, is formatted by CPython: tests/test_synthtext.py compares both on 200,000 draws), `integers(x)` is
`str(int(x))`, and a line is the pieces joined.

>>> import numpy as np
>>> text([b'{"t":', fixed(np.array([1.5, 2.25]), 4), b',"n":', integers(np.array([3.9, -2.0])), b"}\\n"])
b'{"t":1.5000,"n":3}\\n{"t":2.2500,"n":-2}\\n'
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np
    import pyarrow


def integers(values: np.ndarray) -> pyarrow.Array:
    """str(int(v)) of each value (truncated toward zero, as int() does)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    return pc.cast(pa.array(np.asarray(values).astype(np.int64)), pa.string())


def fixed(values: np.ndarray, decimals: int) -> pyarrow.Array:
    """f"{v:.{decimals}f}" of each (non-negative, finite) value."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    values = np.asarray(values, dtype=np.float64)
    if (values < 0).any() or not np.isfinite(values).all():
        raise ValueError("fixed() formats finite values >= 0 only")
    scaled = _round_half_even(values, decimals)
    whole, frac = np.divmod(scaled, 10**decimals)
    head = pc.cast(pa.array(whole), pa.string())
    tail = pc.utf8_lpad(pc.cast(pa.array(frac), pa.string()), decimals, "0")
    return pc.binary_join_element_wise(head, tail, ".")


def _round_half_even(values: np.ndarray, decimals: int) -> np.ndarray:
    """round(v · 10^decimals) as int64, as `format` rounds: the whole part apart (v − floor(v) is exact),
    and a scaled fraction within 1e-9 of a half unit (where the product's own rounding could decide)
    rounded by `format` itself."""
    import numpy as np

    whole = np.floor(values)
    product = (values - whole) * 10**decimals
    out = whole.astype(np.int64) * 10**decimals + np.rint(product).astype(np.int64)
    for i in np.flatnonzero(np.abs(product - np.floor(product) - 0.5) < 1e-9).tolist():
        out[i] = int(f"{values[i]:.{decimals}f}".replace(".", ""))
    return out


def text(pieces: list[Any], rows: int | None = None) -> bytes:
    """The lines whose pieces are `pieces` (bytes: the same in every line; arrays: one value a line)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    arrays = [p for p in pieces if not isinstance(p, bytes | str)]
    count = len(arrays[0]) if arrays else (rows or 0)
    parts = [
        pa.scalar(p.decode() if isinstance(p, bytes) else p, pa.string()) if isinstance(p, bytes | str) else p
        for p in pieces
    ]
    if not count:
        return b""
    joined = pc.binary_join_element_wise(*parts, "")
    if isinstance(joined, pa.ChunkedArray):
        joined = joined.combine_chunks()
    offsets = joined.buffers()[1]
    import numpy as np

    ends = np.frombuffer(offsets, dtype=np.int32, count=len(joined) + 1, offset=joined.offset * 4)
    return joined.buffers()[2].to_pybytes()[ends[0] : ends[-1]]


def choose(
    mask: np.ndarray, when_true: pyarrow.Array | str, when_false: pyarrow.Array | str
) -> pyarrow.Array:
    """Per line, one text or the other (a field written only every k-th line, null otherwise)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    def arr(x: Any) -> Any:
        return pa.scalar(x, pa.string()) if isinstance(x, str) else x

    return pc.if_else(pa.array(mask), arr(when_true), arr(when_false))
