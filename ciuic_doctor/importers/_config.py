"""The loss scaler's configuration and the precision, where a log prints them at start-up.

Read from the head of a log (the first SNIFF_BYTES), in this order of trust:

    DeepSpeed's config dump   `dynamic_loss_scale_args ...... {'init_scale': 65536, 'scale_window': 100,
                              'delayed_shift': 2, 'min_scale': 1}` (what the engine really built)
    DeepSpeed's JSON config   `"fp16": {"loss_scale_window": 100, "hysteresis": 2, "min_loss_scale": 1,
                              "initial_scale_power": 16}` (what the user asked; missing keys take
                              DeepSpeed's defaults 1000 / 2 / 1 / 16)
    Megatron's arguments      `  loss_scale_window ........ 1000`, `hysteresis`, `min_loss_scale`,
                              `initial_loss_scale`, `fp16`/`bf16 ...... True`

`scaler_config(text)` returns {"window_steps", "hysteresis", "min_scale", "initial_scale", "source"} with
only the keys the log gave (source "log"), or {} when it prints none. A log that prints two dumps (two
engines, e.g. DeepSpeed-Chat's actor and critic, or a reference model without an optimizer) gives the
first dynamic one: DeepSpeed-Chat builds every engine from one config.

>>> dump = "{'init_scale': 65536, 'scale_window': 100, 'delayed_shift': 2, 'min_scale': 1}"
>>> scaler_config("dynamic_loss_scale_args ...... " + dump)
{'initial_scale': 65536.0, 'window_steps': 100, 'hysteresis': 2, 'min_scale': 1.0, 'source': 'log'}
>>> scaler_config("  loss_scale_window ........ 1000\\n  hysteresis ..... 2\\n")
{'window_steps': 1000, 'hysteresis': 2, 'source': 'log'}
"""

from __future__ import annotations

import ast
import math
import re
from pathlib import Path
from typing import Any

_DS_DUMP = re.compile(r"dynamic_loss_scale_args \.+ (\{[^}\n]*\})")
_DS_KEYS = {"init_scale": "initial_scale", "scale_window": "window_steps", "delayed_shift": "hysteresis",
            "min_scale": "min_scale"}  # fmt: skip
_DS_JSON = re.compile(r'"fp16"\s*:\s*\{(?P<body>[^{}]*)\}')
_JSON_KEYS = {"loss_scale_window": "window_steps", "hysteresis": "hysteresis", "min_loss_scale": "min_scale",
              "initial_scale_power": "initial_scale_power"}  # fmt: skip
# Megatron prints its arguments as `  name ....... value`, one a line.
_MEGATRON_ARG = re.compile(
    r"^[ \t]*(loss_scale_window|hysteresis|min_loss_scale|initial_loss_scale|fp16|bf16)[ \t]+\.+[ \t]+(\S+)",
    re.M,
)
_MEGATRON_KEYS = {"loss_scale_window": "window_steps", "hysteresis": "hysteresis",
                  "min_loss_scale": "min_scale", "initial_loss_scale": "initial_scale"}  # fmt: skip
_INTEGER_KEYS = ("window_steps", "hysteresis")


def head_text(path: Path, limit: int) -> str:
    """The first `limit` bytes of `path` as text ("" when it cannot be read)."""
    try:
        with open(path, "rb") as fh:
            return fh.read(limit).decode("utf-8", errors="replace")
    except OSError:
        return ""


def scaler_config(text: str) -> dict[str, Any]:
    for match in _DS_DUMP.finditer(text):
        try:
            args = ast.literal_eval(match.group(1))
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            continue
        if isinstance(args, dict):
            found = {_DS_KEYS[k]: v for k, v in args.items() if k in _DS_KEYS}
            if found:
                return _typed(found)
    for match in _DS_JSON.finditer(text):
        body = match.group("body")
        if re.search(r'"enabled"\s*:\s*false', body, re.I):
            continue
        found: dict[str, Any] = {
            "window_steps": 1000,
            "hysteresis": 2,
            "min_scale": 1,
            "initial_scale": 2.0**16,
        }
        for key, value in re.findall(r'"(\w+)"\s*:\s*([-+0-9.eE]+)', body):
            if key in _JSON_KEYS:
                found[_JSON_KEYS[key]] = value
        if "initial_scale_power" in found:
            found["initial_scale"] = 2.0 ** _number(found.pop("initial_scale_power"), 16)
        return _typed(found)
    found = {_MEGATRON_KEYS[k]: v for k, v in _MEGATRON_ARG.findall(text) if k in _MEGATRON_KEYS}
    return _typed(found) if found else {}


def precision(text: str) -> str | None:
    """ "fp16" / "bf16" where Megatron's arguments or a DeepSpeed config say so, else None."""
    flags = dict(_MEGATRON_ARG.findall(text))
    if flags.get("bf16") == "True":
        return "bf16"
    if flags.get("fp16") == "True" or re.search(r"fp16_enabled \.+ True", text):
        return "fp16"
    if re.search(r"bfloat16_enabled \.+ True|bf16_enabled \.+ True", text):
        return "bf16"
    return None


def learning_rate_names(text: str) -> dict[str, float]:
    """`--actor_learning_rate 9.65e-6 --critic_learning_rate 5e-6` on a command line -> {"actor": 9.65e-06,
    "critic": 5e-06}: the names a log gives to several engines, told apart by their learning rates."""
    out: dict[str, float] = {}
    for name, value in re.findall(r"--([A-Za-z][A-Za-z0-9]*)_(?:learning_rate|lr)[ =]([-+0-9.eE]+)", text):
        number = _number(value, None)
        if number is not None and number > 0:
            out.setdefault(name, number)
    return out


def _number(value: Any, default: Any) -> Any:
    try:
        return float(value)
    except (TypeError, ValueError):
        return default


def _typed(found: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in found.items():
        number = _number(value, None)
        if number is None or math.isnan(number) or number < 0:
            continue
        out[key] = int(number) if key in _INTEGER_KEYS else float(number)
    if out:
        out["source"] = "log"
    return out


# Megatron's arguments block (`  global_batch_size ....... 512`) and DeepSpeed's config dump
# (`train_batch_size ............. 64`, or the JSON config's `"train_batch_size": 64`): what the job ran
# with, for the report to show. Never turned into a job spec: a log's arguments are not ciuic-doctor's.
_SETTING_NAMES = {
    "global_batch_size": "global_batch_size", "train_batch_size": "global_batch_size",
    "micro_batch_size": "micro_batch_size", "train_micro_batch_size_per_gpu": "micro_batch_size",
    "gradient_accumulation_steps": "gradient_accumulation_steps", "lr": "lr", "min_lr": "min_lr",
    "lr_warmup_iters": "warmup_steps", "lr_warmup_fraction": "warmup_fraction",
    "lr_decay_style": "lr_decay_style", "train_iters": "train_steps", "clip_grad": "clip_max_norm",
    "gradient_clipping": "clip_max_norm", "seq_length": "seq_length", "world_size": "world_size",
    "data_parallel_size": "data_parallel_size", "tensor_model_parallel_size": "tensor_parallel_size",
    "pipeline_model_parallel_size": "pipeline_parallel_size", "weight_decay": "weight_decay",
}  # fmt: skip
_ARG_LINE = re.compile(r"^[ \t]*(?:\[[^\]\n]*\][ \t]*)*([a-z_]+)[ \t]+\.{3,}[ \t]+([^\s]+)[ \t]*$", re.M)
_JSON_SETTING = re.compile(r'"(train_batch_size|train_micro_batch_size_per_gpu|gradient_accumulation_steps'
                           r'|gradient_clipping)"\s*:\s*([-+0-9.eE]+)')  # fmt: skip


_DS_PARAMS = re.compile(r"(optimizer_params|scheduler_params)[ \t]+\.+[ \t]+(\{[^}\n]*\})")
_DS_PARAM_KEYS = {"lr": "lr", "warmup_num_steps": "warmup_steps", "warmup_max_lr": "lr",
                  "total_num_steps": "train_steps", "weight_decay": "weight_decay"}  # fmt: skip


def megatron_settings(text: str) -> dict[str, Any]:
    """The job settings a Megatron arguments block or a DeepSpeed config dump prints, by our names
    (global_batch_size, micro_batch_size, lr, warmup_steps, clip_max_norm, ...), the first value each;
    DeepSpeed's `optimizer_params` / `scheduler_params` dicts give the LR and the warm-up.

    >>> megatron_settings("  global_batch_size ............... 512\\n  lr .............. 0.0003\\n")
    {'global_batch_size': 512, 'lr': 0.0003}
    >>> megatron_settings("scheduler_params ..... {'warmup_max_lr': 5e-05, 'warmup_num_steps': 100}")
    {'lr': 5e-05, 'warmup_steps': 100}
    """
    found: dict[str, Any] = {}
    for match in _DS_PARAMS.finditer(text):
        try:
            params = ast.literal_eval(match.group(2))
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            continue
        for key, value in params.items() if isinstance(params, dict) else ():
            name = _DS_PARAM_KEYS.get(key)
            number = _number(value, None)
            if name and name not in found and number is not None and math.isfinite(number):
                found[name] = int(number) if float(number).is_integer() and name != "lr" else number
    pairs = [*_ARG_LINE.findall(text), *_JSON_SETTING.findall(text)]
    for name, raw in pairs:
        key = _SETTING_NAMES.get(name)
        if key is None or key in found or raw in ("None", "null"):
            continue
        number = _number(raw, None)
        if number is None:
            found[key] = raw[:40]
        elif math.isfinite(number):
            found[key] = int(number) if float(number).is_integer() and "." not in raw else number
    return found
