"""comm-bench on the ranks torchrun (or `launch_local`) started: nccl-tests-grade collective sweeps.

One rank's path through a run:
  1. rank 0 points NCCL's TUNING log at the run directory, then every rank joins the process group
     (nccl with CUDA, else gloo) and a gloo control group for barriers and gathering figures;
  2. for each phase (comm_phases: one fresh NCCL group per forced all_reduce algorithm, one with NCCL's
     own choice for the rest; a single phase on gloo), each collective and each size, every placement
     is measured (comm_measure); rank 0 folds the ranks' figures into one record in RUN/comm.jsonl,
     written as soon as it exists, and prints the table line;
  3. wrong elements or a missed --min-busbw floor end the run with exit code 1; a dead or hung rank
     ends it with one message naming the rank and host (comm_faults).
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ciuic_doctor.cluster import node_identity
from ciuic_doctor.errors import ProbeFailed
from ciuic_doctor.launch import agree_on_run_dir, init_distributed
from ciuic_doctor.machine import nccl
from ciuic_doctor.measures.ranks import slowest_rank
from ciuic_doctor.probes.comm import table as comm_table
from ciuic_doctor.probes.comm.collectives import (
    NCCL_TESTS_TYPE,
    PLACEMENT_NOTE,
    PLACEMENTS,
    REDUCING,
    Shape,
    elem_bytes,
    shape,
    sweep_sizes,
)
from ciuic_doctor.probes.comm.faults import (
    Terminated,
    Watch,
    default_store,
    fault_from_env,
    first_line,
    inject,
)
from ciuic_doctor.probes.comm.measure import Timing, aggregate, measure_row
from ciuic_doctor.probes.comm.phases import (
    Phase,
    enable_tuning_log,
    nccl_version,
    phase_group,
    plan_phases,
    supported,
)
from ciuic_doctor.rundir.store import RunDir, default_run_path
from ciuic_doctor.units import format_size_short

PROBE = "comm-bench"
STREAM = "comm"


@dataclass(kw_only=True)
class BenchConfig:
    collectives: list[str] = field(default_factory=lambda: list(nccl.COLLECTIVES))
    min_bytes: int = 1 << 10
    max_bytes: int = 64 << 20
    step_factor: float = 2.0
    dtype: str = "float32"
    warmup: int = 2
    iters: int | None = None  # None: as many as fit time_budget_s per size (min_iters..max_iters)
    time_budget_s: float = 0.15
    min_iters: int = 5
    max_iters: int = 1000
    algos: list[str] | None = None  # None: ring,tree on NCCL; gloo has one algorithm
    timeout_s: float = 120.0
    min_busbw_gbps: float | None = None
    bucket_bytes: int = 25 << 20  # DDP's bucket_cap_mb default: the all_reduce size a DDP job issues
    root: int = 0
    out: str | None = None
    argv: list[str] = field(default_factory=list)
    splits_from: str | None = None  # a run's recorded MoE routing -> all_to_all split sizes


class Bench:
    """One rank's run: groups, device, watch, and on rank 0 the run directory and the totals."""

    def __init__(self, cfg: BenchConfig) -> None:
        self.cfg = cfg
        self.rows = 0
        self.wrong_total = 0
        self.table_avgs: dict[str, float] = {}
        self.run: RunDir | None = None
        self.writer: Any = None
        self.tuning: nccl.TuningTail | None = None
        self.probe_entry: dict[str, Any] = {}
        self.records: list[dict[str, Any]] = []  # rank 0: what went to comm.jsonl, for the summary
        self.not_run: dict[str, str] = {}  # collective -> why the backend could not run it
        self.timing = Timing(
            warmup=cfg.warmup,
            iters=cfg.iters,
            budget_s=cfg.time_budget_s,
            min_iters=cfg.min_iters,
            max_iters=cfg.max_iters,
        )

    def start(self) -> None:
        path = default_run_path(PROBE, self.cfg.out)  # rank 0's choice is the one every rank takes
        version = nccl_version()
        if os.environ.get("RANK", "0") == "0":
            self.tuning = enable_tuning_log(RunDir.create(path).path, version)
        self.rank, self.world, self.backend = init_distributed(self.cfg.timeout_s)
        self.path = agree_on_run_dir(path)
        self.version = version if self.backend == "nccl" else None
        local = int(os.environ.get("LOCAL_RANK", "0"))
        self.device = torch.device("cuda", local) if self.backend == "nccl" else torch.device("cpu")
        # Barriers, iteration counts and figures travel over gloo on the CPU: they stay off the GPU
        # timeline and out of NCCL's TUNING log.
        self.control = None if self.backend == "gloo" else dist.new_group(backend="gloo")
        # Each rank's node as its scheduler names it (two nodes may share a host name) and its host name
        where: list[Any] = [None] * self.world
        dist.all_gather_object(where, node_identity(), group=self.control)
        self.nodes = [{"rank": r, **w} for r, w in enumerate(where)]
        self.hosts = [str(w["node"]) for w in where]
        self.watch = Watch(
            store=default_store(),
            rank=self.rank,
            world_size=self.world,
            hosts=self.hosts,
            timeout_s=self.cfg.timeout_s,
            defer_sigterm=True,  # a row every rank finished is written before the rank stops
        )
        self.watch.start()
        self.fault = fault_from_env()
        if self.rank == 0:
            self.run = RunDir.create(self.path)
            self.writer = self.run.writer(STREAM)
            self.run.record_environment()
            self.probe_entry = {
                "status": "running",
                "argv": self.cfg.argv,
                "config": asdict(self.cfg),
                "backend": self.backend,
                "world_size": self.world,
                "hosts": self.hosts,
                "nodes": self.nodes,
                "nccl_version": nccl.format_version(self.version),
                "tuning_log": str(self.tuning.path) if self.tuning else None,
                "started": time.time(),
            }
            self.run.record_probe(PROBE, **self.probe_entry)

    def say(self, text: str) -> None:
        if self.rank == 0:
            print(text, flush=True)

    def sweep(self) -> None:
        cfg = self.cfg
        phases, notes = plan_phases(self.backend, cfg.collectives, cfg.algos, self.version)
        version = f", NCCL {nccl.format_version(self.version)}" if self.version else ""
        self.say(
            f"# comm-bench: {self.world} ranks on {_count_nodes(self.hosts)}, backend {self.backend}"
            f"{version}, dtype {cfg.dtype}; records -> {self.path / 'comm.jsonl'}"
        )
        for note in notes:
            self.say(f"# note: {note}")
        if self.world == 1:
            self.say(
                "# WARNING: world size 1: busbw is 0 by definition (no peer to move data to). Launch several "
                "ranks: torchrun --nproc-per-node N ..., or comm-bench --nproc N."
            )
        for phase in phases:
            self.watch.step(f"creating the process group for algo {phase.algo}")
            with phase_group(self.backend, phase, self.device) as group:
                for collective in phase.collectives:
                    self.table(phase, collective, group)

    def table(self, phase: Phase, collective: str, group: Any) -> None:
        """One nccl-tests table: every size of `collective` in `phase`, line by line."""
        cfg = self.cfg
        base = {
            "collective": collective,
            "algo": phase.algo,
            "backend": self.backend,
            "dtype": cfg.dtype,
            "world_size": self.world,
            "nccl_version": nccl.format_version(self.version),
            "nccl_algo_env": phase.nccl_algo,
        }
        self.watch.step(f"{collective} support check [algo {phase.algo}]")
        reason = supported(
            collective,
            dtype=cfg.dtype,
            device=self.device,
            rank=self.rank,
            world_size=self.world,
            group=group,
            control=self.control,
            root=cfg.root,
        )
        if reason:
            self.not_run[collective] = reason
            self.say(f"# {collective}: not run on {self.backend}: {reason}")
            if self.writer:
                self.writer.write({**base, "status": "not_run", "reason": reason})
            return
        self.say("")
        self.say(
            comm_table.header(
                collective=collective,
                algo=phase.algo,
                dtype=cfg.dtype,
                backend=self.backend,
                world_size=self.world,
                note=PLACEMENT_NOTE.get(collective, ""),
            )
        )
        extra = {
            "redop": "sum" if collective in REDUCING else "none",
            "root": cfg.root if collective == "broadcast" else -1,
            "warmup": cfg.warmup,
        }
        busbws, wrong = [], 0
        for size in sweep_sizes(cfg.min_bytes, cfg.max_bytes, cfg.step_factor):
            sh = shape(collective, size, elem_bytes(cfg.dtype), self.world)
            if sh is None:  # smaller than one element per rank
                continue
            inject(self.fault, self.rank, size)
            cells: dict[bool, comm_table.Cell | None] = {}
            used = None
            for inplace in PLACEMENTS[collective]:
                record = self.row(phase, collective, sh, inplace, group)
                if record is None:
                    continue
                self.writer.write({**base, **extra, **record})
                self.records.append(record)
                cells[inplace] = comm_table.Cell(
                    time_us=record["time_us"],
                    algbw_gbps=record["algbw_gbps"],
                    busbw_gbps=record["busbw_gbps"],
                    wrong=record["wrong"],
                )
                busbws.append(record["busbw_gbps"])
                wrong += record["wrong"]
                if record["algo_used"]:
                    used = f"{record['algo_used']}/{record['proto_used']}".upper()
            self.say(
                comm_table.line(
                    size=sh.bytes,
                    count=sh.count,
                    type_name=NCCL_TESTS_TYPE[cfg.dtype],
                    redop=extra["redop"],
                    root=extra["root"],
                    cells=cells,
                    algo_used=used,
                )
            )
        if self.rank == 0:
            text, avg = comm_table.footer(busbws, wrong)
            self.say(text)
            self.table_avgs[f"{collective} [algo {phase.algo}]"] = avg
            self.wrong_total += wrong

    def row(
        self, phase: Phase, collective: str, sh: Shape, inplace: bool, group: Any
    ) -> dict[str, Any] | None:
        """Measure one placement on every rank; rank 0 gets the record's figures, the others None."""
        where = "in-place" if inplace else "out-of-place"
        self.watch.step(f"{collective} {format_size_short(sh.bytes)} {where} [algo {phase.algo}]")
        mine = measure_row(
            collective,
            sh,
            inplace=inplace,
            dtype=self.cfg.dtype,
            device=self.device,
            rank=self.rank,
            world_size=self.world,
            group=group,
            control=self.control,
            timing=self.timing,
            root=self.cfg.root,
            tick=self.watch.tick,
        )
        gathered: list[Any] | None = [None] * self.world if self.rank == 0 else None
        dist.gather_object(mine, gathered, dst=0, group=self.control)
        self.rows += 1
        if gathered is None:
            return None
        used = (
            nccl.algo_used(self.tuning.read_new(), collective, sh.bytes, self.world) if self.tuning else None
        )
        figures = aggregate(gathered, collective=collective, sh=sh, hosts=self.hosts)
        return {
            "status": "ok",
            "inplace": inplace,
            "algo_used": used[0] if used else None,
            "proto_used": used[1] if used else None,
            **figures,
        }

    def verdict(self) -> str | None:
        """Rank 0's failure message (wrong elements, a table below the floor), or None."""
        problems = []
        if not self.rows and self.not_run:
            problems.append(
                f"nothing could run on {self.backend} with {self.cfg.dtype}: "
                + "; ".join(f"{c}: {why}" for c, why in self.not_run.items())
            )
        if self.wrong_total:
            problems.append(f"{self.wrong_total} wrong elements: a collective returned a wrong result")
        floor = self.cfg.min_busbw_gbps
        low = {k: v for k, v in self.table_avgs.items() if floor is not None and v < 0.9 * floor}
        if low:
            listed = ", ".join(f"{k} {v:.3f} GB/s" for k, v in low.items())
            problems.append(f"average busbw below 0.9 x --min-busbw {floor:g} GB/s: {listed}")
        return "; ".join(problems) or None

    def summary(self) -> str:
        """Rank 0's closing lines: rows, wrong elements, each table's average busbw, a straggler if any."""
        avgs = ", ".join(f"{name} {avg:.3g}" for name, avg in self.table_avgs.items())
        lines = [
            f"# {self.rows} rows, {self.wrong_total} wrong elements, in {self.path / 'comm.jsonl'}",
            f"# average busbw (GB/s): {avgs}",
        ]
        slow = slowest_rank(self.records)
        if slow is not None and slow.is_straggler:
            host = slow.hosts.get(slow.rank) or "?"
            lines.append(
                f"# straggler: rank {slow.rank} on {host} is the slowest in {slow.rows_slowest} of "
                f"{slow.rows} rows, by {slow.slowdown_pct:.0f}% (median) over the other ranks"
            )
        return "\n".join(lines)

    def finish(self, status: str, message: str | None, *, reporter: bool = False) -> None:
        """Record the outcome in meta.json: rank 0 always; the rank that named a dead peer as well when
        it shares rank 0's file system (rank 0 may be the one that died)."""
        if self.rank == 0 and self.run is not None:
            self.probe_entry.update(
                status=status,
                message=message,
                rows=self.rows,
                wrong_total=self.wrong_total,
                avg_busbw_gbps=self.table_avgs,
                finished=time.time(),
            )
            self.run.record_probe(PROBE, **self.probe_entry)
        elif reporter and self.hosts[self.rank] == self.hosts[0] and Path(self.path).is_dir():
            run = RunDir.open(self.path)
            entry = run.read_meta().get("probes", {}).get(PROBE, {})
            run.record_probe(
                PROBE, **{**entry, "status": status, "message": message, "finished": time.time()}
            )


def _count_nodes(hosts: list[str]) -> str:
    """`2 nodes (n1, n2)`; one node: `1 host`."""
    names = list(dict.fromkeys(hosts))
    if len(names) == 1:
        return "1 host"
    shown = ", ".join(names[:8]) + (", ..." if len(names) > 8 else "")
    return f"{len(names)} nodes ({shown})"


def run_bench(cfg: BenchConfig, bench_class: type[Bench] | None = None) -> int:
    """Run this rank's part. 0 when every row is right (and above the floor); ProbeFailed otherwise on the
    rank that says why; 1 on the ranks that leave the saying to it."""
    bench = (bench_class or Bench)(cfg)  # splits_bench.SplitsBench for --splits-from
    bench.start()
    try:
        bench.sweep()
        message = bench.verdict()
        bench.finish("failed" if message else "ok", message)
        bench.say(f"\n{comm_table.BUSBW_NOTE}")
        bench.say(bench.summary())
        if message:
            raise ProbeFailed(message)
        return 0
    except (RuntimeError, Terminated) as exc:
        mine = bench.watch.report(first_line(exc))
        bench.finish("failed", mine or bench.watch.stored_failure(), reporter=bool(mine))
        if mine:
            kept = f"; the {bench.rows} rows finished are in {bench.path / 'comm.jsonl'}"
            raise ProbeFailed(mine + kept) from None
        return 1
    finally:
        bench.watch.stop()
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
