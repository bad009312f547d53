"""The run directory: every file format of ciuic-doctor lives here and only here.

    reports/<run>/meta.json            run id, created, tool version, environment, job spec, probes run
    reports/<run>/<stream>.jsonl       one JSON object a line, appended and flushed per record
    reports/<run>/<stream>.rank<R>.jsonl   the same, one file per rank (steps, memory of a rank)
    reports/<run>/findings.json        analysis output (see ciuic_doctor.rundir.findings)

Writers append whole lines with O_APPEND and flush each one, so a job killed with SIGKILL keeps every
finished record and several processes can share one file. Readers skip lines that do not parse (a torn
last line after a crash) and report how many they skipped; they never raise on bad content.

Every string written here passes through `envinfo.scrub`, so the value of a secret environment
variable cannot end up in a run directory even when a log line or an argv carries it.

>>> run = RunDir.create("/tmp/ciuic-doctest-run", exist_ok=True)
>>> with run.writer("comm") as w:
...     w.write({"collective": "all_reduce", "algo": "ring", "bytes": 1024, "time_us": 9.5, "busbw_gbps": 1})
...     w.write({"collective": "all_reduce", "bytes": "1K"})  # off schema: counted, not returned
>>> read = run.read("comm")
>>> read.records[-1]["bytes"], read.invalid_records > 0
(1024, True)
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import math
import os
import re
import time
from collections.abc import Iterator
from json.encoder import c_make_encoder, encode_basestring_ascii  # type: ignore[attr-defined]
from pathlib import Path
from typing import Any

from ciuic_doctor import __version__
from ciuic_doctor.cluster import node_name
from ciuic_doctor.errors import UserError
from ciuic_doctor.rundir import safe_io
from ciuic_doctor.rundir.stream_read import StreamRead, read_jsonl

SCHEMA = 1
DEFAULT_ROOT = Path("reports")
RUN_DIR_ENV = "CIUIC_RUN_DIR"  # set by our launcher so every rank writes into the same run directory


def _json_default(value: Any) -> Any:
    """Serialise numpy / torch scalars and paths without importing either library."""
    if hasattr(value, "item"):
        return _finite(value.item())
    if isinstance(value, Path):
        return str(value)
    if hasattr(value, "__dataclass_fields__"):
        from dataclasses import asdict

        return asdict(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def _finite(value: Any) -> Any:
    """NaN and inf are findings, not errors: keep them as strings JSON can carry ("nan", "inf")."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


# json.dumps(record, default=_json_default, separators=(",", ":"), allow_nan=False) builds this same C
# encoder (and a JSONEncoder around it) on every call: two thirds of its ~16 us for a watched step's record.
# Built once here, without json.dumps' circular-reference check (a cycle raises RecursionError instead,
# and takes the json.dumps path below, which says so as it always did).
_ENCODE = (
    c_make_encoder(None, _json_default, encode_basestring_ascii, None, ":", ",", False, False, False)
    if c_make_encoder is not None
    else None
)


def dumps(record: Any) -> str:
    """One JSON line, secrets scrubbed, non-finite floats as strings.

    The C encoder tries first and refuses NaN/inf itself (allow_nan=False); only then is the record walked
    in Python to replace them. That walk cost memwatch ~0.15 % of a core at 10 Hz and every watched step
    its share, for values that are almost always finite.
    """
    try:
        text = "".join(_ENCODE(record, 0)) if _ENCODE is not None else None
    except (ValueError, RecursionError):
        text = None  # NaN / inf, or a cycle: json.dumps below, as it always was
    if text is None:
        try:
            text = json.dumps(record, default=_json_default, separators=(",", ":"), allow_nan=False)
        except ValueError:
            text = json.dumps(_finite(record), default=_json_default, separators=(",", ":"))
    return _scrub(text)


def _scrub(text: str) -> str:
    """envinfo.scrub, imported at the first record and then bound in its place: an import statement
    in `dumps` cost a watched step ~3 us a record (envinfo is not imported by `--help`)."""
    global _scrub  # noqa: PLW0603 - replaced by what it imports, once
    from ciuic_doctor.machine.envinfo import scrub

    _scrub = scrub
    return scrub(text)


def as_float(value: Any) -> float | None:
    """Read back a number written by `dumps`: "nan"/"inf" strings become floats, None stays None."""
    if value is None:
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


class JsonlWriter:
    """Append-only JSONL stream; each `write` is one `os.write` of one whole line (O_APPEND).

    Adds `schema`, `t`, `host` and `rank` (when known) to records that lack them.
    """

    def __init__(self, path: Path, *, rank: int | None = None) -> None:
        self.path = path
        self.rank = rank
        self.host = node_name()  # the scheduler's name for this node (SLURMD_NODENAME), else the host name
        self._fd = -1
        try:
            # never through a symlink, a hard link or a FIFO planted under the stream's name (safe_io)
            self._fd = safe_io.open_append(path)
            self._id = safe_io.fd_identity(self._fd)
        except safe_io.Unsafe as exc:
            raise UserError(f"{path}: cannot write this stream ({exc.why})") from None
        except OSError as exc:
            raise UserError(f"{path}: cannot write this stream ({exc.strerror})") from None

    def write(self, record: dict[str, Any]) -> None:
        full = {"schema": SCHEMA, "t": time.time(), "host": self.host}
        if self.rank is not None:
            full["rank"] = self.rank
        full.update(record)
        line = (dumps(full) + "\n").encode()
        try:
            if self._ours():
                os.write(self._fd, line)
                return
        except OSError as exc:
            if exc.errno != errno.EBADF:
                raise
        # the watched script closed our descriptor (os.closerange(3, ...)), and its number may now be one
        # of the script's own files: never written to; the stream is opened again
        self._fd = safe_io.open_append(self.path)
        self._id = safe_io.fd_identity(self._fd)
        os.write(self._fd, line)

    def _ours(self) -> bool:
        """The descriptor is still the stream this writer opened (1 fstat, ~1 us a record)."""
        return safe_io.fd_identity(self._fd) == self._id

    def close(self) -> None:
        if self._fd >= 0:
            with contextlib.suppress(OSError):
                if self._ours():  # never close a descriptor the script reused for its own file
                    os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> JsonlWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_RANK_FILE = re.compile(r"\.rank(\d+)\.jsonl$")


def _rank_of_file(name: str) -> int:
    """The rank in a per-rank file's name (`steps.rank12.jsonl` -> 12); -1 for a name without one."""
    match = _RANK_FILE.search(name)
    return int(match.group(1)) if match else -1


# What ranks may write before meta.json exists: streams, logs, snapshots, lock and temp files, checkpoints,
# Parquet copies, a rank's observed settings (observed.rank<R>.json), and the hang watchdog's files (a rank
# arms it, writing hang.rank<R>.armed.json, before rank 0 has written meta.json; `hang --pid --out D`
# writes only hang.* files).
_RUN_ENTRY = re.compile(
    r"^(\..*|.*\.(jsonl|log|pickle|parquet)|hang\..+|observed\.rank\d+\.json|checkpoints|checkpoint-check|columnar)$"
)


def _is_our_meta(path: Path) -> bool:
    try:
        meta = json.loads(safe_io.read_bytes(path, max_bytes=safe_io.MAX_JSON_BYTES))
    except (OSError, ValueError, UnicodeDecodeError, RecursionError):
        return False
    return (
        isinstance(meta, dict)
        and isinstance(meta.get("tool"), dict)
        and meta["tool"].get("name") == ("ciuic-doctor")
    )


def _foreign_entries(path: Path) -> list[str]:
    """Names in `path` that show it is not a run directory; [] for an empty folder or a run.

    A run is a folder whose meta.json ciuic-doctor wrote, or (ranks racing before meta.json) one that
    holds only names a run directory has. Our launcher's own folder ($CIUIC_RUN_DIR) is always a run.
    """
    if os.environ.get(RUN_DIR_ENV) and Path(os.environ[RUN_DIR_ENV]).resolve() == path.resolve():
        return []
    if _is_our_meta(path / "meta.json"):
        return []
    try:
        names = [entry.name for entry in os.scandir(path)]
    except OSError:
        return []
    return [name for name in names if not _RUN_ENTRY.match(name)]


# What analyze and report write into a run (RunDir.claim_outputs guards a folder that is not a run).
OUTPUT_NAMES = ("findings.json", "summary.md", "report.html", "recommendations.json", "recommended.env",
                "recommended.toml")  # fmt: skip


class RunDir:
    """One run directory. Create with `RunDir.create`, open an existing one with `RunDir.open`."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.meta_problems: list[str] = []  # what read_meta had to drop, for the report to say
        self.read_problems: dict[str, str] = {}  # stream -> what its reader skipped (StreamRead.problems)
        self._irregular: dict[str, str] = {}  # stream -> its files that are not regular files
        self.notes: list[str] = []  # what a reader could not do for later readers (a columnar copy)

    def __repr__(self) -> str:
        return f"RunDir({str(self.path)!r})"

    @classmethod
    def create(
        cls, path: str | Path, *, exist_ok: bool = True, force: bool = False, force_option: bool = False
    ) -> RunDir:
        """A run directory to write into: created if missing, reused if it is already a run.

        A folder that is not empty and not a run (`--out /`, `--out ~/project`) is refused: writing there
        merged into its meta.json, appended to its .jsonl files and let `report` overwrite its own
        summary.md. `force` takes it anyway and stamps meta.json, so it is a run from then on.
        `force_option`: the command has --force, so the refusal may offer it (stability, hang, merge and
        compare have none: their message must not send the user to an option that is refused).
        """
        path = Path(path)
        if path.exists() and not path.is_dir():
            raise UserError(f"--out {path}: exists and is not a directory")
        try:
            path.mkdir(parents=True, exist_ok=exist_ok)
        except FileExistsError:
            raise UserError(f"--out {path}: already exists") from None
        except OSError as exc:
            raise UserError(f"--out {path}: cannot create directory ({exc.strerror})") from None
        foreign = _foreign_entries(path)
        if foreign and not force:
            shown = ", ".join(sorted(foreign)[:3]) + (", ..." if len(foreign) > 3 else "")
            raise UserError(
                f"--out {path}: not empty and not a run directory (holds {shown}); "
                "choose a new or empty folder"
                + (", or pass --force to write there anyway" if force_option else "")
            )
        run = cls(path)
        if foreign:  # forced: from now on it is a run, for every rank and every later command
            run.update_meta()
        return run

    @classmethod
    def open(cls, path: str | Path) -> RunDir:
        """An existing run directory: one with meta.json or at least one stream. Anything else is refused,
        so `analyze /etc` cannot write findings.json into a folder that was never a run."""
        path = Path(path)
        if not path.is_dir():
            raise UserError(f"{path}: no such run directory")
        if not (path / "meta.json").is_file() and not any(path.glob("*.jsonl")):
            raise UserError(f"{path}: not a run directory (no meta.json and no *.jsonl streams)")
        return cls(path)

    def claim_outputs(self) -> None:
        """Before analyze / report write their files: a folder whose meta.json ciuic-doctor did not write
        (a folder of the user's own *.jsonl) that already holds a file of those names is refused, so a
        user's summary.md is never replaced; otherwise meta.json is
        stamped, so the folder is a run from then on and the next report may replace its own files."""
        if _is_our_meta(self.meta_path):
            return
        held = [n for n in OUTPUT_NAMES if (self.path / n).is_symlink() or (self.path / n).is_file()]
        if held:
            raise UserError(
                f"{self.path}: not a run directory ciuic-doctor made (no meta.json of its own) and it "
                f"holds {', '.join(held)}, which the report would replace; copy the *.jsonl streams into "
                "a new folder and run it there"
            )
        self.update_meta()

    # ---- streams -------------------------------------------------------------------------------
    def stream_path(self, name: str, rank: int | None = None) -> Path:
        return self.path / (f"{name}.jsonl" if rank is None else f"{name}.rank{rank}.jsonl")

    def writer(self, name: str, *, rank: int | None = None, per_rank_file: bool = False) -> JsonlWriter:
        """A writer for stream `name`; `per_rank_file` gives each rank its own file."""
        path = self.stream_path(name, rank if per_rank_file else None)
        return JsonlWriter(path, rank=rank)

    def stream_files(self, name: str) -> list[Path]:
        """The files of stream `name`: the shared one first, then per-rank files in rank order.

        Only regular files: a directory or FIFO under a stream's name (a FIFO hung every reader) is left
        out and named in `read_problems`, for every reader of the run (this one and columnar ones).
        """
        entries = self._stream_entries(name)
        shared = self.stream_path(name).name
        ranked = sorted((n for n in entries if n != shared and not n.startswith(".")), key=_rank_of_file)
        found = ([shared] if shared in entries else []) + ranked
        regular = [self.path / n for n in found if entries[n]]
        if len(regular) < len(found):
            self._irregular[name] = ", ".join(
                f"{n} unreadable ({safe_io.irregular_reason(self.path / n)}, not a regular file)"
                for n in found
                if not entries[n]
            )
            self.read_problems.setdefault(name, self._irregular[name])
        return regular

    def _stream_entries(self, name: str, *, first: bool = False) -> dict[str, bool]:
        """The folder's entries of stream `name` (the shared file, `name.rank*.jsonl`) -> whether each is
        a regular file, from one listing (its entry types: no stat a file, 100,000 ranks' files; a
        symlink out is not one). `first`: stop at the first regular one (whether the stream exists)."""
        shared, prefix = self.stream_path(name).name, f"{name}.rank"
        least = len(prefix) + len(".jsonl")
        entries: dict[str, bool] = {}
        try:
            with os.scandir(self.path) as listing:
                for entry in listing:
                    n = entry.name  # fnmatch's `name.rank*.jsonl` as string tests: 23 vs 45 ms a 100,000
                    if n == shared or (n.startswith(prefix) and n.endswith(".jsonl") and len(n) >= least):
                        entries[n] = entry.is_file(follow_symlinks=False)
                        if first and entries[n]:
                            break
        except OSError:
            pass
        return entries

    def has_stream(self, name: str) -> bool:
        """Whether the stream has a regular file. The listing ends at the first one: run_all asks this of
        every analysis's streams, and 13 full listings of a 100,000-rank run took 5.6 s."""
        entries = self._stream_entries(name, first=True)
        if any(entries.values()):
            return True
        return bool(entries) and bool(self.stream_files(name))  # irregular entries only: named, as before

    def read(self, name: str) -> StreamRead:
        """All records of a stream (shared file first, then per-rank files in rank order)."""
        total = StreamRead()
        for path in self.stream_files(name):
            total.merge(read_jsonl(path, name))
        problems = "; ".join(p for p in (self._irregular.get(name), total.problems()) if p)
        if problems:
            self.read_problems[name] = problems
        return total

    # ---- meta.json -----------------------------------------------------------------------------
    @property
    def meta_path(self) -> Path:
        return self.path / "meta.json"

    def read_meta(self) -> dict[str, Any]:
        """meta.json as a dict; {} when missing, {"unreadable_meta": why} when it does not parse (or is a
        directory or a FIFO). Values of the wrong type are dropped (schemas.clean_meta) and named in
        `self.meta_problems`, so a reader's `.get()` chain never meets a list where it expects a dict."""
        from ciuic_doctor.rundir.schemas import clean_meta

        try:
            raw = json.loads(safe_io.read_bytes(self.meta_path, max_bytes=safe_io.MAX_JSON_BYTES))
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, UnicodeDecodeError, RecursionError) as exc:
            reason = str(getattr(exc, "strerror", None) or exc)[:200]
            self.meta_problems = [f"meta.json unreadable: {reason}"]
            return {"unreadable_meta": reason}
        meta, self.meta_problems = clean_meta(raw)
        return meta

    @contextlib.contextmanager
    def _meta_lock(self) -> Iterator[None]:
        try:
            fd = safe_io.open_append(self.path / ".meta.lock")
        except OSError as exc:
            raise UserError(f"{self.path / '.meta.lock'}: cannot lock meta.json ({exc})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing releases the lock

    def update_meta(self, **fields: Any) -> dict[str, Any]:
        """Merge `fields` into meta.json under a file lock; dict values merge one level deep.

        The first call also records run id, creation time and tool version.
        """
        with self._meta_lock():
            meta = self.read_meta()
            meta.setdefault("schema", SCHEMA)
            meta.setdefault("run", self.path.name)
            meta.setdefault("created", time.time())
            meta.setdefault("tool", {"name": "ciuic-doctor", "version": __version__})
            for key, value in fields.items():
                if isinstance(value, dict) and isinstance(meta.get(key), dict):
                    meta[key] = {**meta[key], **value}
                else:
                    meta[key] = value
            self.write_text("meta.json", json.dumps(json.loads(dumps(meta)), indent=2) + "\n")
            return meta

    def record_environment(self, *, with_torch: bool = True) -> None:
        """Capture the environment into meta.json["env"] once per run directory.

        A capture made without torch (memwatch) is replaced by one with torch's view (CUDA, NCCL, devices)
        when a probe that has torch loaded comes along; otherwise the first capture stands.
        """
        from ciuic_doctor.machine.envinfo import capture

        existing = self.read_meta().get("env")
        if isinstance(existing, dict) and (not with_torch or "cuda_available" in existing):
            return
        self.update_meta(env=capture(with_torch=with_torch))

    def record_probe(self, probe: str, **fields: Any) -> None:
        """Note in meta.json that a probe ran here, with its argv, status and times."""
        self.update_meta(probes={probe: {"updated": time.time(), **fields}})

    # ---- whole files ---------------------------------------------------------------------------
    def write_text(self, name: str, text: str) -> Path:
        """Write a whole file atomically, secrets scrubbed: a temp file made with O_EXCL | O_NOFOLLOW in
        the run, renamed over `name`, so a symlink planted there is replaced, never written through."""
        from ciuic_doctor.machine.envinfo import scrub

        return self.write_bytes(name, scrub(text).encode())

    def write_bytes(self, name: str, data: bytes) -> Path:
        """A whole file `name` (a folder of the run may come first: `hang.fr/rank0`), atomically."""
        target = self.path / name
        try:
            return safe_io.write_atomic(target, data, root=self.path)
        except safe_io.Unsafe as exc:
            raise UserError(f"{target}: not written ({exc.why})") from None

    def write_json(self, name: str, data: Any) -> Path:
        return self.write_text(name, json.dumps(json.loads(dumps(data)), indent=2) + "\n")

    def read_json(self, name: str) -> Any:
        """A JSON file of the run (regular, inside it, at most safe_io.MAX_JSON_BYTES)."""
        return json.loads(
            safe_io.read_bytes(self.path / name, max_bytes=safe_io.MAX_JSON_BYTES, root=self.path)
        )


def default_run_path(command: str, out: str | Path | None = None) -> Path:
    """Where a command writes: `--out`, else $CIUIC_RUN_DIR (set for every rank by our launcher),
    else `reports/<command>-<torchelastic run id>` under torchrun, else `reports/<time>-<command>`."""
    if out:
        return Path(out)
    if os.environ.get(RUN_DIR_ENV):
        return Path(os.environ[RUN_DIR_ENV])
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    if run_id and run_id != "none":
        return DEFAULT_ROOT / f"{command}-{run_id}"
    return DEFAULT_ROOT / f"{time.strftime('%Y%m%d-%H%M%S')}-{command}"
