"""frames_assemble.Assembler: parts copied into one buffer per column give exactly the table that joining
the parts gives (pyarrow's concat + combine_chunks), whatever the parts: nulls, sliced chunks (an offset
into their buffers), several chunks a part, all-null columns, a wrong row estimate, a rollback."""

from __future__ import annotations

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ciuic_doctor.rundir import frames
from ciuic_doctor.rundir.frames import assemble as frames_assemble
from ciuic_doctor.rundir.frames.assemble import Assembler

SCHEMA = pa.schema(
    [
        ("rank", pa.int64()),
        ("loss", pa.float64()),
        ("skipped", pa.bool_()),
        ("host", pa.string()),
        ("desync_ranks", pa.list_(pa.int64())),
        ("tokens", pa.float64()),  # never filled: the all-null column
    ]
)


@st.composite
def parts(draw: st.DrawFn) -> list[pa.Table]:
    out = []
    for _ in range(draw(st.integers(1, 6))):
        rows = draw(st.integers(0, 40))
        maybe = st.one_of(st.none(), st.integers(-5, 5))
        floats = st.one_of(st.none(), st.floats(allow_nan=True))
        values = {
            "rank": draw(st.lists(maybe, min_size=rows, max_size=rows)),
            "loss": draw(st.lists(floats, min_size=rows, max_size=rows)),
            "skipped": draw(st.lists(st.one_of(st.none(), st.booleans()), min_size=rows, max_size=rows)),
            "host": draw(st.lists(st.one_of(st.none(), st.sampled_from(["a", "b", "node-7"])), min_size=rows,
                                  max_size=rows)),
            "desync_ranks": draw(st.lists(st.one_of(st.none(), st.lists(st.integers(0, 3), max_size=2)),
                                          min_size=rows, max_size=rows)),
            "tokens": [None] * rows,
        }  # fmt: skip
        table = pa.table(values, schema=SCHEMA)
        cut = draw(st.integers(0, rows))
        if draw(st.booleans()):  # slices of a bigger table: chunks whose data starts at an offset
            table = pa.concat_tables([table.slice(0, cut), table.slice(cut)])
        out.append(table)
    return out


def _joined(tables: list[pa.Table]) -> pa.Table:
    return pa.concat_tables(tables).combine_chunks()


def _same(built: pa.Table, tables: list[pa.Table]) -> bool:
    """Equal schema, values and null positions; NaN equals NaN (Table.equals says it does not)."""

    def values(table: pa.Table) -> dict[str, list]:
        return {name: [("nan" if v != v else v) for v in table.column(name).to_pylist()]  # noqa: PLR0124
                for name in table.column_names}  # fmt: skip

    joined, plain = _joined(tables), frames.plain_strings(built)
    return plain.schema.equals(joined.schema) and values(plain) == values(joined)


@settings(max_examples=100, deadline=None)
@given(tables=parts(), estimate=st.sampled_from([0, 1, 10, 10**6]))
def test_assembled_parts_equal_the_joined_parts(tables, estimate):
    table = Assembler(total_bytes=estimate)
    for part in tables:
        table.add(part, nbytes=1)
    built = table.table()
    assert all(column.num_chunks == 1 for column in built.columns)
    if built.column("host").null_count < built.num_rows:  # else an all-null column, as any other
        assert built.column("host").type == pa.dictionary(pa.int32(), pa.string())
    assert _same(built, tables)
    # what the rows' validity says, bit for bit, incl. a column no record fills
    for name in ("rank", "loss", "skipped", "tokens"):
        assert built.column(name).null_count == _joined(tables).column(name).null_count


@settings(max_examples=60, deadline=None)
@given(tables=parts(), keep=st.integers(0, 6), data=st.data())
def test_a_rollback_forgets_exactly_the_rows_after_its_mark(tables, keep, data):
    """A big file whose later piece fails is taken back and read again by row."""
    keep = min(keep, len(tables))
    table = Assembler(total_bytes=10)
    for part in tables[:keep]:
        table.add(part, nbytes=5)
    mark = table.mark()
    for part in data.draw(parts()):  # the file that failed, then what replaces it
        table.add(part, nbytes=5)
    table.rollback(mark)
    for part in tables[keep:]:
        table.add(part, nbytes=5)
    assert _same(table.table(), tables)


def test_a_string_column_of_many_values_is_kept_plain(monkeypatch):
    monkeypatch.setattr(frames_assemble._Strings, "MAX_VALUES", 3)
    tables = [
        pa.table({"host": ["a", "b", None]}),
        pa.table({"host": ["c", "d", "e"]}),
        pa.table({"host": ["f"]}),
    ]
    table = Assembler(total_bytes=0)
    for part in tables:
        table.add(part, nbytes=0)
    built = table.table()
    assert built.column("host").type == pa.string()
    assert _same(built, tables)


def test_a_part_with_other_columns_is_refused():
    table = Assembler(total_bytes=0)
    table.add(pa.table({"rank": [1]}), nbytes=0)
    with pytest.raises(ValueError, match="columns differ"):
        table.add(pa.table({"step": [1]}), nbytes=0)


def test_read_stream_gives_readers_plain_strings_from_an_encoded_cache(tmp_path):
    from ciuic_doctor.rundir.store import RunDir

    for rank in range(3):
        lines = [f'{{"rank":{rank},"step":{s},"host":"node-{rank % 2}","t":{s}.0}}' for s in range(5)]
        (tmp_path / f"steps.rank{rank}.jsonl").write_text("\n".join(lines) + "\n")
    run = RunDir(tmp_path)
    read = frames.read_stream(run, "steps", ("rank", "host"))
    assert read.table.column("host").type == pa.string()
    assert read.table.column("host").to_pylist() == [f"node-{r % 2}" for r in range(3) for _ in range(5)]
    cached = frames._CACHE[(str(tmp_path.resolve()), "steps")][1].table
    assert pa.types.is_dictionary(cached.column("host").type)
    assert read.frame()["host"].tolist() == read.table.column("host").to_pylist()


def test_one_report_reads_one_snapshot_of_a_stream_that_grows_under_it(tmp_path):
    """Inside one_snapshot (a report, run_all) a stream read once is taken as it was, without a second
    listing and stat of its files; a table cached before the snapshot began is checked first (the fuzz
    tests rewrite one folder between reports); outside, every read sees the files as they are."""
    from ciuic_doctor.rundir.store import RunDir

    path = tmp_path / "steps.rank0.jsonl"

    def grow(step: int) -> None:
        with path.open("a") as grown:
            grown.write(f'{{"rank":0,"step":{step},"t":{step}.0}}\n')

    def steps() -> list[int]:
        return frames.read_stream(RunDir(tmp_path), "steps", ("step",)).table.column("step").to_pylist()

    for step in (1, 2, 3):
        grow(step)
    frames.clear_cache()
    assert steps() == [1, 2, 3]  # cached before the snapshot
    grow(4)
    with frames.one_snapshot():
        assert steps() == [1, 2, 3, 4]  # the stale table is not taken: checked, read again
        grow(5)
        assert steps() == [1, 2, 3, 4]  # one snapshot
        with frames.one_snapshot():  # run_all's inside build_report's
            assert steps() == [1, 2, 3, 4]
    assert steps() == [1, 2, 3, 4, 5]
