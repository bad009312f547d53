"""Realistic training runs with planted events, written out in every log format the importers read.

`make_run` builds a per-step truth: a decaying loss with Gaussian noise proportional to its level (a batch
mean of token losses: noise that scales with the loss), LR warm-up then cosine decay, a grad norm that
falls fast then drifts, and an fp16 loss scaler simulated with the real semantics of torch.amp.GradScaler
(backoff 0.5 per skip, ×2 after 2000 clean steps, from 2**16), Megatron's DynamicGradScaler (2**32,
hysteresis 2, window 1000, floor 1) or DeepSpeed's DynamicLossScaler (2**16, hysteresis 2, window 1000,
floor 1, fatal "already at minimum"). Planted events (spikes, overflow storms, scale collapse, NaN losses,
divergence) are recorded in `Run.truth` with the step they start at. The writers then print what each
framework would have printed for that run.
"""

from __future__ import annotations

import csv
import io
import json
import math
from dataclasses import dataclass, field
from datetime import datetime, timezone

import numpy as np

T0 = 1_717_000_000.0  # 2024-05-29, the clock the runs start at


@dataclass(kw_only=True)
class Run:
    step: np.ndarray  # 1..N
    loss: np.ndarray  # NaN where the loss itself was not finite
    nonfinite: np.ndarray  # bool
    lr: np.ndarray
    grad_norm: np.ndarray  # pre-clip total norm; NaN on steps whose gradients overflowed
    scale: np.ndarray  # loss scale after the step's update (NaN without a scaler)
    skipped: np.ndarray  # bool
    scaler_log: dict[int, tuple] = field(default_factory=dict)  # step -> ("reduce", a, b) | ("hyst", a, h)
    fatal_step: int | None = None  # DeepSpeed exited: "already at minimum"
    truth: dict[str, list[int]] = field(default_factory=dict)

    @property
    def n(self) -> int:
        return len(self.step)


def make_run(
    n: int = 3000,
    *,
    seed: int = 0,
    start: float = 10.5,
    floor: float = 2.2,
    decay: float = 400.0,
    noise: float = 0.02,
    warmup: int = 200,
    peak_lr: float = 3e-4,
    spikes: tuple[tuple[int, float, int], ...] = (),  # (step, magnitude, steps to recover)
    grad_spikes: tuple[tuple[int, float], ...] = (),  # (step, magnitude)
    grad_led: int = 0,  # > 0: every loss spike is preceded by a grad-norm spike this many steps earlier
    scaler: str | None = None,  # None | "gradscaler" | "megatron" | "deepspeed"
    safe_scale: float = 2.0**13,  # the largest scale whose gradients stay finite
    storms: tuple[tuple[int, int, int], ...] = (),  # (step, overflows, every k steps)
    collapse: int | None = None,  # from this step every gradient is non-finite
    nan_steps: tuple[int, ...] = (),
    diverge: int | None = None,  # loss grows ×2 every 150 steps from here
    scaler_window: int | None = None,  # the scaler's growth window (default: the framework's)
    scaler_hysteresis: int | None = None,  # DeepSpeed/Megatron hysteresis (default 2)
) -> Run:
    rng = np.random.default_rng(seed)
    step = np.arange(1, n + 1)
    t = step.astype(float)
    trend = floor + (start - floor) * (0.75 * np.exp(-t / decay) + 0.25 / np.sqrt(1 + t / (5 * decay)))
    wiggle = np.convolve(rng.normal(0, noise * 0.6, n + 200), np.ones(200) / np.sqrt(200), "same")[100:-100]
    loss = trend * np.exp(wiggle[:n] * 0.3) * np.clip(1 + rng.normal(0, noise, n), 0.05, None)
    lr = np.where(step <= warmup, peak_lr * step / warmup, 0.0)
    after = np.clip((step - warmup) / max(1, n - warmup), 0, 1)
    lr = np.where(step <= warmup, lr, peak_lr * (0.1 + 0.45 * (1 + np.cos(np.pi * after))))
    grad = (0.35 + 4.0 * np.exp(-t / 60) + 0.1 * t / n) * np.exp(rng.normal(0, 0.12, n))
    truth: dict[str, list[int]] = {}
    for s, mag, rec in spikes:
        k = np.arange(n)
        shape = np.where(k >= s - 1, np.exp(-np.clip(k - (s - 1), 0, None) * 3.0 / max(rec, 1)), 0.0)
        loss = loss * (1 + (mag - 1) * shape)
        truth.setdefault("loss_spike", []).append(s)
        if grad_led:
            grad_spikes = (*grad_spikes, (s - grad_led, 6.0))
    for s, mag in grad_spikes:
        grad[s - 1] *= mag
        grad[s] *= 1 + (mag - 1) / 3
        truth.setdefault("grad_norm_spike", []).append(s)
    if diverge is not None:
        rise = np.exp(np.clip(step - diverge, 0, None) * math.log(2) / 150)
        loss = loss * rise
        truth["divergence"] = [diverge]
    nonfinite = np.zeros(n, dtype=bool)
    for s in nan_steps:
        nonfinite[s - 1] = True
    if nan_steps:
        truth["nonfinite_loss"] = list(nan_steps)
    overflow = nonfinite.copy()  # a NaN loss gives NaN gradients
    for s, count, every in storms:
        overflow[[s - 1 + i * every for i in range(count)]] = True
        truth.setdefault("overflow_storm", []).append(s)
    if collapse is not None:
        overflow[collapse - 1 :] = True
    run = Run(
        step=step,
        loss=np.where(nonfinite, np.nan, loss),
        nonfinite=nonfinite,
        lr=lr,
        grad_norm=grad,
        scale=np.full(n, np.nan),
        skipped=np.zeros(n, dtype=bool),
        truth=truth,
    )
    if scaler:
        _simulate_scaler(
            run, scaler, safe_scale, overflow, window=scaler_window, hysteresis=scaler_hysteresis
        )
        if collapse is not None:
            crossing = _collapse_step(run, scaler, collapse)
            truth["scale_collapse"] = [crossing]
    run.grad_norm = np.where(run.skipped, np.nan, run.grad_norm)
    return run


def _simulate_scaler(
    run: Run, kind: str, safe_scale: float, forced: np.ndarray, *, window=None, hysteresis=None
) -> None:
    """Each framework's dynamic loss scaler, step by step (see the module docstring for the constants)."""
    if kind == "gradscaler":
        scale, interval, default_hysteresis, floor = 2.0**16, 2000, 1, 0.0
    elif kind == "megatron":
        scale, interval, default_hysteresis, floor = 2.0**32, 1000, 2, 1.0
    else:
        scale, interval, default_hysteresis, floor = 2.0**16, 1000, 2, 1.0
    interval = window or interval
    hysteresis = hysteresis or default_hysteresis
    growth = 0
    hyst = hysteresis
    for i in range(run.n):
        overflow = bool(forced[i]) or scale > safe_scale
        if overflow:
            run.skipped[i] = True
            growth = 0
            if kind == "deepspeed" and hyst > 1:
                run.scaler_log[i + 1] = ("hyst", scale, hyst)
                hyst -= 1
            elif kind == "deepspeed" and scale <= floor:
                run.fatal_step = i + 1
                _truncate(run, i + 1)
                return
            elif kind == "megatron":
                hyst -= 1
                if hyst <= 0:
                    scale = max(scale * 0.5, floor)
            else:
                new = max(scale * 0.5, floor)
                run.scaler_log[i + 1] = ("reduce", scale, new)
                scale = new
        else:
            growth += 1
            if growth == interval:
                growth = 0
                hyst = hysteresis
                scale *= 2.0
        run.scale[i] = scale


def _collapse_step(run: Run, kind: str, collapse: int) -> int:
    """The first step at which the scale is at the framework's floor (or below 1 for GradScaler)."""
    below = run.scale < 1.0 if kind == "gradscaler" else run.scale <= 1.0
    hits = np.flatnonzero(below & (run.step >= collapse))
    if len(hits):
        return int(run.step[hits[0]])
    return int(run.fatal_step or run.step[-1])


def _truncate(run: Run, last_step: int) -> None:
    for name in ("step", "loss", "nonfinite", "lr", "grad_norm", "scale", "skipped"):
        setattr(run, name, getattr(run, name)[:last_step])


# ---- writers --------------------------------------------------------------------------------------


def _stamp(step: int, fmt: str = "%Y-%m-%d %H:%M:%S") -> str:
    return datetime.fromtimestamp(T0 + 1.25 * step, tz=timezone.utc).strftime(fmt)


def megatron_log(
    run: Run,
    *,
    interval: int = 1,
    variant: str = "new",  # new: lr %.6E (after 2024-03), old: lr %.3E
    timestamps: bool = True,
    prefix: str = "",
    extras: bool = True,
) -> str:
    """What Megatron-LM's training_log prints: one line per `interval` iterations, plus noise around it."""
    out = [
        "using world size: 8, data-parallel size: 8, tensor-model-parallel size: 1",
        "------------------------ arguments ------------------------",
        "  accumulate_allreduce_grads_in_fp32 .............. False",
        f"  log_interval .................................... {interval}",
        "-------------------- end of arguments ---------------------",
        "> building GPT2BPETokenizer tokenizer ...",
        "[before the start of training step] datetime: 2024-05-29 16:26:40",
    ]
    total = run.n
    for end in range(interval, run.n + 1, interval):
        sl = slice(end - interval, end)
        applied = ~run.skipped[sl]
        finite = applied & ~run.nonfinite[sl]
        nan_iters = int((applied & run.nonfinite[sl]).sum())
        line = f" [{_stamp(end)}]" if timestamps else ""
        line += f" iteration {end:8d}/{total:8d} | consumed samples: {end * 512:12d} |"
        line += f" elapsed time per iteration (ms): {1254.3 + (end % 7):.1f} |"
        if extras and variant == "new":
            line += f" throughput per GPU (TFLOP/s/GPU): {180.0 + (end % 5):.1f} |"
        lr = run.lr[end - 1]
        line += f" learning rate: {lr:.6E} |" if variant == "new" else f" learning rate: {lr:.3E} |"
        line += " global batch size:   512 |"
        if applied.any() and nan_iters == 0:
            line += f" lm loss: {float(np.mean(run.loss[sl][finite])):.6E} |"
            if extras:
                line += f" load_balancing_loss: {1.01 + (end % 3) / 100:.6E} |"
        scale = run.scale[end - 1]
        line += f" loss scale: {1.0 if math.isnan(scale) else scale:.1f} |"
        if not run.skipped[end - 1]:
            line += f" grad norm: {run.grad_norm[end - 1]:.3f} |"
            if extras:
                line += f" num zeros: {float(end % 11):.1f} | params norm: {250.0 + end / 1000:.3f} |"
        skipped = int(run.skipped[sl].sum())
        line += f" number of skipped iterations: {skipped:3d} | number of nan iterations: {nan_iters:3d} |"
        out.append(prefix + line)
        if end % 1000 == 0:
            out.append(prefix + "(min, max) time across ranks (ms):")
            out.append(prefix + "    forward-backward ...............................: (1200.11, 1201.34)")
            value = float(np.nanmean(run.loss[max(0, end - 50) : end]))
            out.append(
                prefix + "-" * 60 + f"\n{prefix} validation loss at iteration {end} | lm loss value: "
                f"{value:.6E} | lm loss PPL: {math.exp(min(value, 50)):.6E} | \n" + prefix + "-" * 60
            )
    return "\n".join(out) + "\n"


def deepspeed_log(
    run: Run,
    *,
    steps_per_print: int = 10,
    variant: str = "int",  # int (2023-03 on) | float (before) | deepscale (2021)
    timestamps: bool = True,
    start_line: bool = False,  # the engine's own `step=0, skipped=0` line before training starts
    config: dict | None = None,  # print DeepSpeed's dynamic_loss_scale_args dump with these values
) -> str:
    """DeepSpeed's own lines for this run: scaler overflows, hysteresis, progress, and the fatal line."""
    out = [
        "[2024-05-29 16:26:30,000] [INFO] [real_accelerator.py:203:get_accelerator] Setting ds_accelerator"
    ]
    if config is not None:
        out.append(
            "[2024-05-29 16:26:31,000] [INFO] [config.py:1003:print]   dynamic_loss_scale_args ...... "
            f"{{'init_scale': {config.get('init_scale', 65536)}, 'scale_window': {config['scale_window']}, "
            f"'delayed_shift': {config.get('delayed_shift', 2)}, 'consecutive_hysteresis': False, "
            f"'min_scale': {config.get('min_scale', 1)}}}"
        )
    if start_line:
        out.append(
            "[2024-05-29 16:26:32,000] [INFO] [logging.py:128:log_dist] [Rank 0] step=0, skipped=0, "
            f"lr=[{run.lr[0]:.6g}, {run.lr[0]:.6g}], mom=[(0.9, 0.95), (0.9, 0.95)]"
        )
    skipped = 0
    for i in range(run.n):
        step = int(run.step[i])
        head = f"[{_stamp(step, '%Y-%m-%d %H:%M:%S')},{step % 1000:03d}] [INFO] " if timestamps else ""
        tag = "[deepscale]" if variant == "deepscale" else "[deepspeed]"

        def num(x: float) -> str:
            return f"{int(x)}" if variant == "int" else f"{float(x)}"

        event = run.scaler_log.get(step)
        if event:
            out.append(_overflow_line(head, event, tag=tag, num=num))
        skipped += int(run.skipped[i])
        if step % steps_per_print == 0:
            out.append(
                f"{head}[logging.py:96:log_dist] [Rank 0] step={step}, skipped={skipped}, "
                f"lr=[{run.lr[i]:.6g}, {run.lr[i]:.6g}], mom=[[0.9, 0.95], [0.9, 0.95]]"
            )
            out.append(f"{head}[timer.py:260:stop] epoch=0/micro_step={step}/global_step={step}, RunningAvg")
    if run.fatal_step is not None:
        out += [
            "Traceback (most recent call last):",
            '  File "train.py", line 120, in <module>',
            "    engine.step()",
            "Exception: Current loss scale already at minimum - cannot decrease scale anymore. Exiting run.",
        ]
    return "\n".join(out) + "\n"


def hf_state(run: Run, *, logging_steps: int = 10, grad_norm: bool = True, eval_steps: int = 500) -> str:
    """trainer_state.json as transformers writes it (indent 2, sorted keys, NaN literals)."""
    history = []
    steps_per_epoch = 1000
    for end in range(logging_steps, run.n + 1, logging_steps):
        sl = slice(end - logging_steps, end)
        values = np.where(run.nonfinite[sl], np.nan, run.loss[sl])
        entry = {
            "epoch": round(end / steps_per_epoch, 4),
            "learning_rate": float(run.lr[end - 1]),
            "loss": round(float(np.mean(values)), 4),
            "step": end,
        }
        if grad_norm:
            entry["grad_norm"] = float(run.grad_norm[end - 1])
        history.append(entry)
        if end % eval_steps == 0:
            history.append(
                {"epoch": round(end / steps_per_epoch, 4), "eval_loss": float(run.loss[end - 1]) * 1.05,
                 "eval_runtime": 12.5, "eval_samples_per_second": 80.1, "eval_steps_per_second": 10.0,
                 "step": end}
            )  # fmt: skip
    history.append(
        {"epoch": round(run.n / steps_per_epoch, 4), "step": run.n, "total_flos": 1.2e17,
         "train_loss": float(np.nanmean(run.loss)), "train_runtime": 3600.0,
         "train_samples_per_second": 88.0, "train_steps_per_second": 0.8}
    )  # fmt: skip
    state = {
        "best_metric": None,
        "best_model_checkpoint": None,
        "epoch": round(run.n / steps_per_epoch, 4),
        "eval_steps": eval_steps,
        "global_step": run.n,
        "is_hyper_param_search": False,
        "is_local_process_zero": True,
        "is_world_process_zero": True,
        "log_history": history,
        "logging_steps": logging_steps,
        "max_steps": run.n,
        "num_train_epochs": 3,
        "total_flos": 1.2e17,
        "train_batch_size": 8,
        "trial_name": None,
        "trial_params": None,
    }
    return json.dumps(state, indent=2, sort_keys=True) + "\n"


def lightning_csv(run: Run, *, every: int = 10, suffix: bool = True, val_every: int = 500) -> str:
    """CSVLogger metrics.csv: alphabetical header, sparse rows, lr in rows of its own."""
    loss_key = "train_loss_step" if suffix else "train_loss"
    rows: list[dict] = []
    for end in range(every, run.n + 1, every):
        i = end - 1
        value = "nan" if run.nonfinite[i] else repr(float(run.loss[i]))
        gn = run.grad_norm[i]
        rows.append({"epoch": end // 1000, "step": i, loss_key: value,
                     "grad_2.0_norm_total": "" if math.isnan(gn) else repr(float(gn))})  # fmt: skip
        rows.append({"epoch": end // 1000, "step": i, "lr-AdamW": repr(float(run.lr[i]))})
        if end % val_every == 0:
            rows.append({"epoch": end // 1000, "step": i, "val_loss": repr(float(run.loss[i]) * 1.05)})
        if suffix and end % 1000 == 0:
            value = float(np.nanmean(run.loss[max(0, i - 999) : i + 1]))
            rows.append({"epoch": end // 1000, "step": i, "train_loss_epoch": repr(value)})
    header = sorted({key for row in rows for key in row})
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=header, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return buffer.getvalue()


def write_ours(run_dir, run: Run, *, ranks: int = 2, clip_max_norm: float | None = 1.0, precision="fp16"):
    """The watch probe's steps stream for `run` on `ranks` ranks (per-rank files) plus meta.json."""
    from ciuic_doctor.rundir.store import RunDir

    out = RunDir.create(run_dir)
    job: dict = {"precision": {"mode": precision}}
    if clip_max_norm is not None:
        job["optim"] = {"clip_max_norm": clip_max_norm}
    out.update_meta(job=job)
    rng = np.random.default_rng(7)
    for rank in range(ranks):
        with out.writer("steps", rank=rank, per_rank_file=True) as writer:
            for i in range(run.n):
                loss = float("nan") if run.nonfinite[i] else float(run.loss[i] * (1 + rng.normal(0, 0.002)))
                scale = run.scale[i]
                gn = run.grad_norm[i]
                writer.write(
                    {"rank": rank, "step": int(run.step[i]), "t": T0 + 1.25 * i, "step_time_s": 0.11,
                     "loss": float("inf") if run.nonfinite[i] and i % 2 else loss, "lr": float(run.lr[i]),
                     "grad_norm": None if math.isnan(gn) else float(gn),
                     "loss_scale": None if math.isnan(scale) else float(scale),
                     "skipped": bool(run.skipped[i]), "mem_allocated": 0, "mem_reserved": 0,
                     "mem_active_peak": 0, "alloc_retries": 0, "rss": 900_000_000 + i, "uss": 800_000_000}
                )  # fmt: skip
    return out


def _overflow_line(head: str, event: tuple, *, tag: str, num) -> str:
    """DeepSpeed's loss_scaler line for a ("reduce", attempted, new) or ("hyst", attempted, h) event."""
    start = f"{head}[loss_scaler.py:183:update_scale] {tag} OVERFLOW! Rank 0 Skipping step. "
    if event[0] == "reduce":
        return start + f"Attempted loss scale: {num(event[1])}, reducing to {num(event[2])}"
    return (
        start + f"Attempted loss scale: {num(event[1])}, but hysteresis is {event[2]}. "
        f"Reducing hysteresis to {event[2] - 1}"
    )


def deepspeed_engines_log(runs: dict[str, Run], *, steps_per_print: int = 10) -> str:
    """One process driving several DeepSpeed engines (DeepSpeed-Chat step 3: actor, critic): the command
    line names each engine's learning rate, each engine's overflows come in its own order within a step
    (actor first), interleaved and unnamed, and each prints its own `step=N, skipped=K` line."""
    lrs = " ".join(f"--{name}_learning_rate {float(np.max(r.lr)):.3g}" for name, r in runs.items())
    out = [f"cmd = deepspeed main.py --data_path Dahoas/rm-static {lrs} --deepspeed --output_dir ./output"]
    totals = dict.fromkeys(runs, 0)
    n = min(r.n for r in runs.values())
    for i in range(n):
        step = i + 1
        head = f"[{_stamp(step, '%Y-%m-%d %H:%M:%S')},{step % 1000:03d}] [INFO] "
        for run in runs.values():
            event = run.scaler_log.get(step)
            if event:
                out.append(_overflow_line(head, event, tag="[deepspeed]", num=lambda x: f"{int(x)}"))
        out.append(f"epoch: 0|step: {i}|ppo_ep: 1|act_loss: 0.21|cri_loss: 0.12|unsuper_loss: 0.0")
        for name, run in runs.items():
            totals[name] += int(run.skipped[i])
            if step % steps_per_print == 0:
                out.append(
                    f"{head}[logging.py:96:log_dist] [Rank 0] step={step}, skipped={totals[name]}, "
                    f"lr=[{run.lr[i]:.6g}, {run.lr[i]:.6g}], mom=[(0.9, 0.95), (0.9, 0.95)]"
                )
    return "\n".join(out) + "\n"


def megatron_pipeline_log(run: Run) -> str:
    """Megatron-DeepSpeed's pipeline engine: `lm-loss:` (hyphen), and `loss scale: -1.0` / `grad norm:
    0.000` where it does not compute them; its arguments block says fp16 with hysteresis 2."""
    out = ["  fp16 ............................................ True",
           "  hysteresis ...................................... 2",
           "  loss_scale_window ............................... 1000"]  # fmt: skip
    for i in range(run.n):
        step = int(run.step[i])
        out.append(
            f" iteration {step:8d}/{run.n * 20:8d} | consumed samples: {step * 1024:12d} | elapsed time per "
            f"iteration (ms): 141096.8 | learning rate: {run.lr[i]:.3E} | global batch size:  1024 | "
            f"lm-loss: {run.loss[i]:.6E} | loss scale: -1.0 | grad norm: 0.000 | num zeros: 0.0 | "
            "number of skipped iterations:   0 | number of nan iterations:   0 |"
        )
    return "\n".join(out) + "\n"


def nanogpt_log(run: Run, *, every: int = 10) -> str:
    """nanoGPT train.py stdout: `iter N: loss X, time Yms, mfu Z%`, and the eval lines."""
    out = [
        "tokens per iteration will be: 491,520",
        "found vocab_size = 50304 (inside data/openwebtext/meta.pkl)",
    ]
    for i in range(0, run.n, every):
        if i % 250 == 0:
            out.append(f"step {i}: train loss {run.loss[i]:.4f}, val loss {run.loss[i] * 1.02:.4f}")
        loss = "nan" if run.nonfinite[i] else f"{run.loss[i]:.4f}"
        out.append(f"iter {i}: loss {loss}, time {150.0 + i % 7:.2f}ms, mfu {38.0 + i % 3:.2f}%")
    return "\n".join(out) + "\n"


def wordlm_log(run: Run, *, batches: int = 2983, every: int = 200) -> str:
    """PyTorch examples word_language_model main.py stdout (`| epoch 1 | 200/2983 batches | ...`)."""
    out = ["Namespace(batch_size=20, bptt=35, clip=0.25, epochs=5, log_interval=200, lr=20, model='LSTM')"]
    for i in range(every - 1, run.n, every):
        epoch, batch = i // batches + 1, i % batches + 1
        if batch < every:
            out.append(
                f"| end of epoch {epoch - 1:3d} | time: 35.58s | valid loss  5.82 | valid ppl   336.49"
            )
        loss = "nan" if run.nonfinite[i] else f"{run.loss[i]:5.2f}"
        ppl = "nan" if run.nonfinite[i] else f"{math.exp(min(run.loss[i], 50)):8.2f}"
        out.append(
            f"| epoch {epoch:3d} | {batch:5d}/{batches:5d} batches | lr {run.lr[i] * 1e5:.2f} | "
            f"ms/batch 11.61 | loss {loss} | ppl {ppl}"
        )
    return "\n".join(out) + "\n"
