"""A stream's schema (ciuic_doctor.rundir.schemas) as pyarrow's JSON reader can check it: validation
column-wise.

`schemas.validate` judges one record at a time (2.05 M calls, 153 s of a 1,024-rank report).
pyarrow's reader, given an explicit type per field, refuses a file in which any value has another JSON
type — the same test `validate` makes of each field, made once per column in C++. So a file that parses
with every field of the stream's schema typed strictly, whose required fields are never null, whose
fields of more than one JSON type (`skipped`: bool or int) were each inferred as one allowed type, and
which holds as many records as lines, holds only records `validate` accepts. Anything else is read
record by record (`frames._read_rows`), which counts what it refuses exactly as the row reader does.

Streams with conditional requirements (comm, loader: a field required only when another has a value)
are always read record by record: they are small (a table of sizes, a sweep), and their records nest.

>>> plan("steps", ("rank", "step")).parse_schema.field("step").type
DataType(int64)
>>> plan("comm", ("bytes",)) is None
True
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pyarrow

# one JSON type (null aside) -> the arrow type that accepts exactly it
_STRICT = {"int": "int64", "number": "float64", "str": "string", "bool": "bool"}
_LISTS = {"ints": "int64", "numbers": "float64"}

# Column types of the fields the analyses read; a column not named here is read as float64.
COLUMN_TYPES = {
    "schema": "int64",
    "t": "float64",
    "host": "string",
    "rank": "int64",
    "step": "int64",
    "pid": "int64",
    "role": "string",
    "kind": "string",
    "skipped": "bool",
    "desync_ranks": "list<int64>",
    "grad_norm_source": "string",
    "nvml_reason": "string",
}


def arrow_type(column: str) -> pyarrow.DataType:
    import pyarrow as pa

    name = COLUMN_TYPES.get(column, "float64")
    if name == "list<int64>":
        return pa.list_(pa.int64())
    return {"int64": pa.int64(), "float64": pa.float64(), "string": pa.string(), "bool": pa.bool_()}[name]


def schema_for(columns: Sequence[str]) -> pyarrow.Schema:
    import pyarrow as pa

    return pa.schema([(c, arrow_type(c)) for c in columns])


def _coerce(value: Any, kind: str) -> tuple[Any, bool]:
    """(value as the column's type, whether it had to be nulled). None stays None and is not counted."""
    if value is None:
        return None, False
    if kind == "float64":
        if isinstance(value, bool):
            return None, True
        if isinstance(value, int | float):
            return float(value), False
        if isinstance(value, str) and value.lower() in ("nan", "inf", "-inf", "infinity", "-infinity"):
            return float(value), False
        return None, True
    if kind == "int64":
        if isinstance(value, bool):
            return None, True
        if isinstance(value, int):  # JSON allows any size; a column holds 64 bits
            return (value, False) if -(2**63) <= value < 2**63 else (None, True)
        if isinstance(value, float) and math.isfinite(value) and value.is_integer():
            return int(value), False
        return None, True
    if kind == "string":
        return (value, False) if isinstance(value, str) else (None, True)
    if kind == "bool":
        return (value, False) if isinstance(value, bool) else (None, True)
    if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return value, False
    return None, True


@dataclass(kw_only=True)
class ReadPlan:
    """How one stream's files are parsed and checked, and how the asked-for columns come out."""

    stream: str | None
    columns: list[str]
    parse_schema: pyarrow.Schema
    unexpected: str  # "ignore", or "infer" when some schema field has more than one JSON type
    not_null: tuple[str, ...] = ()  # required fields, and fields whose schema does not allow null
    inferred: dict[str, frozenset[str]] = field(default_factory=dict)  # field -> allowed JSON types

    def valid(self, table: pyarrow.Table) -> bool:
        """Whether every record of a parsed file fits the schema (the parse itself checked the types)."""
        names = set(table.column_names)
        for name in self.not_null:  # null here: missing or null; `validate` tells them apart
            if name not in names or table.column(name).null_count:
                return False
        for name, allowed in self.inferred.items():
            if name in names and not _fits_type(table.schema.field(name).type, allowed):
                return False
        return self._in_bounds(table)

    def _in_bounds(self, table: pyarrow.Table) -> bool:
        """No schema field holds a finite number beyond ±NUMBER_BOUND, nor a negative measurement that
        cannot be one (schemas.validate refuses both; a file that has any is read row by row instead).

        One min_max pass a column (nulls skipped, NaN ignored: the kernels' rule, which pc.min and pc.max
        follow too) gives all three bounds; only a float column with an infinity in it has its finite
        values' largest magnitude found the long way. The nine passes this took before cost a third of
        the JSON parse (15 ms for 8.4 MB of steps records, parsed in 69 ms; now 3.5 ms).
        """
        import math

        import pyarrow as pa
        import pyarrow.compute as pc

        from ciuic_doctor.rundir.schemas import MAX_WHOLE, NONNEGATIVE, NUMBER_BOUND, SCHEMAS, must_be_finite

        named = SCHEMAS.get(self.stream or "", {})
        nonnegative = NONNEGATIVE.get(self.stream or "", frozenset())
        for column_field in table.schema:
            if column_field.name not in named:
                continue
            kind = column_field.type
            floating = pa.types.is_floating(kind)
            if not (floating or pa.types.is_integer(kind)):
                continue
            column = table.column(column_field.name)
            bounds = pc.min_max(column)
            low, high = bounds["min"].as_py(), bounds["max"].as_py()
            if low is None:  # every value null (or no rows): nothing out of bounds
                continue
            finite_only = floating and must_be_finite(self.stream or "", column_field.name)
            if finite_only and pc.all(pc.is_finite(column)).as_py() is False:
                return False
            if floating and not (math.isfinite(low) and math.isfinite(high)):
                finite = pc.if_else(pc.is_finite(column), pc.abs(column), pa.scalar(0.0, kind))
                magnitude = pc.max(finite).as_py() or 0
            else:
                magnitude = max(abs(low), abs(high))
            if not floating and "number" not in named[column_field.name] and magnitude > MAX_WHOLE:
                return False
            if magnitude > NUMBER_BOUND:
                return False
            if column_field.name in nonnegative and low < 0:
                return False
        return True

    def conform(self, table: pyarrow.Table) -> tuple[pyarrow.Table, dict[str, int]]:
        """The asked-for columns, each in its frames type; a value of another type nulled and counted
        (a free field, or `skipped` written as a count by an imported log), as the row path does."""
        import pyarrow as pa

        out, nulled = {}, {}
        for name in self.columns:
            want = arrow_type(name)
            if name not in table.column_names:
                out[name] = pa.nulls(table.num_rows, type=want)
                continue
            column = table.column(name)
            if column.type == want:
                out[name] = column
            elif pa.types.is_null(column.type) or (
                pa.types.is_integer(column.type) and pa.types.is_floating(want)
            ):
                out[name] = column.cast(want)
            else:
                kind = COLUMN_TYPES.get(name, "float64")
                pairs = [_coerce(v, kind) for v in column.to_pylist()]
                out[name] = pa.array([v for v, _ in pairs], type=want)
                if bad := sum(b for _, b in pairs):
                    nulled[name] = bad
        return pa.table(out), nulled


def _fits_type(kind: pyarrow.DataType, allowed: frozenset[str]) -> bool:
    """Whether every value of an inferred column has a JSON type `allowed` names."""
    import pyarrow as pa

    if pa.types.is_null(kind):
        return True  # every value null or absent: `validate` accepts a missing field and sees null
    if "null" not in allowed:
        return False  # a column holds nulls where a record lacks the field: ambiguous, read by row
    if pa.types.is_boolean(kind):
        return "bool" in allowed
    if pa.types.is_integer(kind):
        return "int" in allowed or "number" in allowed
    if pa.types.is_floating(kind):
        return "number" in allowed
    if pa.types.is_string(kind):
        return "str" in allowed
    if pa.types.is_list(kind):
        return "list" in allowed
    if pa.types.is_struct(kind):
        return "dict" in allowed
    return False


def plan(stream: str | None, columns: Sequence[str]) -> ReadPlan | None:
    """The strict parse of `stream` with `columns` asked for; None when its files are read by record."""
    import pyarrow as pa

    from ciuic_doctor.rundir.schemas import CONDITIONAL, REQUIRED, SCHEMAS

    if stream in CONDITIONAL:
        return None
    schema = SCHEMAS.get(stream or "", {})
    fields: dict[str, Any] = {}
    inferred: dict[str, frozenset[str]] = {}
    not_null = list(REQUIRED.get(stream or "", ()))
    for name, allowed in schema.items():
        kinds = allowed - {"null"}
        if len(kinds) == 1 and (kind := next(iter(kinds))) in _STRICT:
            fields[name] = pa.type_for_alias(_STRICT[kind])
        elif len(kinds) == 1 and kind in _LISTS:
            fields[name] = pa.list_(pa.type_for_alias(_LISTS[kind]))
        else:
            inferred[name] = allowed
            continue
        if "null" not in allowed and name not in not_null:
            not_null.append(name)
    for name in columns:  # a free field asked for: its frames type (a wrong value: the row path nulls it)
        if name not in schema:
            fields[name] = arrow_type(name)
    return ReadPlan(
        stream=stream,
        columns=list(dict.fromkeys(columns)),
        parse_schema=pa.schema(list(fields.items())),
        unexpected="infer" if inferred else "ignore",
        not_null=tuple(not_null),
        inferred=inferred,
    )
