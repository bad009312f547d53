"""Serve a running job's per-rank figures and live verdicts on a Prometheus endpoint (one per node).

    ciuic-doctor export --pid PID [--run RUN] --port 9464 [--bind 127.0.0.1]
    curl -s localhost:9464/metrics | grep ciuic_rank_up

It listens on 127.0.0.1 unless --bind says otherwise: the endpoint has no authentication and its labels
and values name the job, hosts, ranks, loss and memory, so serving it beyond the machine is a choice.

Series (labels job, host, rank, local_rank, gpu; never a step or a PID): ciuic_rank_up, _stalled,
_waiting, _straggler, _memory_climbing, _overflow_storm (verdict gauges), ciuic_rank_cpu_seconds_total,
_resident_memory_bytes, _unique_memory_bytes, _threads, _read_bytes_total, _written_bytes_total,
_workers; from a watched job's streams ciuic_rank_steps_total (rate() is the step rate),
_last_step_age_seconds, _step_time_seconds, _pre_backward_seconds, _loss, _grad_norm, _loss_scale,
_skipped_steps_total, _tokens_per_second; with NVML ciuic_gpu_utilization_ratio, _memory_used_bytes,
_power_watts, _sm_clock_hertz. deploy/prometheus/ has the scrape config and alert rules (stalled rank,
straggler, overflow storm), deploy/grafana/ a dashboard.

The job label is --job, else the job's TORCHELASTIC_RUN_ID, else the run directory's name. It exits
when the job does. It reads /proc, NVML and the run directory only; it never imports torch.
"""

from __future__ import annotations

import argparse

from ciuic_doctor.cli_args import positive_float, positive_int
from ciuic_doctor.commands.top import add_target

NAME = "export"
HELP = "Prometheus endpoint for a running job: every rank's figures and live verdicts, labelled by rank"
ORDER = 42


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_target(parser, run_positional=False)
    parser.add_argument("--run", metavar="RUN", help="the job's watched run directory (found by itself "
                        "when the ranks run under watch)")  # fmt: skip
    parser.add_argument("--port", type=positive_int, default=9464, help="port to serve /metrics on (9464)")
    parser.add_argument(
        "--bind",
        "--address",
        dest="bind",
        metavar="ADDR",
        default="127.0.0.1",
        help="address to listen on (default 127.0.0.1: this machine only). The endpoint is not "
        "authenticated and serves the job's name, hosts, ranks, loss and memory: give 0.0.0.0 or the "
        "node's address only behind a firewall that lets your Prometheus alone in, or keep 127.0.0.1 "
        "and reach it through an SSH tunnel",
    )
    parser.add_argument("--job", metavar="NAME", help="the job label (default: TORCHELASTIC_RUN_ID or RUN)")
    parser.add_argument(
        "--max-ranks",
        type=positive_int,
        default=256,
        metavar="N",
        help="per-rank series for at most N ranks of this node, those needing attention first (256)",
    )
    parser.add_argument(
        "--duration",
        type=positive_float,
        metavar="S",
        help="stop after S seconds (default: when the job ends)",
    )


def run(args: argparse.Namespace) -> int:
    import time

    from ciuic_doctor.errors import UserError
    from ciuic_doctor.live.metrics import ExportConfig, serve

    if args.pid is None:
        raise UserError("export needs the running job's PID (--pid PID)")
    if args.port > 65535:
        raise UserError(f"--port {args.port}: a port is at most 65535")
    from ciuic_doctor.commands.top import open_job

    job = open_job(args.pid, None, args.interval)
    if args.run is not None:
        from pathlib import Path

        if not Path(args.run).is_dir():
            raise UserError(f"{args.run}: not a directory")
        job.discovery.run_dir = Path(args.run)
    layout = job.discovery.refresh()
    name = args.job or layout.run_id or (layout.run_dir.name if layout.run_dir else None) or f"pid{args.pid}"
    config = ExportConfig(job=name, interval_s=args.interval, max_ranks=args.max_ranks)
    try:
        sampled = serve(job, config, port=args.port, address=args.bind)
    except OSError as exc:
        raise UserError(f"cannot serve on {args.bind}:{args.port}: {exc.strerror or exc}") from None
    print(
        f"ciuic-doctor export: job {name!r}, {len(layout.ranks)} rank(s) found, "
        f"serving http://{args.bind}:{args.port}/metrics every {args.interval:g} s",
        flush=True,
    )
    ends = None if args.duration is None else time.monotonic() + args.duration
    while job.discovery.alive() and (ends is None or time.monotonic() < ends):
        began = time.monotonic()
        sampled.sample_once()
        time.sleep(max(0.0, args.interval - (time.monotonic() - began)))
    print("ciuic-doctor export: the job has ended" if ends is None or time.monotonic() < ends else
          "ciuic-doctor export: --duration reached", flush=True)  # fmt: skip
    return 0
