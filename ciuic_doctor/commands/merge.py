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
import re

NAME = "merge"
HELP = "merge per-node run directories copied to one machine into one run directory"
ORDER = 76
_RANK_FILE = re.compile(r"^(?P<stream>[^.]+)\.rank(?P<rank>\d+)\.jsonl$")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("runs", metavar="RUN", nargs="+", help="run directories to merge (two or more)")
    parser.add_argument("--out", required=True, metavar="RUN", help="the merged run directory (new or empty)")


def run(args: argparse.Namespace) -> int:
    from ciuic_doctor.errors import UserError
    from ciuic_doctor.store import RunDir

    if len(args.runs) < 2:
        raise UserError("merge needs at least two run directories")
    inputs = [RunDir.open(path) for path in args.runs]
    out = RunDir.create(args.out)
    if any(out.path.iterdir()):
        raise UserError(f"--out {out.path}: not empty (merge writes a new run directory)")
    resolved = {r.path.resolve() for r in inputs}
    if len(resolved) < len(inputs) or out.path.resolve() in resolved:
        raise UserError("merge: each RUN once, and --out must be none of them")
    plan = plan_merge(inputs)
    summary = write_merge(plan, inputs, out)
    print(
        f"merged {len(inputs)} run directories into {out.path}: {summary['rank_files']} per-rank file(s) "
        f"({summary['ranks']} ranks), {summary['shared_files']} shared stream file(s), "
        f"{summary['torn_lines']} torn line(s) dropped; hosts: {', '.join(summary['hosts']) or 'unknown'}"
    )
    print(f"next: ciuic-doctor report {out.path}")
    return 0


def plan_merge(inputs: list) -> dict[str, list]:
    """{file name: [source paths]}; UserError when one rank's file differs between inputs."""
    from ciuic_doctor.errors import UserError

    sources: dict[str, list] = {}
    for run in inputs:
        for path in sorted(run.path.glob("*.jsonl")):
            sources.setdefault(path.name, []).append(path)
    for name, paths in sources.items():
        if _RANK_FILE.match(name) and len(paths) > 1:
            first = paths[0].read_bytes()
            if any(p.read_bytes() != first for p in paths[1:]):
                where = ", ".join(str(p.parent) for p in paths)
                raise UserError(
                    f"{name} is in several inputs with different records ({where}): the same rank cannot "
                    "have run on two nodes of one job; merge the runs of one job only"
                )
            sources[name] = paths[:1]  # the same file copied twice
    return sources


def write_merge(sources: dict[str, list], inputs: list, out) -> dict:
    import shutil

    ranks, torn, rank_files, shared_files = set(), 0, 0, 0
    for name, paths in sorted(sources.items()):
        target = out.path / name
        match = _RANK_FILE.match(name)
        if match:
            shutil.copyfile(paths[0], target)
            ranks.add(int(match["rank"]))
            rank_files += 1
            continue
        with open(target, "wb") as fh:
            for path in paths:
                data = path.read_bytes()
                whole = data[: data.rfind(b"\n") + 1]  # a torn last line would swallow the next file's first
                torn += bool(data[len(whole) :].strip())
                fh.write(whole)
        shared_files += 1
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
    }
