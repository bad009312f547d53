"""Measure DataLoader settings on this node for one rank's share of the CPUs, and recommend the smallest
configuration within the measurement noise of the best.

The dataset is an importable `module:callable` returning a torch Dataset, the job spec's dataset (the
embedded DeepSeek job's by default), or a synthetic one whose samples cost --sample-cost-ms of real CPU
work and weigh --sample-bytes (to model decoding). The CPU budget per local rank is
min(affinity, cgroup quota) // local world size; the swept worker counts stay inside it unless --workers
asks for more. Successive halving drops configurations that cannot win, so the sweep stays within
--budget seconds instead of running the whole grid. Records go to RUN/loader.jsonl.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

from ciuic_doctor.cli_args import add_out, non_negative_float, positive_float, positive_int

NAME = "loader-sweep"
HELP = "measure num_workers / prefetch_factor / pin_memory for your dataset within a CPU and time budget"
ORDER = 50


def add_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_argument_group("dataset (default: the job spec's)")
    source.add_argument(
        "--dataset",
        metavar="MODULE:CALLABLE",
        help="a callable returning a torch Dataset, imported from the current directory "
        "or sys.path, e.g. mydata:build_dataset",
    )
    source.add_argument(
        "--sample-cost-ms",
        type=non_negative_float,
        metavar="MS",
        help="synthetic dataset: CPU milliseconds per sample (real work, not sleep)",
    )
    source.add_argument(
        "--sample-bytes",
        metavar="SIZE",
        help="synthetic dataset: bytes per sample, e.g. 4K, 600K (default 4K)",
    )
    parser.add_argument(
        "--spec",
        metavar="JOB.TOML",
        help="job spec: the current [dataloader] settings, batch size and procs per node, and the dataset "
        "when no other is given (default: the embedded DeepSeek-V3 job)",
    )
    parser.add_argument(
        "--batch-size",
        type=positive_int,
        metavar="B",
        help="samples per batch (default: the spec's batch.per_process)",
    )
    parser.add_argument(
        "--workers",
        metavar="LIST",
        help="num_workers to try, e.g. 0,1,2,4 or 0-4 (default: 0, 1, 2, 3, 4, 6, 8, ... up "
        "to the CPU budget per rank)",
    )
    parser.add_argument(
        "--prefetch",
        metavar="LIST",
        default="2,4",
        help="prefetch_factor values to try with workers (default: 2,4)",
    )
    parser.add_argument(
        "--budget",
        type=positive_float,
        default=60.0,
        metavar="SECONDS",
        help="time budget of the whole sweep (default: 60)",
    )
    parser.add_argument(
        "--local-world-size",
        type=positive_int,
        metavar="N",
        help="ranks on this node sharing its CPUs (default: $LOCAL_WORLD_SIZE, else the "
        "spec's job.procs_per_node)",
    )
    parser.add_argument(
        "--step-ms",
        type=non_negative_float,
        default=0.0,
        metavar="MS",
        help="model the training step: the loop waits MS per batch with the CPU free, as "
        "while an accelerator computes (default 0: the loader alone)",
    )
    parser.add_argument(
        "--timeout",
        type=positive_float,
        default=60.0,
        metavar="SECONDS",
        help="longest wait for one batch before a configuration counts as hung "
        "(DataLoader timeout= plus a watchdog; default 60)",
    )
    add_out(parser)


# More workers than this is a typo, not a sweep: each is a process (~100 MB), and 500 of them exhausted
# this 2-core machine before the first batch.
MAX_WORKERS_PER_CPU = 8
MAX_WORKERS_FLOOR = 32


def max_workers() -> int:
    return max(MAX_WORKERS_FLOOR, MAX_WORKERS_PER_CPU * (os.cpu_count() or 1))


def parse_int_list(text: str, option: str, minimum: int, maximum: int | None = None) -> list[int]:
    """`0,1,2` or `0-4` or both (`0-2,4,8`), sorted and without repeats; UserError on anything else."""
    from ciuic_doctor.errors import UserError

    values: set[int] = set()
    for raw in text.split(","):
        part = raw.strip()
        try:
            if "-" in part[1:]:
                low, high = (int(v) for v in part.split("-", 1))
                if low > high:
                    raise UserError(f"{option} {text!r}: range {part} runs backwards; write {high}-{low}")
                if high - low > 10_000:
                    raise UserError(f"{option} {text!r}: range {part} is too long")
                values.update(range(low, high + 1))
            else:
                values.add(int(part))
        except ValueError:
            raise UserError(f"{option} {text!r}: expected whole numbers like 0,1,2 or 0-4") from None
    if not values:
        raise UserError(f"{option} {text!r}: expected whole numbers like 0,1,2 or 0-4")
    if min(values) < minimum:
        raise UserError(f"{option} {text!r}: values must be {minimum} or more")
    if maximum is not None and max(values) > maximum:
        why = f": {MAX_WORKERS_PER_CPU} per CPU, {os.cpu_count()} CPUs" if option == "--workers" else ""
        raise UserError(f"{option} {text!r}: {max(values)} is too many (at most {maximum}{why})")
    return sorted(values)


SAMPLE_MEMORY_SHARE = 4  # one batch of synthetic samples may take at most 1/4 of the available memory


def check_sample_fits(sample_bytes: int, batch: int) -> None:
    """Refuse --sample-bytes whose batch cannot be held: `--sample-bytes 100G` failed every measurement
    with a bare MemoryError. A batch is built in a worker and copied to the main process, and
    prefetching holds more: a quarter of the available memory for one batch leaves room for them."""
    from ciuic_doctor.errors import UserError
    from ciuic_doctor.units import format_bytes

    try:
        import psutil

        available = psutil.virtual_memory().available
    except (ImportError, OSError):
        return
    need = sample_bytes * max(1, batch)
    if need * SAMPLE_MEMORY_SHARE > available:
        raise UserError(
            f"--sample-bytes {format_bytes(sample_bytes)}: a batch of {batch} such samples is "
            f"{format_bytes(need)}; at most a quarter of the {format_bytes(available)} available is used "
            "for one batch"
        )


def run(args: argparse.Namespace) -> int:
    from ciuic_doctor.errors import ProbeFailed, UserError
    from ciuic_doctor.jobs.spec import load_spec
    from ciuic_doctor.machine.envinfo import cpu_budget
    from ciuic_doctor.rundir.store import RunDir, default_run_path
    from ciuic_doctor.units import parse_size

    synthetic = args.sample_cost_ms is not None or args.sample_bytes is not None
    if args.dataset and synthetic:
        raise UserError("--dataset and --sample-cost-ms/--sample-bytes are different datasets; give one")
    sample_bytes = parse_size(args.sample_bytes) if args.sample_bytes is not None else 4096
    if synthetic and sample_bytes < 1:
        raise UserError("--sample-bytes must be at least 1 byte")
    spec = load_spec(args.spec)
    if synthetic:
        check_sample_fits(sample_bytes, spec.batch.per_process)
    workers = parse_int_list(args.workers, "--workers", 0, max_workers()) if args.workers else None
    prefetch = parse_int_list(args.prefetch, "--prefetch", 1, 1024)
    env_lws = os.environ.get("LOCAL_WORLD_SIZE", "")
    lws = args.local_world_size or (int(env_lws) if env_lws.isdigit() and int(env_lws) > 0 else None)
    lws = lws or spec.job.procs_per_node
    cpu = cpu_budget()
    budget = cpu["usable"] // lws

    # torch from here on; PyTorch's NVML-based check answers is_available() without initialising CUDA,
    # which the forked measuring children could then not use.
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    import torch

    from ciuic_doctor.probes.loader import datasets
    from ciuic_doctor.probes.loader.measure import LoaderConfig
    from ciuic_doctor.probes.loader.sweep import (
        Sweep,
        SweepSettings,
        default_workers,
        lightning_rule,
        shm_usage,
    )

    if args.dataset:
        dataset, source = datasets.load_callable(args.dataset), f"--dataset {args.dataset}"
    elif synthetic:
        dataset = datasets.SyntheticDataset(
            sample_cost_ms=args.sample_cost_ms or 0.0, sample_bytes=sample_bytes
        )
        source = "synthetic"
    else:
        dataset, source = datasets.dataset_from_job_spec(spec)
    batch_size = args.batch_size or spec.batch.per_process
    length = datasets.describe(dataset).get("length")
    if length is not None and length < batch_size:
        raise UserError(f"the dataset has {length} samples, fewer than one batch of {batch_size}")

    # The loop runs like one of the job's ranks: torchrun sets OMP_NUM_THREADS=1 when it starts more
    # than one process per node, and with num_workers=0 the collate runs on those intra-op threads.
    if lws > 1 and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)
    accelerator = torch.cuda.is_available()
    device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0') or 0)}" if accelerator else None
    dl = spec.dataloader
    current = LoaderConfig(
        num_workers=dl.num_workers,
        prefetch_factor=(dl.prefetch_factor or 2) if dl.num_workers else None,
        pin_memory=dl.pin_memory and accelerator,
    )
    settings = SweepSettings(
        batch_size=batch_size,
        workers=workers if workers is not None else default_workers(budget),
        prefetch=prefetch,
        pin_options=(False, True) if accelerator else (False,),
        budget_s=args.budget,
        timeout_s=args.timeout,
        step_ms=args.step_ms,
        cpu_budget_per_rank=budget,
        local_world_size=lws,
        explicit_workers=workers is not None,
        current=current,
        device=device,
        seed=spec.job.seed,
    )
    shm_free, shm_total = shm_usage()
    header = {
        "dataset": {"source": source, **datasets.describe(dataset)},
        "batch_size": batch_size,
        "cpu": cpu,
        "local_world_size": lws,
        "cpu_budget_per_rank": budget,
        "lightning_rule_workers": lightning_rule(cpu["affinity"], lws),
        "workers": settings.workers,
        "prefetch": prefetch,
        "explicit_workers": settings.explicit_workers,
        "pin_memory_swept": accelerator,
        "pin_memory_note": None if accelerator else "no accelerator: pin_memory cannot help, not swept",
        "device": device,
        "torch_threads": torch.get_num_threads(),
        "budget_s": args.budget,
        "timeout_s": args.timeout,
        "step_ms": args.step_ms,
        "current": {
            **current.as_record(),
            "persistent_workers": dl.persistent_workers and dl.num_workers > 0,
        },
        "spec": spec.source,
        "shm_free_bytes": shm_free,
        "shm_total_bytes": shm_total,
    }
    header["current"].pop("config")

    run_dir = RunDir.create(default_run_path(NAME, args.out))
    run_dir.record_environment()
    run_dir.record_probe(NAME, status="running", argv=sys.argv[1:])
    over = [w for w in settings.workers if w > budget]
    print(
        f"loader-sweep -> {run_dir.path}: dataset {source}, batch {batch_size}; CPU budget per rank "
        f"{budget} = {cpu['usable']} usable CPUs (affinity {cpu['affinity']}, quota {cpu['cgroup_quota']}) "
        f"// {lws} local rank(s)" + (f"; asked beyond it: {over}" if over else "")
    )
    sweep = Sweep(run_dir, dataset, settings, header=header, progress=lambda line: print(line, flush=True))
    # SIGTERM (a scheduler's cancel) ends the sweep like Ctrl-C: the measuring child is killed with its
    # workers and the end record is written, instead of leaving them to notice the parent is gone.
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        result = sweep.run()
    except KeyboardInterrupt:
        if _TERMINATED:  # README: SIGTERM is 143, Ctrl-C 130; the records are kept either way
            from ciuic_doctor.launch import Interrupted

            run_dir.record_probe(NAME, status="killed")
            raise Interrupted(signal.SIGTERM) from None
        run_dir.record_probe(NAME, status="interrupted")
        raise
    failed = [
        r for r in result.records if r.get("kind") == "measure" and r.get("status") not in ("ok", "skipped")
    ]
    run_dir.record_probe(
        NAME,
        status="failed" if failed else "ok",
        stopped=result.stopped,
        measurements=result.measurements,
        elapsed_s=round(result.elapsed_s, 3),
    )
    print_summary(run_dir, result)
    if failed:
        first = failed[0]
        raise ProbeFailed(
            f"{len(failed)} measurement(s) failed, first {first['config']}: {first['status']}: "
            f"{first.get('error')} (records in {run_dir.path / 'loader.jsonl'})"
        )
    return 0


_TERMINATED: list[int] = []  # the signal that ended the sweep, when it was not Ctrl-C


def _interrupt(signum: int, frame: object) -> None:
    _TERMINATED.append(signum)
    raise KeyboardInterrupt


def print_summary(run_dir, result) -> None:  # (RunDir, SweepResult)
    """The sweep's configurations side by side, then the loader findings."""
    from ciuic_doctor.analysis.loader import analyze_records, last_sweep
    from ciuic_doctor.render_text import findings_table, table

    header, records = last_sweep(result.records)
    findings = analyze_records(header, records)
    ev = findings[0].evidence
    rows = [
        [
            c["config"],
            f"{c['samples_per_s']:.1f}",
            f"±{c['rel_se_pct']:.1f}%",
            ",".join(str(r + 1) for r in c["rounds"]),
            "yes" if c["eligible"] else "over budget",
        ]
        for c in ev.get("configs") or []
    ]
    print(f"\n{result.measurements} measurements in {result.elapsed_s:.1f} s ({result.stopped})")
    if rows:
        print(table(["config", "samples/s", "se", "rounds", "in budget"], rows, right=(1, 2)))
    side = [
        ["recommended", _cfg(ev.get("recommended"))],
        ["best measured", _cfg(ev.get("best"))],
        ["knee (90 % of best)", f"num_workers={ev.get('knee_workers')}"],
        ["current (job spec)", _cfg(ev.get("current"), ev.get("current_samples_per_s"))],
        [
            "Lightning's rule",
            f"num_workers={ev.get('lightning_rule_workers')}"
            + (
                f"  {ev['lightning_rule_samples_per_s']:.1f} samples/s"
                if ev.get("lightning_rule_samples_per_s")
                else ""
            ),
        ],
    ]
    print()
    print(table(["", "settings"], side))
    print()
    print(findings_table(findings))
    print(f"\nrecords: {run_dir.path / 'loader.jsonl'}; judge with: ciuic-doctor analyze {run_dir.path}")


def _cfg(cfg: dict | None, rate: float | None = None) -> str:
    if not cfg:
        return "-"
    text = " ".join(
        f"{k}={cfg.get(k)}" for k in ("num_workers", "prefetch_factor", "pin_memory", "persistent_workers")
    )
    rate = rate if rate is not None else cfg.get("samples_per_s")
    return f"{text}  {rate:.1f} samples/s" if rate is not None else text
