"""The columnar copy of a run's big streams (steps, memwatch): read once from JSONL, then from Parquet.

At 10,000 ranks × 1,000 steps a report spent ~57 of its seconds parsing 9 GB of JSON; every report of
the run parsed it again. The first report that reads a big stream from JSONL writes what it read (every
valid record, typed as the analyses read it, with the reader's counts of what it dropped) as a
partitioned Parquet dataset under RUN/columnar/<stream>/, one part per 1,024 ranks; later reports read
that instead, as long as every source file still has the size and mtime the manifest records (a run
that grew is read from its JSONL again, and its copy rewritten). The layout is plain Hive partitioning,
readable as it is by DuckDB or pyarrow.dataset (README.md here).

    write.save(run_path, stream, sources, table, counts)      after a JSONL read: its manifest, or why not
    layout.read_manifest(run_path, stream)                     the copy's manifest (its `sources` are
                                                              compared with the files' lstat by the reader)
    read.load(run_path, manifest, columns)                    the whole stream, in its order
    read.read_ranks(run_path, stream, ranks, columns, copy_id=...)   one block's rows, where the run is

A copy is data like every file of a run: its manifest is parsed field by field (`layout.parse_manifest`),
its parts are opened without following symlinks and checked against the manifest (rows, types, row
places), and anything that does not match sends the report back to the JSONL.
"""

from ciuic_doctor.rundir.columnar.layout import RANKS_PER_PART, Counts, Manifest, read_manifest, stream_dir
from ciuic_doctor.rundir.columnar.read import StaleCopy, load, load_any_order, read_ranks
from ciuic_doctor.rundir.columnar.write import save

__all__ = [
    "RANKS_PER_PART",
    "Counts",
    "Manifest",
    "StaleCopy",
    "load",
    "load_any_order",
    "read_manifest",
    "read_ranks",
    "save",
    "stream_dir",
]
