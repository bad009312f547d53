"""Why a distributed job hung: which rank, where, and what kind of hang, from the ranks' hang dumps.

Input: `hang.files.HangFiles` (each rank's dump with Flight Recorder's entries and group status, stacks
from the rank itself, faulthandler or py-spy, the last step records). Output: findings with probe "hang".

Each rank gets a position: inside a collective (Flight Recorder has an entry past the group's last
completed sequence number, or its stack is inside torch.distributed), outside any (its stack is its own),
or unknown (no dump: stopped, gone, unseen). Then, first rule that applies:

- **dead**: a rank's process is gone (a peer saw it exit) and it left no dump of its own;
- **stall**: a rank is outside any collective, or stopped (SIGSTOP, a debugger), while the others wait
  in one: its own frame (innermost frame outside torch and the standard library) is where to look;
- **desync**: at the collective the others wait in, a rank issued a different op or called from a
  different line (it skipped one, or took a rank-dependent branch);
- **mismatch**: same op from the same line, different sizes or dtypes;
- **in-collective**: every rank entered the same collective and none completed: the fabric.

With two ranks a majority cannot pick the culprit, so the repeating pattern of a rank's own history
decides: a job issues the same collectives in the same order every step, and the rank whose collective
breaks that pattern is the one that changed.

    >>> kind_advice("stall")[:40]
    'Look at the culprit frame: that rank is '
"""

from __future__ import annotations

import os
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ciuic_doctor.analysis.hang.frames import collective_in, frame_text, main_frames, user_frame
from ciuic_doctor.rundir.findings import Finding
from ciuic_doctor.rundir.hang.files import HangFiles, load
from ciuic_doctor.rundir.store import RunDir

PROBE = "hang"
STREAMS = ("steps",)  # run_all runs this on watched runs; the dumps themselves are not streams
_GONE = {"gone", "exited"}
_PEER_LOST = re.compile(r"(closed|reset) by peer|Connection refused|Broken pipe", re.IGNORECASE)
_KEEP_NEXT_TIME = (
    "Keep for next time: TORCH_FR_BUFFER_SIZE=2000 (watch sets it), TORCH_NCCL_DUMP_ON_TIMEOUT=1 and "
    "TORCH_NCCL_DEBUG_INFO_TEMP_FILE=<shared dir>/nccl_trace_rank_ so NCCL dumps on a timeout without watch."
)
_ADVICE = {
    "stall": "Look at the culprit frame: that rank is outside any collective (a sleep, I/O, a lock, data "
    "loading) while the others wait for it; DataLoader(timeout=...) turns a loader stall into an error.",
    "desync": "The culprit issued a different collective (or one from another line) at the same sequence "
    "number: a collective skipped or added under a rank-dependent branch, an early exit, or uneven data "
    "(model.join() / drop_last=True).",
    "mismatch": "Same collective, different sizes or dtypes: an uneven last batch, padding that depends on "
    "the rank, a shape computed per rank; TORCH_DISTRIBUTED_DEBUG=DETAIL checks every collective's shapes "
    "across ranks (slow) and fails at once naming both.",
    "in-collective": "Every rank is inside the same collective and none completed: suspect the fabric "
    "(NCCL_DEBUG=INFO, nccl-tests / comm-bench on the same hosts, NCCL_IB_* / NIC errors).",
    "dead": "A rank's process is gone: read its own stderr, torchrun's exitcode for it, and dmesg for the "
    "OOM killer; a killed rank leaves no dump, so its last step record is the last thing known.",
}


def kind_advice(kind: str) -> str:
    return _ADVICE.get(kind, "") + " " + _KEEP_NEXT_TIME


@dataclass(kw_only=True)
class Position:
    rank: int
    host: str | None = None
    source: str = "none"  # watchdog | faulthandler | py-spy | none
    state: str | None = None  # stopped / gone / exited / aborted / running ...
    in_collective: bool | None = None
    seq: int | None = None
    op: str | None = None
    site: str | None = None
    sizes: Any = None
    dtypes: Any = None
    pg: str | None = None
    frame: str | None = None  # its own innermost frame
    error: str | None = None
    history: list[tuple[str, str, str]] = field(default_factory=list)  # (op, site, sizes) per completed seq
    prev_sizes: Any = None  # sizes of the previous call from the same line (the wrapper's record)
    # why its own dump was made: no-progress / collective-error / terminated / requested
    reason: str | None = None
    moving: bool = False  # py-spy's two looks found it elsewhere: making progress, not stuck
    last_step: int | None = None  # its last step record
    last_collective: str | None = None  # its last Python collective (watch's record), if nobody saw it
    kernel_wait: str | None = None  # hang --pid without C++ frames: what /proc/<pid>/wchan said (kernel.py)


def run_status(meta: dict[str, Any]) -> str | None:
    """How the watched run ended (meta.json probes.watch.status: finished, failed, killed ...), if known."""
    from ciuic_doctor.rundir.watch_end import watch_record  # a `running` record whose process is gone: ended

    watch = watch_record(meta)
    return watch.get("status") if isinstance(watch, dict) and isinstance(watch.get("status"), str) else None


def _op(entry: dict[str, Any]) -> str:
    return str(entry.get("profiling_name", "")).split(":")[-1]


def _fr_position(
    pos: Position, entries: list[dict[str, Any]], status: dict[str, Any], *, failed: bool
) -> None:
    """Position from Flight Recorder: the first entry past its group's last completed sequence number.

    A collective that raised is counted as completed (retired) by the time the error reaches Python, so
    after a collective error (`failed`) the last entry is the one this rank was in.
    """
    done = {str(pg): int(s.get("last_completed_collective", -1)) for pg, s in (status or {}).items()}
    collectives = sorted((e for e in entries if not e.get("is_p2p")), key=lambda e: e["collective_seq_id"])
    pending = [e for e in collectives if e["collective_seq_id"] > done.get(str(e.get("pg_id")), -1)]
    if failed and collectives and not pending:
        pending = collectives[-1:]
    for e in collectives:
        if e not in pending:
            pos.history.append(
                (_op(e), frame_text(user_frame(e.get("frames", []))) or "?", str(e.get("input_sizes")))
            )
    pos.in_collective = bool(pending)
    last = pending[0] if pending else (collectives[-1] if collectives else None)
    if last is not None:
        pos.seq = last["collective_seq_id"] if pending else last["collective_seq_id"] + 1
        if pending:
            pos.op, pos.sizes, pos.dtypes = _op(last), last.get("input_sizes"), last.get("input_dtypes")
            pos.site = frame_text(user_frame(last.get("frames", [])))
            name, desc = [*list(last.get("process_group") or ["?", "?"]), "?"][:2]
            pos.pg = f"{name}:{desc}"


def _last_position(pos: Position, last: dict[str, Any] | None, frames: list[dict[str, Any]]) -> None:
    """An aborted rank's collective from watch's last-collective record, if its stack is at that call."""
    mine = user_frame(frames)
    if last and mine and str(mine.get("file")) == last.get("file") and mine.get("line") == last.get("line"):
        pos.op, pos.sizes, pos.dtypes = last.get("op"), last.get("input_sizes"), last.get("input_dtypes")
        pos.prev_sizes = last.get("prev_sizes")


def positions(files: HangFiles) -> dict[int, Position]:
    """Where each rank is, from the best source there is for it."""
    ranks = set(files.armed) | set(files.dumps) | set(files.fatal) | set(files.py_spy)
    world = max([a.get("world_size", 0) for a in files.armed.values()] + [len(ranks)])
    ranks |= set(range(world))
    seen_by_peers: dict[int, dict[str, Any]] = {}
    for dump in sorted(files.dumps.values(), key=lambda d: d.get("t", 0)):
        for peer in dump.get("peers", []):
            seen_by_peers[peer["rank"]] = peer  # the latest look wins
    out = {}
    for rank in sorted(ranks):
        pos = Position(rank=rank, host=(files.armed.get(rank) or files.dumps.get(rank) or {}).get("host"))
        dump = files.dumps.get(rank)
        threads = None
        if dump is not None and dump.get("resumed_t"):  # it stepped again after the dump: a pause
            pos.source, pos.state, threads = "watchdog", "resumed", dump.get("threads")
            pos.reason = dump.get("reason")
        elif dump is not None:
            pos.source, pos.state, threads = "watchdog", "running", dump.get("threads")
            pos.error, pos.reason = dump.get("error"), dump.get("reason")
            if rank in files.fr_entries:
                failed = dump.get("reason") == "collective-error"
                _fr_position(pos, files.fr_entries[rank], dump.get("pg_status") or {}, failed=failed)
        elif rank in files.fatal:
            pos.source, pos.state, threads = "faulthandler", "aborted", files.fatal[rank]
            _last_position(pos, files.last.get(rank), main_frames(threads))
        elif rank in files.py_spy and files.py_spy[rank].get("threads"):
            seen = files.py_spy[rank]
            pos.source, pos.state, threads = "py-spy", seen.get("state"), seen["threads"]
            pos.moving = bool(seen.get("moving"))
            if rank in files.fr_entries:  # the job's own Flight Recorder dump, found by `hang --pid`
                _fr_position(pos, files.fr_entries[rank], seen.get("pg_status") or {}, failed=False)
        elif rank in seen_by_peers:
            peer = seen_by_peers[rank]
            pos.state = peer.get("state")
            if peer.get("threads"):
                pos.source, threads = "py-spy", peer["threads"]
        pos.last_step = (files.last_steps.get(rank) or {}).get("step")
        if (last := files.last.get(rank)) and pos.source == "none":
            pos.last_collective = f"{last.get('op')} {last.get('input_sizes')} from " + str(frame_text(last))
        frames = main_frames(threads)
        pos.frame = frame_text(user_frame(frames))
        if frames and frames[0].get("native") and str(frames[0].get("file") or "").startswith("/proc/"):
            pos.kernel_wait = str(frames[0].get("function"))
        if pos.in_collective is None and frames:
            op = collective_in(frames)
            pos.in_collective = op is not None
            if op:
                pos.op, pos.site = pos.op or op, pos.frame
        out[rank] = pos
    return out


def _pattern_breakers(cands: list[Position], key: str) -> list[Position]:
    """The ranks whose (op, site) or sizes at their seq break the repeating per-step pattern of history."""
    breakers = []
    for pos in cands:
        if key == "sizes" and not pos.history and pos.prev_sizes is not None:
            if str(pos.sizes) != str(pos.prev_sizes):
                breakers.append(pos)
            continue
        for ref in [pos, *cands]:
            expected = _expected(ref.history, pos.seq)
            if expected is not None:
                actual = (pos.op, pos.site) if key == "site" else pos.sizes
                want = expected[:2] if key == "site" else expected[2]
                if actual != want and (key == "site" or str(actual) != want):
                    breakers.append(pos)
                break
    return breakers


def _expected(history: list[tuple[str, str, str]], seq: int | None) -> tuple[str, str, str] | None:
    """What the pattern of a rank's history says collective `seq` should be (seq ids start at 1)."""
    if seq is None or len(history) < 2:
        return None
    for period in range(1, min(16, len(history) // 2) + 1):
        tail = history[-2 * period :]
        if tail[:period] == tail[period:]:
            index = seq - 1 - period
            if index >= len(history):  # whole periods back into the history (seq may be 2**62: no loop)
                index -= -(-(index - len(history) + 1) // period) * period
            return history[index] if index >= 0 else None
    return None


def classify(pos: dict[int, Position]) -> dict[str, Any]:
    """{kind, culprits, waiting, collective, reason} from the ranks' positions."""
    for p in pos.values():  # a rank seen moving is not where it waits: no position to judge by
        if p.moving:
            p.in_collective, p.state = None, "moving"
    waiting = [p for p in pos.values() if p.in_collective]
    ref = max((p for p in waiting if p.seq is not None), key=lambda p: p.seq or 0, default=None)
    ref = ref or (waiting[0] if waiting else None)
    for p in waiting:  # a stack inside a collective, no Flight Recorder: the one the others wait in
        if p.seq is None and ref is not None and p.op == ref.op:
            p.seq = ref.seq
    dead = [p for p in pos.values() if p.state in _GONE and p.source in ("none", "py-spy")]
    if dead:
        return _verdict("dead", dead, waiting, ref, "its process is gone and it left no dump")
    reset = [p for p in waiting if p.error and _PEER_LOST.search(p.error)]
    unseen = [p for p in pos.values() if p.source == "none" and p.state not in ("stopped",)]
    if reset and unseen:
        return _verdict(
            "dead", unseen, waiting, ref, f"left no dump and its peers lost it ({reset[0].error[-80:]})"
        )
    outside = [p for p in pos.values() if p.state == "stopped" or (p.in_collective is False and p.frame)]
    if outside and waiting:
        why = "stopped (SIGSTOP or a debugger)" if outside[0].state == "stopped" else "outside any collective"
        return _verdict("stall", outside, waiting, ref, why)
    known = [p for p in waiting if p.op]
    sites = Counter((p.op, p.site) for p in known)
    if len(sites) > 1:
        culprits = _minority(known, lambda p: (p.op, p.site)) or _pattern_breakers(known, "site")
        odd = (culprits or known)[0]
        why = f"issued {odd.op} from {odd.site} at #{odd.seq}, a different collective than the others"
        return _verdict("desync", culprits or known, waiting, ref, why)
    sized = [p for p in known if p.sizes is not None]
    unsized = [p for p in known if p.state == "aborted" and p.sizes is None]  # gloo aborted it mid-way
    if len({(str(p.sizes), str(p.dtypes)) for p in sized}) > 1 or (unsized and sized):
        culprits = _minority(sized, lambda p: (str(p.sizes), str(p.dtypes))) or _pattern_breakers(
            sized, "sizes"
        )
        if culprits:
            why = _size_change(culprits[0])
        elif unsized:
            culprits, why = (
                unsized,
                "aborted inside it (its sizes unseen: gloo aborts a rank sent another size)",
            )
        else:
            culprits, why = sized, "called it with different sizes or dtypes"
        return _verdict("mismatch", culprits, waiting, ref, why)
    if waiting and len(waiting) == len(pos):
        return _verdict("in-collective", [], waiting, ref, "every rank entered it and none completed")
    if not waiting:  # nobody waits in a collective: a stall of the job itself (one process), or no hang
        stalled = [p for p in pos.values() if p.reason == "no-progress" and p.state != "resumed"]
        if stalled:
            why = "made no optimizer step for its hang-after seconds and its main thread did not move"
            if len(pos) == 1:  # one process: nothing to wait for in a collective
                why = "(a single process, no collective to wait in) " + why
            return _verdict("stall", stalled, [], None, why)
        return _verdict("none", [], [], None, "no rank waits in a collective")
    unseen = [p for p in pos.values() if p.source == "none"]
    return _verdict("unknown", unseen, waiting, ref, "left no dump")


def _size_change(p: Position) -> str:
    before = p.prev_sizes if not p.history else (_expected(p.history, p.seq) or ("", "", "?"))[2]
    return f"called it with sizes {p.sizes} ({p.dtypes}) where its last call from that line had {before}"


def _minority(cands: list[Position], key: Any) -> list[Position]:
    counts = Counter(key(p) for p in cands)
    if len(counts) < 2 or len(set(counts.values())) == 1:
        return []
    least = min(counts.values())
    return [p for p in cands if counts[key(p)] == least]


def _verdict(
    kind: str, culprits: list[Position], waiting: list[Position], ref: Position | None, why: str
) -> dict:
    names = {p.rank for p in culprits}
    # the collective as the ranks that wait in it issued it, when one of them has Flight Recorder's entry
    ref = next((p for p in waiting if p.rank not in names and p.sizes is not None), ref)
    return {
        "kind": kind,
        "culprits": sorted(culprits, key=lambda p: p.rank),
        "waiting": [p for p in waiting if p.rank not in names],
        "collective": ref,
        "why": why,
    }


def has_hang_files(path: Path) -> bool:
    """Whether the run directory holds any hang file (hang.rank*, hang.pyspy.json, hang.fr/): one
    directory listing, so a run without them costs the hang analysis nothing (it read every step
    record, 218 s of a 1,024-rank report)."""
    try:
        with os.scandir(path) as entries:
            return any(entry.name.startswith("hang.") for entry in entries)
    except OSError:
        return False


def analyze(run: RunDir) -> list[Finding]:
    """run_all's entry: a watched run's hang dumps judged; "pass" when the watchdog was armed and quiet;
    nothing at all when the run has no hang files."""
    if not has_hang_files(run.path):
        return []
    files = load(run)
    if files.any:
        return judge(files, run_status=run_status(run.read_meta()))
    if files.armed:
        ranks = sorted(files.armed)
        return [
            Finding(
                probe=PROBE,
                check="hang",
                verdict="pass",
                summary=f"no hang: the watchdog was armed on {_count(len(ranks), 'rank')} and dumped nothing",
                evidence={"armed_ranks": ranks},
            )
        ]
    return []


def judge(files: HangFiles, *, run_status: str | None = None) -> list[Finding]:
    """The `hang` finding (what hung, who, where, what to do) and `dumps` (which ranks were seen).
    `run_status`: meta.json's probes.watch.status; a run that `finished` (exit 0) did not hang."""
    if not files.any:
        return [Finding(probe=PROBE, check="hang", verdict="not_run", summary="no hang dumps in this run")]
    pos = positions(files)
    if run_status == "finished":
        from ciuic_doctor.analysis.hang.ended import finished_run

        return finished_run(files, pos)
    result = classify(pos)
    culprits, waiting, ref = result["culprits"], result["waiting"], result["collective"]
    collective = None
    if ref is not None and ref.op:
        collective = {"op": ref.op, "seq": ref.seq, "sizes": ref.sizes, "dtypes": ref.dtypes, "pg": ref.pg,
                      "call_site": ref.site}  # fmt: skip
    who = (
        ", ".join(f"rank {p.rank}" + (f" ({p.host})" if p.host else "") for p in culprits) or "no single rank"
    )
    summary = f"{result['kind']}: {who} {result['why']}"
    if result["kind"] == "none":  # dumps asked for (SIGUSR1) or made on SIGTERM while the job ran
        reasons = sorted({p.reason for p in pos.values() if p.reason})
        why = ", ".join(reasons) or "no reason recorded"
        summary = f"not hung when dumped ({why}): no rank waits in a collective"
    if culprits and culprits[0].frame:
        summary += f"; its own frame: {culprits[0].frame}"
    elif culprits and culprits[0].source == "none":  # no stack: the last things it recorded
        lost = culprits[0]
        if lost.last_step is not None:
            summary += f"; its last step record: step {lost.last_step}"
        if lost.last_collective:
            summary += f"; its last collective: {lost.last_collective}"
    if collective and waiting:
        summary += (
            f"; ranks {_ranks(waiting)} wait in {collective['op']}"
            + (f" #{collective['seq']}" if collective["seq"] is not None else "")
            + " "
            f"({_describe(collective)}) from {collective['call_site']}"
        )
    unseen = sorted(p.rank for p in pos.values() if p.source == "none")
    evidence = {
        "kind": result["kind"],
        "culprit_ranks": [p.rank for p in culprits],
        "culprit_hosts": sorted({p.host for p in culprits if p.host}),
        "culprit_frame": culprits[0].frame if culprits else None,
        "waiting_ranks": [p.rank for p in waiting],
        "collective": collective,
        "next": kind_advice(result["kind"]),
        "ranks": [_row(p) for p in pos.values()],
        "unseen_ranks": unseen,
        "problems": files.problems,
    }
    where = {"ranks": [p.rank for p in culprits]} | ({"rank": culprits[0].rank} if len(culprits) == 1 else {})
    if evidence["culprit_hosts"]:
        where["hosts"] = evidence["culprit_hosts"]
    findings = [
        Finding(
            probe=PROBE,
            check="hang",
            verdict="pass" if result["kind"] == "none" else "fail",
            summary=summary,
            evidence=evidence,
            where=where,
        )
    ]
    seen = [p.rank for p in pos.values() if p.source != "none"]
    findings.append(
        Finding(
            probe=PROBE,
            check="dumps",
            verdict="warn" if unseen else "pass",
            summary=(
                f"ranks {_ranks(unseen)} could not be seen (no dump, no stack); judged from the others"
                if unseen
                else f"every rank's position is known ({len(seen)} ranks)"
            ),
            evidence={
                "seen_ranks": seen,
                "unseen_ranks": unseen,
                "sources": {p.rank: p.source for p in pos.values()},
            },
            where={"ranks": unseen},
        )
    )
    return findings


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'s' * (n != 1)}"


def _describe(collective: dict[str, Any]) -> str:
    parts = [
        collective["sizes"],
        collective["dtypes"],
        f"pg {collective['pg']}" if collective["pg"] else None,
    ]
    return ", ".join(str(p) for p in parts if p is not None) or "sizes unseen"


def _ranks(ps: list[Any]) -> str:
    return ", ".join(str(p.rank if isinstance(p, Position) else p) for p in ps)


def _row(p: Position) -> dict[str, Any]:
    return {
        "rank": p.rank,
        "host": p.host,
        "source": p.source,
        "state": p.state,
        "in_collective": p.in_collective,
        "seq": p.seq,
        "op": p.op,
        "sizes": p.sizes,
        "call_site": p.site,
        "frame": p.frame,
        "error": p.error,
        "last_step": p.last_step,
        "last_collective": p.last_collective,
        **({"kernel_wait": p.kernel_wait} if p.kernel_wait else {}),
    }
