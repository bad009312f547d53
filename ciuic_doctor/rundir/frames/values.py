"""Arrow columns as numpy: floats with nulls as NaN, whole numbers with where they hold one.

Every reader of the cached tables converts columns through these two, so a null, a NaN or an infinity
means the same thing in the analyses, the report and the live view.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pyarrow


def float_values(column: pyarrow.ChunkedArray, null: float = float("nan")) -> Any:
    """A column as float64 numpy with nulls as `null`: a read-only view of the table's buffer when the
    column is float64 without nulls (pyarrow's fill_null copies even then: 80 MB a column at 10,000
    ranks × 1,000 steps), else one copy.

    >>> import pyarrow as pa
    >>> float_values(pa.chunked_array([[1, None]])).tolist()
    [1.0, nan]
    """
    import pyarrow as pa

    if not pa.types.is_float64(column.type):
        column = column.cast(pa.float64())
    if column.null_count:
        column = column.fill_null(null)
    return column.to_numpy()


def whole_values(column: pyarrow.ChunkedArray) -> tuple[Any, Any]:
    """(the column as int64 numpy, where it holds a number, or None when every row does): an integer
    column's nulls and a float column's NaN and infinities are not numbers and read as 0; a fraction is cut
    to its whole part. An int64 column without nulls comes back as a view of the table's buffer.

    The one reading of rank and step keys that the step grid, the report's step table and the rank blocks
    share.

    >>> import pyarrow as pa
    >>> values, valid = whole_values(pa.chunked_array([[3, None, 5]]))
    >>> values.tolist(), valid.tolist()
    ([3, 0, 5], [True, False, True])
    >>> values, valid = whole_values(pa.chunked_array([[1.9, float("inf")]]))
    >>> values.tolist(), valid.tolist()
    ([1, 0], [True, False])
    >>> whole_values(pa.chunked_array([[7, 8]]))[1] is None
    True
    """
    import numpy as np
    import pyarrow as pa

    if pa.types.is_integer(column.type):
        if not column.null_count:
            return column.to_numpy().astype(np.int64, copy=False), None
        valid = column.is_valid().to_numpy(zero_copy_only=False)
        return column.fill_null(0).to_numpy().astype(np.int64, copy=False), valid
    values = float_values(column)
    finite = np.isfinite(values)
    if finite.all():
        return values.astype(np.int64), None
    return np.where(finite, values, 0).astype(np.int64), finite
