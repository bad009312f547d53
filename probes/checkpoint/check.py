"""checkpoint-check on the ranks torchrun (or `launch_local`) started: what a checkpoint of the job costs,
and whether a run resumed from it continues the run that never stopped.

One rank's path through a run (the seed article's trick 7, measured):
  1. join the process group with a generous timeout (max(3600 s, the job's)): the job's own timeout is
     what gets judged, and must not end the measurement of a save that outlasts it;
  2. the reference Trainer trains N steps (--steps-before);
  3. cost: R saves the job's way, then R loads each way, side by side (checkpoint_cost), one record per
     rank and repetition, written as it is measured;
  4. rank 0 inspects the saved file: does weights_only=True read it, which kinds of state does it hold
     (checkpoint_inspect);
  5. the reference trains M more steps (--steps-after): losses and a fingerprint (checkpoint_fidelity);
  6. every variant (the checkpoint as saved, then one per --drop) restarts in a fresh Trainer, trains the
     same M steps, and records the same;
  7. rank 0 judges the records (analysis/checkpoint.py) and prints the findings.
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ciuic_doctor.errors import ProbeFailed
from ciuic_doctor.launch import agree_on_run_dir, default_pg_timeout_s
from ciuic_doctor.probes.checkpoint.cost import (
    Methods,
    agree,
    distributed,
    measure_broadcast_load,
    measure_every_rank_load,
    measure_save,
    torch_load,
)
from ciuic_doctor.probes.checkpoint.fidelity import fingerprint, restart, train_steps, without
from ciuic_doctor.probes.checkpoint.inspection import absent, check_safety, inspect_record
from ciuic_doctor.probes.checkpoint.options import Variant, parse_drops
from ciuic_doctor.rundir.schemas import RESUME_REFERENCE
from ciuic_doctor.rundir.store import RunDir, default_run_path
from ciuic_doctor.units import format_bytes

PROBE = "checkpoint-check"
STREAM = "checkpoint"
PROBE_TIMEOUT_S = 3600.0


@dataclass(kw_only=True)
class CheckConfig:
    spec_path: str | None = None
    steps_before: int = 4
    steps_after: int = 4
    repeats: int = 3
    save: str | None = None
    load: str | None = None
    drops: list[str] = field(default_factory=list)
    strict: bool = False
    out: str | None = None
    argv: list[str] = field(default_factory=list)


def gather(value: Any) -> list[Any]:
    """`value` from every rank, on every rank (small objects only: figures for the progress lines)."""
    if not distributed():
        return [value]
    values: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


class Check:
    """One rank's run: spec, world, run directory, writer; rank 0 prints."""

    def __init__(self, cfg: CheckConfig) -> None:
        from ciuic_doctor.jobs.spec import load_spec, with_updates
        from ciuic_doctor.jobs.train import setup_distributed

        self.cfg = cfg
        self.spec = load_spec(cfg.spec_path)
        self.methods = Methods.from_options(cfg.save, cfg.load)
        self.variants = [Variant(), *parse_drops(cfg.drops)]
        self.probe_timeout_s = max(PROBE_TIMEOUT_S, self.spec.distributed.timeout_s)
        self.world = setup_distributed(
            with_updates(self.spec, {"distributed.timeout_s": self.probe_timeout_s})
        )
        self.lead = self.world.rank == 0
        self.run = RunDir.create(agree_on_run_dir(default_run_path(PROBE, cfg.out)))
        self.writer = self.run.writer(STREAM, rank=self.world.rank)
        # Not RUN/checkpoints: the job phase of a checkup keeps its own checkpoints there.
        self.directory = self.run.path / "checkpoint-check"

    def say(self, text: str) -> None:
        if self.lead:
            print(text, flush=True)

    def make_trainer(self) -> Any:
        from ciuic_doctor.jobs.inject import Injections
        from ciuic_doctor.jobs.train import Trainer

        total = self.cfg.steps_before + self.cfg.steps_after
        return Trainer(self.spec, self.world, total_steps=total, injections=Injections())

    def applicable(self, trainer: Any) -> set[str]:
        """The kinds of state this job needs to resume."""
        kinds = {"model", "optimizer", "scheduler", "rng.python", "rng.numpy", "rng.torch", "sampler", "step"}
        if trainer.scaler.is_enabled():
            kinds.add("scaler")
        if self.world.device.type == "cuda":
            kinds.add("rng.cuda")
        return kinds

    # ---- the run ----------------------------------------------------------------------------------
    def start(self, trainer: Any) -> None:
        """Rank 0: the config record, meta.json, the first progress line."""
        if not self.lead:
            return
        import psutil

        backend = self.world.backend or "none"
        spec = self.spec
        config = {
            "kind": "config",
            "nproc": self.world.world,
            "local_world_size": int(os.environ.get("LOCAL_WORLD_SIZE", self.world.world)),
            "backend": backend,
            "device": self.world.device.type,
            "precision": spec.precision.mode,
            "parameters": trainer.parameter_count,
            "steps_before": self.cfg.steps_before,
            "steps_after": self.cfg.steps_after,
            "repeats": self.cfg.repeats,
            "save_method": self.methods.save_name,
            "load_method": self.methods.load_name,
            "variants": [v.name for v in self.variants],
            "timeout_s": spec.distributed.timeout_s,
            "pytorch_default_timeout_s": default_pg_timeout_s(backend),
            "probe_timeout_s": self.probe_timeout_s,
            "every_steps": spec.checkpoint.every_steps,
            "host_total_bytes": psutil.virtual_memory().total,
            "host_available_bytes": psutil.virtual_memory().available,
            "torch": torch.__version__,
            "spec_source": spec.source,
        }
        self.writer.write(config)
        self.run.record_environment()
        if not self.run.read_meta().get("spec"):
            self.run.update_meta(spec=spec.to_dict(), spec_source=spec.source)
        self.run.record_probe(PROBE, status="running", argv=self.cfg.argv, nproc=self.world.world)
        self.say(
            f"checkpoint-check of {spec.job.name}: {trainer.parameter_count / 1e6:.2f} M parameters, "
            f"{self.world.world} rank(s) ({backend}, {self.world.device.type}), {spec.precision.mode}; "
            f"save: {self.methods.save_name}; load: {self.methods.load_name} -> {self.run.path}"
        )

    def measure_cost(self, trainer: Any) -> Path:
        path = Path()
        for repeat in range(self.cfg.repeats):
            record = measure_save(trainer, self.directory, self.methods, repeat)
            self.writer.write(record)
            path = Path(record["path"])
            waits = gather(record["barrier_wait_s"])
            self.say(
                f"save {repeat + 1}/{self.cfg.repeats}: rank 0 {record['save_s']:.3f} s, "
                f"{format_bytes(record['size_bytes'])}; barrier wait per rank "
                + " ".join(f"{w:.3f}" for w in waits)
                + " s"
            )
        return path

    def inspect_saved(self, path: Path, trainer: Any) -> dict[str, Any]:
        """Rank 0 reads the saved file with weights_only=True; every rank gets what it found."""
        info: list[Any] = [None]
        if self.lead:
            if path.is_file():
                record = inspect_record(check_safety(path, trusted=True), role="saved")
            else:
                record = {
                    "kind": "inspect",
                    "role": "saved",
                    "path": str(path),
                    "container": "directory",
                    "safe": None,
                    "error": "the save wrote a directory, not one torch file",
                }
            if record.get("container") == "not-torch":
                record["error"] = (
                    f"not a torch.save file (the format of --save {self.methods.save_name}): weights_only "
                    "does not apply; what loading it runs is up to your --load"
                )
            self.writer.write(record)
            loadable = record.get("weights_only_loaded") or self.methods.load is not torch_load
            reason = None if loadable else record.get("error") or "not readable with weights_only=True"
            info[0] = {"present": record.get("present") or {}, "loadable": loadable, "reason": reason}
            missing, _ = absent(info[0]["present"], applicable=self.applicable(trainer))
            if record.get("weights_only_loaded"):
                self.say(
                    f"saved checkpoint: loads with weights_only=True; holds "
                    f"{', '.join(sorted(info[0]['present'])) or 'nothing recognised'}"
                    + (f"; lacks {', '.join(missing)}" if missing else "")
                )
            else:
                self.say(f"saved checkpoint: {record.get('error')}")
        if distributed():
            dist.broadcast_object_list(info, src=0)
        return info[0]

    def measure_loads(self, path: Path) -> None:
        for repeat in range(self.cfg.repeats):
            own = measure_every_rank_load(path, self.methods, repeat)
            self.writer.write(own)
            line = f"load {repeat + 1}/{self.cfg.repeats}: every rank {max(gather(own['load_s'])):.3f} s"
            line += f" (peak RSS {format_bytes(max(gather(own['peak_rss_bytes'])))})"
            if self.world.world > 1:
                seed = measure_broadcast_load(path, self.methods, self.world.rank, repeat)
                self.writer.write(seed)
                line += f"; rank 0 + broadcast {max(gather(seed['load_s'])):.3f} s"
                line += f" (peak RSS {format_bytes(max(gather(seed['peak_rss_bytes'])))})"
            self.say(line)

    def resume_record(self, variant: str, losses: list[float], fp: dict[str, Any], **extra: Any) -> None:
        first = self.cfg.steps_before + 1
        self.writer.write(
            {
                "kind": "resume",
                "variant": variant,
                "first_step": first,
                "losses": losses,
                "fingerprint": fp,
                **extra,
            }
        )

    def run_variants(
        self, path: Path, saved_present: dict[str, str], applicable: set[str], reference: list[float]
    ) -> None:
        """Every variant restarts from the checkpoint and trains the steps the reference trained."""
        steps = self.cfg.steps_after
        for variant in self.variants:
            target = path
            if variant.drop:
                target = self.directory / variant.file_name()
                error = None
                if self.lead:
                    try:
                        self.methods.write(without(self.methods.load(str(path)), variant.drop), target)
                    except Exception as exc:
                        error = f"{type(exc).__name__}: {exc}"
                agree(error, f"writing the {variant.name} checkpoint")
            job_loader = not variant.drop and self.methods.save is None and self.methods.load is torch_load
            result = restart(
                self.make_trainer, variant, target, self.methods.load, steps, job_loader=job_loader
            )
            present = result.present if result.present is not None else saved_present
            missing, not_needed = absent(present, applicable=applicable)
            self.resume_record(
                variant.name,
                result.losses,
                result.fingerprint,
                drop=list(variant.drop),
                present=sorted(present),
                missing=missing,
                not_applicable=not_needed,
                restored=result.restored,
                restore_s=result.restore_s,
            )
            same = result.losses == reference
            self.say(
                f"resume {variant.name}: {steps} steps, rank 0 losses "
                + ("identical to the reference" if same else "DIFFER from the reference")
                + (f"; lacks {', '.join(missing)}" if missing else "")
            )

    def execute(self) -> RunDir | None:
        """Measure; the run directory on rank 0 once every rank's records are on disk, None elsewhere."""
        from ciuic_doctor.jobs.options import median_step_s

        trainer = self.make_trainer()
        self.start(trainer)
        applicable = self.applicable(trainer)
        train_steps(trainer, self.cfg.steps_before)
        self.say(f"reference: {self.cfg.steps_before} steps, loss {float(trainer.last_loss):.4f}")
        path = self.measure_cost(trainer)
        info = self.inspect_saved(path, trainer)
        if info["loadable"]:
            self.measure_loads(path)
        reference = train_steps(trainer, self.cfg.steps_after)
        self.resume_record(
            RESUME_REFERENCE,
            reference,
            fingerprint(trainer),
            median_step_s=median_step_s(trainer.step_times_s),
        )
        trainer.close()
        del trainer
        gc.collect()
        if info["loadable"]:
            self.run_variants(path, info["present"], applicable, reference)
        elif self.lead:
            self.writer.write({"kind": "skipped", "what": ["load", "resume"], "reason": info["reason"]})
            self.say(f"loads and resume not measured: {info['reason']}")
        agree(None, "finishing")  # every rank's records are on disk before rank 0 judges them
        if not self.lead:
            return None
        self.run.record_probe(PROBE, status="ok", argv=self.cfg.argv, nproc=self.world.world)
        return self.run


def run_check(cfg: CheckConfig) -> RunDir | None:
    """This rank's part of checkpoint-check (under torchrun, launch_local, or alone): the run on rank 0."""
    check = Check(cfg)
    try:
        return check.execute()
    except ProbeFailed as exc:
        if check.lead:
            check.run.record_probe(PROBE, status="failed", message=str(exc), argv=cfg.argv)
        raise
    finally:
        check.writer.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def run_inspect(path: Path, out: str | None) -> RunDir:
    """`--inspect CKPT`: one process, no training; the file is never unpickled beyond weights_only."""
    from ciuic_doctor.errors import UserError

    safety = check_safety(path)
    if safety.container == "not-torch":
        raise UserError(f"--inspect {path}: not a PyTorch checkpoint ({safety.error})")
    run = RunDir.create(default_run_path(PROBE, out))
    record = inspect_record(safety, role="file")
    with run.writer(STREAM) as writer:
        writer.write(record)
    run.record_probe(PROBE, status="ok", inspect=str(path))
    found = record.get("present") or {}
    print(f"inspect {path}: {format_bytes(record['size_bytes'])}, {record['container']}")
    for kind in sorted(found):
        print(f"  {kind:<11} {found[kind]}")
    return run
