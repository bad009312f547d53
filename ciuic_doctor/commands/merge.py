"""Merge per-node run directories (each node wrote its own RUN, then they were copied together) into one.

A job on several nodes is best given one shared run directory on the cluster file system (`--out` the
same path on every node, or CIUIC_RUN_DIR): each rank writes its own steps.rank<R>.jsonl. When each node
wrote a local directory instead, copy them to one machine and merge them:

    ciuic-doctor merge node0/reports/run node1/reports/run --out reports/run
    ciuic-doctor report reports/run

- per-rank files (<stream>.rank<R>.jsonl) are copied; the same rank in two inputs is refused unless the
  two files are identical (a directory copied twice);
- shared streams (memwatch.jsonl, comm.jsonl, ...) are concatenated input by input, whole lines only:
  a torn last line (a node killed mid-write) is dropped and counted, never glued to the next file;
- meta.json is the first input's, with every input's probes merged and `merged_from` listing the
  inputs (their run id, host and creation time);
- findings and reports are not copied: `ciuic-doctor report RUN` makes them again from the records.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

NAME = "merge"
HELP = "merge per-node run directories copied to one machine into one run directory"
ORDER = 76
_RANK_FILE = re.compile(r"^(?P<stream>[^.]+)\.rank(?P<rank>\d+)\.jsonl$")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("runs", metavar="RUN", nargs="+", help="run directories to merge (two or more)")
    parser.add_argument("--out", required=True, metavar="RUN", help="the merged run directory (new or empty)")


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from ciuic_doctor.errors import UserError
    from ciuic_doctor.rundir.store import RunDir

    if len(args.runs) < 2:
        raise UserError("merge needs at least two run directories")
    inputs = [RunDir.open(path) for path in args.runs]
    target = Path(args.out)
    made = not target.exists()
    out = RunDir.create(args.out)
    if any(out.path.iterdir()):
        raise UserError(f"--out {out.path}: not empty (merge writes a new run directory)")
    resolved = {r.path.resolve() for r in inputs}
    if len(resolved) < len(inputs) or out.path.resolve() in resolved:
        raise UserError("merge: each RUN once, and --out must be none of them")
    try:
        plan, skipped = plan_merge(inputs)
        summary = write_merge(plan, inputs, out)
    except BaseException:  # a refusal, a full disk or Ctrl-C: no half-made run directory stays
        _remove_partial(out.path, made=made)
        raise
    print(
        f"merged {len(inputs)} run directories into {out.path}: {summary['rank_files']} per-rank file(s) "
        f"({summary['ranks']} ranks), {summary['shared_files']} shared stream file(s), "
        f"{summary['torn_lines']} torn line(s) dropped; hosts: {', '.join(summary['hosts']) or 'unknown'}"
    )
    for line in skipped:
        print(f"ciuic-doctor merge: skipped {line}", file=sys.stderr)
    print(f"next: ciuic-doctor report {out.path}")
    return 0


def _remove_partial(path, *, made: bool) -> None:
    import contextlib
    import shutil

    if made:
        shutil.rmtree(path, ignore_errors=True)
        return
    for entry in list(path.iterdir()):  # --out was an existing empty folder: empty it again
        with contextlib.suppress(OSError):
            shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()


def plan_merge(inputs: list) -> tuple[dict[str, list], list[str]]:
    """({file name: [source paths]}, [what was skipped]); UserError when one rank's file differs between
    inputs. Only regular files inside each input are taken: a symlink (it could name any file on the
    machine), a FIFO (a read never ends), a device (/dev/zero never ends) or a folder is skipped, named."""
    from ciuic_doctor.errors import UserError
    from ciuic_doctor.rundir import safe_io

    sources: dict[str, list] = {}
    skipped: list[str] = []
    for run in inputs:
        for path in sorted(run.path.glob("*.jsonl")):
            if (why := safe_io.irregular_reason(path)) is not None:
                skipped.append(f"{path}: {why}, not a regular file")
                continue
            sources.setdefault(path.name, []).append(path)
    for name, paths in sources.items():
        if _RANK_FILE.match(name) and len(paths) > 1:
            if any(not _same_bytes(paths[0], p) for p in paths[1:]):
                where = ", ".join(str(p.parent) for p in paths)
                raise UserError(
                    f"{name} is in several inputs with different records ({where}): the same rank cannot "
                    "have run on two nodes of one job; merge the runs of one job only"
                )
            sources[name] = paths[:1]  # the same file copied twice
    return sources, skipped


_CHUNK = 1 << 20


def _same_bytes(a, b) -> bool:
    from ciuic_doctor.rundir import safe_io

    with (
        open(safe_io.open_regular(a, max_bytes=safe_io.MAX_STREAM_BYTES), "rb") as fa,
        open(safe_io.open_regular(b, max_bytes=safe_io.MAX_STREAM_BYTES), "rb") as fb,
    ):
        while True:
            x, y = fa.read(_CHUNK), fb.read(_CHUNK)
            if x != y:
                return False
            if not x:
                return True


def _append(source, fd: int, *, whole_lines: bool) -> bool:
    """Copy `source` (a regular file of at most safe_io.MAX_STREAM_BYTES) to the end of `fd` in chunks;
    with `whole_lines` a torn last line is cut off again. True when a torn line was dropped."""
    from ciuic_doctor.rundir import safe_io

    start = os.lseek(fd, 0, os.SEEK_END)
    copied, last_newline = 0, -1
    with open(safe_io.open_regular(source, max_bytes=safe_io.MAX_STREAM_BYTES), "rb") as fh:
        while chunk := fh.read(_CHUNK):
            if copied + len(chunk) > safe_io.MAX_STREAM_BYTES:  # it grew while read
                chunk = chunk[: safe_io.MAX_STREAM_BYTES - copied]
            if (at := chunk.rfind(b"\n")) >= 0:
                last_newline = copied + at
            os.write(fd, chunk)
            copied += len(chunk)
            if copied >= safe_io.MAX_STREAM_BYTES:
                break
    if whole_lines and last_newline + 1 < copied:  # a torn last line would swallow the next file's first
        os.ftruncate(fd, start + last_newline + 1)
        os.lseek(fd, 0, os.SEEK_END)
        return True
    return False


def write_merge(sources: dict[str, list], inputs: list, out) -> dict:

    ranks, torn, rank_files, shared_files = set(), 0, 0, 0
    for name, paths in sorted(sources.items()):
        match = _RANK_FILE.match(name)
        fd = os.open(out.path / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        try:
            if match:
                _append(paths[0], fd, whole_lines=False)
                ranks.add(int(match["rank"]))
                rank_files += 1
                continue
            for path in paths:
                torn += _append(path, fd, whole_lines=True)
            shared_files += 1
        finally:
            os.close(fd)
    hang_files = _copy_hang_files(inputs, out)
    metas = [(run, run.read_meta()) for run in inputs]
    base = dict(metas[0][1])
    probes: dict = {}
    for _, meta in metas:
        probes.update(meta.get("probes") or {})
    hosts = []
    merged_from = []
    for run, meta in metas:
        host = (meta.get("env") or {}).get("host")
        hosts += [host] if host and host not in hosts else []
        merged_from.append(
            {"path": str(run.path), "run": meta.get("run"), "host": host, "created": meta.get("created")}
        )
    base.pop("run", None)
    out.update_meta(**{k: v for k, v in base.items() if k not in ("probes", "schema", "created", "tool")})
    out.update_meta(probes=probes, merged_from=merged_from)
    return {
        "rank_files": rank_files,
        "ranks": len(ranks),
        "shared_files": shared_files,
        "torn_lines": torn,
        "hosts": hosts,
        "hang_files": hang_files,
    }


_HANG_FILE = re.compile(r"^hang\.rank\d{1,9}\.(json|armed\.json|last\.json|fatal\.txt|stacks\.txt)$")


def _copy_hang_files(inputs: list, out) -> int:
    """Every input's hang files (a rank's dump, its Flight Recorder file, its watchdog's armed record):
    the first input that has a rank's file gives it. Regular files inside the input only, each at most
    its cap (safe_io), written without following a symlink."""
    from ciuic_doctor.rundir import safe_io

    copied = 0
    for run in inputs:
        names = [p.name for p in run.path.glob("hang.rank*") if _HANG_FILE.match(p.name)]
        names += [
            f"hang.fr/{p.name}"
            for p in run.path.glob("hang.fr/rank*")
            if re.fullmatch(r"rank\d{1,9}", p.name)
        ]
        for name in sorted(names):
            if (out.path / name).exists():
                continue
            cap = safe_io.MAX_PICKLE_BYTES if name.startswith("hang.fr/") else safe_io.MAX_JSON_BYTES
            try:
                data = safe_io.read_bytes(run.path / name, max_bytes=cap, root=run.path)
                if name.startswith("hang.fr/"):
                    safe_io.make_dir(out.path, "hang.fr")
                safe_io.write_atomic(out.path / name, data, root=out.path)
            except OSError as exc:
                print(
                    f"ciuic-doctor merge: skipped {run.path / name}: {getattr(exc, 'why', None) or exc}",
                    file=sys.stderr,
                )
                continue
            copied += 1
    return copied
