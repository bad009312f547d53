"""One stream read into the cache by a second thread while this one reads another.

Why: a report's two big streams are read one after the other, and each read keeps ~1.2 of 2 cores
busy: pyarrow decodes the parts on threads, but each column is then joined and put in stream order on
one (`columnar.read._in_stream_order`). At 10,000 ranks × 1,000 steps memwatch and steps took 2.9 s
each from their columnar copies; read side by side, the joins of one overlap the decoding of the other
(`benchmarks/analysis_stages.py`). The tables are the ones a serial read makes: the same reader, into
the same cache, which the body's later `read_stream` of that stream takes without reading again.

Only a read from a fresh columnar copy is done beside: a first report parses the stream and writes the
copy, and those temporaries side by side with the other stream's took the report's peak from 2,767 to
2,901 MiB (10,000 ranks × 1,000 steps; the goal is 3 GB). That read stays where the caller makes it.

>>> import tempfile, pathlib
>>> from ciuic_doctor.rundir.store import RunDir
>>> folder = pathlib.Path(tempfile.mkdtemp())
>>> _ = (folder / "steps.rank0.jsonl").write_text('{"rank":0,"step":1,"t":1.0}\\n')
>>> run = RunDir.open(folder)
>>> with read_beside(run, "steps"):
...     pass  # read another stream here
>>> from ciuic_doctor.rundir.frames import read_stream
>>> read_stream(run, "steps", ["step"]).table.column("step").to_pylist()
[1]
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ciuic_doctor.rundir.store import RunDir


@contextlib.contextmanager
def read_beside(run: RunDir, stream: str) -> Iterator[None]:
    """`stream` (every column the cache keeps of it) read into the stream cache on a thread while the
    body runs; waited for when the body ends. A failed read is left to the caller's own `read_stream`
    of the stream, which reads it again and says what is wrong; when the body raises (Ctrl-C), the
    thread is not waited for (a daemon: the process may end under it)."""
    from ciuic_doctor.rundir.frames import STREAM_COLUMNS, read_stream
    from ciuic_doctor.rundir.frames.cache import give_back_memory

    if stream not in STREAM_COLUMNS or not run.has_stream(stream):
        yield
        return

    def read() -> None:
        with contextlib.suppress(Exception):  # read again, and reported, by the caller
            if _fresh_copy(run, stream):
                read_stream(run, stream, STREAM_COLUMNS[stream])

    thread = threading.Thread(target=read, name=f"read {stream}", daemon=True)
    thread.start()
    yield
    thread.join()
    give_back_memory()  # what both reads freed, before the caller builds on them


def _fresh_copy(run: RunDir, stream: str) -> bool:
    """Whether `stream` has a columnar copy made from its files as they are now (what `read_stream` will
    read): one listing and an lstat a file (~50 ms at 10,000 files, on this thread), then the manifest."""
    from ciuic_doctor.rundir.frames.cache import _stamp
    from ciuic_doctor.rundir.frames.copies import copy_min_bytes, fresh_manifest

    if copy_min_bytes() < 0:
        return False
    return fresh_manifest(run, stream, _stamp(run.stream_files(stream))[1]) is not None
