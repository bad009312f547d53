"""watch_observe's raw facts -> the `observed` record, in the job spec's sections and key names.

A key is present only when it was observed; `ciuic_doctor.jobs.observed` fills the rest from the
defaults and marks them assumed. Extra keys the spec has no room for (`optim.class`, `optim.scheduler`,
`optim.lr_ran`,
`dataloader.sampler`, `distributed.wrapper`...) sit beside the spec keys, for the report to show.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from ciuic_doctor.launch import default_pg_timeout_s

# The spec's optimizer names (jobs/spec.py) for the classes that have one; others keep only `class`.
OPTIMIZER_NAMES = {"adamw": "adamw", "adam": "adam", "sgd": "sgd", "fusedadam": "adamw", "adamw8bit": "adamw"}
# Scheduler arguments that give the planned number of optimizer steps, by class.
TOTAL_STEPS_ARGS = ("total_steps", "num_training_steps", "T_max", "total_iters")


OBSERVED_SCHEMA = 1


def script_name(argv: list[str]) -> str:
    """What the report calls the job: the script's file name, or the module's name for `-m`.

    >>> script_name(["runs/train.py", "--lr", "3e-4"])
    'train.py'
    >>> script_name(["/site-packages/mypkg/__main__.py", "train"])
    'mypkg train'
    """
    if not argv:
        return "script"
    path = Path(argv[0])
    if path.name == "__main__.py":  # `python -m package`: name the package (and its sub-command)
        return " ".join([path.parent.name, *argv[1:2]])
    return path.name


def build(observer: Any) -> dict[str, Any]:
    """The `observed` record of one watch session (see watch_observe)."""
    from ciuic_doctor.machine.envinfo import redact_argv

    argv = observer.argv or _watched_argv() or [*sys.argv]
    schedulers = [{k: v for k, v in s.items() if k != "_id"} for s in observer.schedulers]
    planned = _planned_steps(schedulers)
    job: dict[str, Any] = {"name": script_name(argv), "script": argv[0] if argv else None}
    job["argv"] = redact_argv(argv)
    job.update(_world(observer))
    if observer.seed is not None:
        job["seed"] = observer.seed
    if observer.steps:
        job["steps"] = planned or observer.steps
        job["steps_recorded"] = observer.steps
    out: dict[str, Any] = {"schema": OBSERVED_SCHEMA, "source": "watch", "job": job}
    loader = _train_loader(observer)
    batch: dict[str, Any] = {}
    if loader is not None and loader.get("batch_size") is not None:
        batch["per_process"] = loader["batch_size"]
    if observer.accumulation:  # backward calls from one call site per step: micro-batches accumulated
        batch["grad_accum"] = max(1, observer.accumulation.most_common(1)[0][0])
    elif observer.backward_calls:
        batch["grad_accum"] = observer.backward_calls.most_common(1)[0][0]
    out["batch"] = batch
    out["optim"] = _optim(observer, schedulers, job.get("steps"))
    out["precision"] = _precision(observer)
    out["dataloader"] = {**loader, "loaders": len(observer.loaders)} if loader is not None else {}
    out["distributed"] = _distributed(observer)
    out["model"] = (
        {"parameters": observer.parameters, "param_dtype": observer.param_dtype}
        if observer.parameters is not None
        else {}
    )
    from ciuic_doctor.probes.watch.overrides import record as overrides  # watch --set

    if forced := overrides():
        out["overrides"] = forced  # per key: the script's own value and the one in force
    return out


def _watched_argv() -> list[str]:
    """The command line `watch` runs (a process that stepped nothing: its sys.argv is ciuic-doctor's)."""
    from ciuic_doctor.probes.watch import children

    target = children.watched_argv()
    if not target:
        return []
    return [target[1], *target[2:]] if target[0] == "-m" and len(target) > 1 else target


def _world(observer: Any) -> dict[str, Any]:
    world = observer.process_group.get("world_size") or int(os.environ.get("WORLD_SIZE") or 1)
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if world == 1:
        return {"nodes": 1, "procs_per_node": 1}
    if local and int(local) > 0 and world % int(local) == 0:
        return {"nodes": world // int(local), "procs_per_node": int(local)}
    return {}  # several ranks, but how they sit on nodes is unknown


def _train_loader(observer: Any) -> dict[str, Any] | None:
    if not observer.loaders:
        return None
    index = observer.train_loader if observer.train_loader is not None else 0
    return dict(observer.loaders[index])


def _planned_steps(schedulers: list[dict[str, Any]]) -> int | None:
    for scheduler in schedulers:
        lam = scheduler.get("lr_lambda")
        args = {**scheduler, **(lam if isinstance(lam, dict) else {})}
        for key in TOTAL_STEPS_ARGS:
            if isinstance(args.get(key), int) and args[key] > 0:
                return int(args[key])
        if isinstance(args.get("epochs"), int) and isinstance(args.get("steps_per_epoch"), int):
            return args["epochs"] * args["steps_per_epoch"]  # OneCycleLR's other form
    return None


def _largest_group(entry: dict[str, Any]) -> dict[str, Any]:
    groups = entry.get("groups_at_init") or [entry.get("defaults") or {}]
    return max(groups, key=lambda g: g.get("numel", 0))


def _optim(observer: Any, schedulers: list[dict[str, Any]], steps: int | None) -> dict[str, Any]:
    primary = next((o for o in observer.optimizers if "param_groups" in o), None)
    if primary is None:
        return {}
    group = _largest_group(primary)
    optim: dict[str, Any] = {"class": primary["class"]}
    name = OPTIMIZER_NAMES.get(primary["class"].lower())
    if name:
        optim["name"] = name
    # every hyper-parameter the class was built with (LBFGS max_iter, Adafactor beta2_decay, SGD nesterov)
    optim["hyper_parameters"] = dict(primary.get("defaults") or {})
    if isinstance(group.get("lr"), int | float):  # as constructed, beside the schedule that ran (lr_ran)
        optim["lr_constructed"] = float(group["lr"])
    lr = observer.lr
    if lr:
        # The spec's LR is the peak the job ran, as it ran it: no scaling rule applied on top.
        optim["base_lr"] = lr["peak"]
        optim["lr_scaling"] = "none"
        optim["lr_ran"] = lr
    elif isinstance(group.get("lr"), int | float):
        optim["base_lr"] = float(group["lr"])
        optim["lr_scaling"] = "none"
    for key in ("weight_decay", "eps", "momentum"):
        if isinstance(group.get(key), int | float):
            optim[key] = float(group[key])
    if isinstance(group.get("betas"), list):
        optim["betas"] = [float(b) for b in group["betas"]]
    if observer.records:
        # None (null) = the script never called clip_grad_norm_: no threshold, not a threshold of 0
        optim["clip_max_norm"] = observer.clip_max_norms.most_common(1)[0][0]
    warmup = _warmup_pct(schedulers, lr, steps)
    if warmup is not None:
        optim["warmup_pct"] = warmup
    groups = primary.get("param_groups") or []
    if len(groups) > 1:
        optim["param_groups"] = groups
    if schedulers:
        optim["scheduler"] = schedulers[-1] if len(schedulers) == 1 else schedulers
    if len(observer.optimizers) > 1:
        optim["optimizers"] = [o["class"] for o in observer.optimizers]
    if observer.coupled:  # [i, j]: optimizer i's loss reaches optimizer j's parameters (adversarial)
        optim["coupled_optimizers"] = sorted([list(pair) for pair in observer.coupled])
    return optim


def _warmup_pct(schedulers: list[dict[str, Any]], lr: dict[str, Any], steps: int | None) -> float | None:
    """The share of the planned steps spent warming up: the scheduler's own argument where it has one
    (OneCycleLR pct_start; HF's num_warmup_steps / num_training_steps), else none: the LR the steps ran
    says where the peak was, which `optim.lr_ran` keeps."""
    for scheduler in schedulers:
        if scheduler.get("class") == "OneCycleLR" and isinstance(scheduler.get("pct_start"), int | float):
            return float(scheduler["pct_start"])
        lam = scheduler.get("lr_lambda")
        if isinstance(lam, dict):
            warm, total = lam.get("num_warmup_steps"), lam.get("num_training_steps")
            if isinstance(warm, int) and isinstance(total, int) and total > 0:
                return warm / total
    return None


def _precision(observer: Any) -> dict[str, Any]:
    if not observer.steps:
        return {}
    scaler = observer.scaler if observer.scaler and observer.scaler["enabled"] else None
    dtype = (observer.autocast or {}).get("dtype")
    mode = "fp32"
    if scaler is not None or dtype == "float16" or observer.param_dtype == "float16":
        mode = "fp16"
    elif dtype == "bfloat16" or observer.param_dtype == "bfloat16":
        mode = "bf16"
    out: dict[str, Any] = {"mode": mode, "autocast": observer.autocast}
    if scaler is not None:
        out.update(
            init_scale=scaler["init_scale"],
            growth_interval=scaler["growth_interval"],
            growth_factor=scaler["growth_factor"],
            backoff_factor=scaler["backoff_factor"],
        )
    return out


def _distributed(observer: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"env": observer.env}
    pg = observer.process_group
    if pg:
        backend = str(pg.get("backend") or "")
        name = "nccl" if "nccl" in backend else "gloo" if "gloo" in backend else None
        if name:
            out["backend"] = name
        if pg.get("timeout_known", True):
            # No timeout given: the job runs with PyTorch's default for its backend (600 s NCCL, 1800 s
            # otherwise; reference/collectives.md).
            out["timeout_s"] = pg.get("timeout_s") or default_pg_timeout_s(name)
            out["timeout_is_default"] = pg.get("timeout_s") is None
        out["world_size"] = pg.get("world_size")
        out["local_world_size"] = int(os.environ.get("LOCAL_WORLD_SIZE") or 0) or None
    if observer.wrapper:
        out.update(observer.wrapper)
    return out
