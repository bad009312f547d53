"""More formats for logsynth's runs: what torchtitan, llm.c, modded-nanogpt and DeepSpeed's pipeline engine
print for a `logsynth.Run`, line shapes as their sources write them (cited in each writer), plus shaped
curves for the stability classes of issue 24 (each made from the numbers of a public log's shape).
"""

from __future__ import annotations

import math

import numpy as np
from logsynth import Run, _stamp

ESC = "\x1b"
COLOR = {  # torchtitan/tools/utils.py Color
    "red": f"{ESC}[31m",
    "green": f"{ESC}[32m",
    "yellow": f"{ESC}[33m",
    "blue": f"{ESC}[34m",
    "magenta": f"{ESC}[35m",
    "cyan": f"{ESC}[36m",
    "reset": f"{ESC}[39m",
    "orange": f"{ESC}[38;2;180;60;0m",
    "turquoise": f"{ESC}[38;2;54;234;195m",
}


def torchtitan_log(
    run: Run, *, every: int = 1, ranks: int = 1, color: bool = True, val_every: int = 0
) -> str:
    """torchtitan's MetricsProcessor.log / log_validation lines (components/metrics.py), coloured."""
    c = COLOR if color else dict.fromkeys(COLOR, "")
    out = ["[titan] 2025-07-21 15:57:30,100 - root - INFO - Starting job: DeepSeek-V3 16B model training"]
    for i in range(0, run.n, every):
        step = int(run.step[i])
        loss = "     nan" if run.nonfinite[i] else f"{run.loss[i]:8.5f}"
        grad = run.grad_norm[i] if math.isfinite(run.grad_norm[i]) else float("nan")
        for rank in range(ranks):
            prefix = f"[rank{rank}]:" if ranks > 1 else ""
            out.append(
                f"{prefix}[titan] {_stamp(step)},774 - root - INFO - {c['red']}step: {step:2}  "
                f"{c['green']}loss: {loss}  {c['orange']}grad_norm: {grad:7.4f}  "
                f"{c['turquoise']}memory: 61.27GiB(77.34%)  {c['blue']}tps: 3,071  "
                f"{c['cyan']}tflops: 142.25  {c['magenta']}mfu: 14.38%{c['reset']}"
            )
        if val_every and step % val_every == 0:
            out.append(
                f"[titan] {_stamp(step)},900 - root - INFO - {c['yellow']}validate step: {step:2}  "
                f"{c['green']}loss: {run.loss[i] * 1.03:7.4f}  {c['turquoise']}memory: 61.27GiB(77.34%)  "
                f"{c['blue']}tps: 9,100{c['reset']}"
            )
    return "\n".join(out) + "\n"


def llmc_main_log(run: Run, *, val_every: int = 250, stdout: bool = False) -> str:
    """llm.c: llmc/logger.h's main.log (`s:N trl:X lr:Y norm:Z`, `s:N tel:X`), or train_gpt2.cu's stdout."""
    out = []
    for i in range(run.n):
        step = int(run.step[i]) - 1  # main.log counts from 0
        if val_every and step % val_every == 0:
            out.append(
                f"s:{step} tel:{run.loss[i] * 1.01:.4f}" if not stdout else f"val loss {run.loss[i]:f}"
            )
        if stdout:
            out.append(
                f"step {step + 1:4d}/{run.n} | loss {run.loss[i]:7.6f} (+0.12z)| "
                f"norm {run.grad_norm[i]:6.4f} (-0.31z)| lr {run.lr[i]:.2e} | 133.42 ms | 41.2% bf16 MFU | "
                "392912 tok/s"
            )
        else:
            out.append(f"s:{step} trl:{run.loss[i]:.4f} lr:{run.lr[i]:.6f} norm:{run.grad_norm[i]:.2f}")
    return "\n".join(out) + "\n"


def modded_log(run: Run, *, val_every: int = 125, train_loss: bool = True) -> str:
    """A modded-nanogpt records/ file: the script's source, then `step:N/M train_loss:X train_time:...`."""
    out = ["import os", "import sys", "with open(sys.argv[0]) as f:", "    code = f.read()", "=" * 100]
    total = run.n
    for i in range(run.n):
        step = int(run.step[i])
        if val_every and (step - 1) % val_every == 0:
            out.append(
                f"step:{step - 1}/{total} val_loss:{run.loss[i] * 1.02:.4f} train_time:{step * 216}ms "
                "step_avg:216.33ms"
            )
        if train_loss:
            out.append(
                f"step:{step}/{total} train_loss:{run.loss[i]:.4f} train_time:{step * 216}ms "
                "step_avg:216.33ms"
            )
        else:
            out.append(f"step:{step}/{total} train_time:{step * 216}ms step_avg:216.33ms")
    return "\n".join(out) + "\n"


def deepspeed_pipe_log(run: Run, *, every: int = 10) -> str:
    """DeepSpeed's PipelineEngine (`steps: N loss: X iter time (s): ... samples/sec: ...`) between its
    config dump and the engine's `step=N, skipped=0` progress lines (runtime/pipe/engine.py)."""
    head = "[2023-04-14 01:02:03,456] [INFO] [config.py:1000:print] "
    out = [
        f"{head}  train_batch_size ............. 256",
        f"{head}  gradient_accumulation_steps .. 8",
        f"{head}  gradient_clipping ............ 1.0",
        f"{head}  bfloat16_enabled ............. True",
    ]
    for i in range(every - 1, run.n, every):
        step = int(run.step[i])
        out.append(f"steps: {step} loss: {run.loss[i]:0.4f} iter time (s): 0.651 samples/sec: 393.262")
        out.append(
            f"[2023-04-14 01:02:03,456] [INFO] [logging.py:96:log_dist] [Rank 0] step={step}, "
            f"skipped=0, lr=[{run.lr[i]:.6g}], mom=[(0.9, 0.95)]"
        )
    return "\n".join(out) + "\n"


def megatron_args_block() -> str:
    """The arguments block Megatron-LM prints before training (arguments.py _print_args)."""
    return (
        "\n".join(
            [
                "------------------------ arguments ------------------------",
                "  global_batch_size ............................... 512",
                "  micro_batch_size ................................ 4",
                "  lr .............................................. 0.0003",
                "  lr_warmup_iters ................................. 2000",
                "  clip_grad ....................................... 1.0",
                "  padded_vocab_size ............................... 50304",
                "  bf16 ............................................ True",
                "-------------------- end of arguments ---------------------",
            ]
        )
        + "\n"
    )


def curve_run(loss: np.ndarray, *, grad_norm: np.ndarray | None = None, lr: np.ndarray | None = None) -> Run:
    """A Run from a shaped loss curve (steps 1..N), for the writers above and logsynth's."""
    n = len(loss)
    nonfinite = ~np.isfinite(loss)
    return Run(
        step=np.arange(1, n + 1),
        loss=np.where(nonfinite, np.nan, loss),
        nonfinite=nonfinite,
        lr=lr if lr is not None else np.full(n, 3e-4),
        grad_norm=grad_norm if grad_norm is not None else np.full(n, 0.5),
        scale=np.full(n, np.nan),
        skipped=np.zeros(n, dtype=bool),
    )
