"""Attach to a running job by PID and sample the memory of its whole process tree.

Give the PID of a training process or of the torchrun agent: every rank and DataLoader worker below it
is followed, including those started later. Each sample goes to RUN/memwatch.jsonl (RSS, USS/PSS where
permitted, CPU %, threads, GPU memory per process from NVML when a driver is present, available memory,
/dev/shm). It runs until the target exits, --duration ends or Ctrl-C, then prints a one-screen summary;
`ciuic-doctor analyze RUN` judges the samples (leaks, fragmentation, worker growth), aligned to the
steps of `watch` when the job records them into the same RUN. It never imports torch.
"""

from __future__ import annotations

import argparse

from ciuic_doctor.cli_args import add_out, positive_float, positive_int

NAME = "memwatch"
HELP = "attach to a running job by PID; sample memory of every rank and worker (no torch import)"
ORDER = 40


def add_arguments(parser: argparse.ArgumentParser) -> None:
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--pid", type=positive_int, help="a training process or the torchrun agent")
    target.add_argument(
        "--step",
        metavar="NAME",
        help="in a Slurm step on each node (srun --overlap --ntasks-per-node=1 ...): watch this node's "
        "part of the job step started with CIUIC_STEP_NAME=NAME (checkup does this), waiting up to "
        "--wait s for it; one stream file per node",
    )
    parser.add_argument(
        "--wait", type=positive_float, default=300.0, metavar="S", help="--step: how long to wait (300)"
    )
    parser.add_argument(
        "--interval", type=positive_float, default=1.0, metavar="S", help="seconds between samples (1.0)"
    )
    parser.add_argument(
        "--duration", type=positive_float, metavar="S", help="stop after S seconds (default: until exit)"
    )
    parser.add_argument(
        "--uss-budget",
        type=positive_float,
        default=0.5,
        metavar="PCT",
        help="%% of one core that USS/PSS reads may take; dearer processes are read less often (0.5)",
    )
    add_out(parser)


def run(args: argparse.Namespace) -> int:
    import os

    from ciuic_doctor.probes.memwatch.sampler import MemwatchConfig, watch
    from ciuic_doctor.rundir.store import default_run_path

    pid, index = args.pid, None
    if args.step:
        from ciuic_doctor.cluster.procs import wait_for_step

        pid = wait_for_step(args.step, args.wait)
        node_id = os.environ.get("SLURM_NODEID", "")
        index = int(node_id) if node_id.isdigit() else None  # one file per node: never two appending
    config = MemwatchConfig(
        pid=pid,
        stream_index=index,
        interval_s=args.interval,
        duration_s=args.duration,
        full_info_budget=args.uss_budget / 100,
    )
    out = default_run_path(NAME, args.out)
    result = watch(config, out)
    print(summary(result))
    # README: 130 interrupted (Ctrl-C), 128 + N stopped by signal N (SIGTERM: 143); records kept either way
    return {"interrupted": 130, "terminated": 143}.get(result.end_reason, 0)


def summary(result) -> str:  # result: ciuic_doctor.probes.memwatch.sampler.WatchResult
    """One screen: per role start/end/peak RSS and USS growth, the machine, and what was not measured."""
    from ciuic_doctor.render_text import table
    from ciuic_doctor.units import format_bytes

    def size(n: int | None) -> str:
        return "-" if n is None else format_bytes(n)

    rows = []
    roles = sorted(result.roles.values(), key=lambda r: _role_key(r.role))
    helpers = [r for r in roles if r.role.startswith("helper")]  # one line for all: they do no work
    for role in (r for r in roles if not r.role.startswith("helper")):
        growth = role.uss_growth
        rows.append(
            [
                role.role,
                len(role.pids),
                size(role.rss_start),
                size(role.rss_end),
                size(role.rss_peak),
                "-" if growth is None else ("+" if growth >= 0 else "") + format_bytes(growth),
                size(role.gpu_peak),
            ]
        )
    lines = [
        f"\nmemwatch {result.target}: {result.samples} samples in {result.duration_s:.1f} s; "
        f"ended: {result.end_reason}",
        table(
            ["role", "procs", "rss start", "rss end", "rss peak", "uss growth", "gpu peak"],
            rows,
            right=(1, 2, 3, 4, 5, 6),
        )
        if rows
        else "no samples were taken",
        "(figures are sums over the role's processes; RSS counts shared pages in every process, USS not)",
    ]
    if helpers:
        count, peak = sum(len(h.pids) for h in helpers), sum(h.rss_peak for h in helpers)
        lines.append(f"helpers (resource tracker, forkserver, ...): {count} processes, rss peak {size(peak)}")
    if result.sys_total is not None:
        lines.append(
            f"machine: available memory min {size(result.sys_available_min)} of {size(result.sys_total)}; "
            f"/dev/shm used peak {size(result.shm_used_peak)}"
        )
    lines.append("GPU: " + ("NVML per process" if result.nvml_reason is None else result.nvml_reason))
    if result.samples:
        how = (
            "every sample"
            if result.full_info_every == 1
            else f"down to every {result.full_info_every} samples"
        )
        lines.append(
            f"USS/PSS: {how} (memory_full_info up to {result.full_info_cost_ms:.2f} ms CPU per process; "
            f"budget {result.full_info_budget:.1%} of a core)"
        )
    if result.walk_every > 1:
        lines.append(
            f"new processes: looked for every {result.walk_every} samples (walking /proc costs more than "
            "0.5% of a core at this interval)"
        )
    lines.extend(f"note: {note}" for note in result.notes[:5])
    lines.append(
        f"records: {result.run.path / 'memwatch.jsonl'}; next: ciuic-doctor analyze {result.run.path}"
    )
    return "\n".join(lines)


def _role_key(role: str) -> tuple[int, int, str]:
    """agent first, then by rank with each rank's workers after it."""
    if role == "agent":
        return (-1, 0, role)
    rank = role.rsplit(" ", 1)[-1]
    return (int(rank) if rank.isdigit() else 10**9, 0 if role.startswith("rank") else 1, role)
