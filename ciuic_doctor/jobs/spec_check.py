"""Validate a whole job spec once, up front, and list every bad key with what it must be.

Before this, a string batch size, `base_lr = nan`, zero heads or three betas passed the loader and crashed
inside every rank with a traceback. `problems(data)` checks the merged TOML data (default +
file + `--set`) and returns one line per bad key; `spec.py` raises them as one UserError naming the
source to blame (the file, or the `--set` that set the key).

>>> problems({"batch": {"per_process": 0}, "optim": {"base_lr": float("nan")}})
['[batch] per_process = 0: must be a whole number >= 1', '[optim] base_lr = nan: must be a finite number > 0']
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable
from typing import Any

Rule = tuple[str, Callable[[Any], bool]]

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# A sane ceiling for counts: more ranks, steps or workers than this is a typo, and each of them costs a
# process, a step or memory before anything could fail on its own.
_MAX_COUNT = 10**9


def _int(minimum: int, maximum: int = _MAX_COUNT) -> Rule:
    text = f"a whole number >= {minimum}" + (f" and <= {maximum}" if maximum != _MAX_COUNT else "")
    return text, lambda v: isinstance(v, int) and not isinstance(v, bool) and minimum <= v <= maximum


def _number(*, low: float, high: float = math.inf, low_open: bool = False, high_open: bool = False) -> Rule:
    parts = [f"{'>' if low_open else '>='} {low:g}"]
    if high != math.inf:
        parts.append(f"{'<' if high_open else '<='} {high:g}")
    text = "a finite number " + " and ".join(parts)

    def ok(v: Any) -> bool:
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
            return False
        above = v > low if low_open else v >= low
        below = v < high if high_open else v <= high
        return above and below

    return text, ok


def _bool() -> Rule:
    return "true or false", lambda v: isinstance(v, bool)


def _name() -> Rule:
    # A name reaches file headers and comments: no control characters (a newline became a shell line).
    return (
        "a non-empty string without control characters, at most 200 long",
        lambda v: isinstance(v, str) and 0 < len(v) <= 200 and v.isprintable(),
    )


def _one_of(*allowed: str) -> Rule:
    return f"one of {', '.join(allowed)}", lambda v: v in allowed


def _betas() -> Rule:
    def ok(v: Any) -> bool:
        beta = _number(low=0.0, high=1.0, high_open=True)[1]
        return isinstance(v, list) and len(v) == 2 and all(beta(b) for b in v)

    return "a list of two numbers in [0, 1), e.g. [0.9, 0.95]", ok


def _optional(rule: Rule) -> Rule:
    return f"{rule[0]} (or absent)", lambda v: v is None or rule[1](v)


RULES: dict[str, dict[str, Rule]] = {
    "job": {
        "name": _name(),
        "nodes": _int(1),
        "procs_per_node": _int(1, 1024),
        "steps": _int(1),
        "seed": _int(0, 2**32 - 1),  # numpy and torch seeds are 32-bit
    },
    "batch": {"per_process": _int(1), "grad_accum": _int(1), "reference": _int(1), "seq_len": _int(2)},
    "optim": {
        "name": _one_of("adamw", "adam", "sgd"),
        "base_lr": _number(low=0.0, low_open=True),
        "lr_scaling": _one_of("sqrt", "linear", "none"),
        "weight_decay": _number(low=0.0),
        "betas": _betas(),
        "clip_max_norm": _number(low=0.0),
        "warmup_pct": _number(low=0.0, high=1.0, high_open=True),  # OneCycleLR's pct_start
    },
    "precision": {
        "mode": _one_of("fp32", "bf16", "fp16"),
        "init_scale": _number(low=0.0, low_open=True),
        "growth_interval": _int(1),
    },
    "dataloader": {
        "num_workers": _int(0, 256),
        "prefetch_factor": _optional(_int(1)),
        "pin_memory": _bool(),
        "persistent_workers": _bool(),
        "multiprocessing_context": _one_of("forkserver", "spawn", "fork"),
    },
    "distributed": {
        "backend": _one_of("auto", "nccl", "gloo"),
        "timeout_s": _number(low=0.0, high=1e9, low_open=True),
        "bucket_cap_mb": _number(low=0.0, low_open=True),
    },
    "checkpoint": {"every_steps": _int(0), "keep": _int(1)},
}

# DeepseekV3Config keys the embedded job needs positive (zero heads divided by zero inside a rank).
_MODEL_POSITIVE = (
    "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "n_routed_experts", "num_experts_per_tok", "n_group",
    "topk_group", "q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim",
    "max_position_embeddings",
)  # fmt: skip
_MODEL_NON_NEGATIVE = ("n_shared_experts", "first_k_dense_replace")


def _show(value: Any) -> str:
    text = repr(value) if isinstance(value, str) else str(value).lower() if isinstance(value, bool) else None
    if text is None:
        text = str(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _model_problems(model: dict[str, Any]) -> list[str]:
    out = []
    for key in (*_MODEL_POSITIVE, *_MODEL_NON_NEGATIVE):
        if key in model:
            what, ok = _int(1 if key in _MODEL_POSITIVE else 0)
            if not ok(model[key]):
                out.append(f"[model] {key} = {_show(model[key])}: must be {what}")
    if out:
        return out

    ints = {k: v for k, v in model.items() if isinstance(v, int) and v > 0}
    if ints.get("num_experts_per_tok", 0) > ints.get("n_routed_experts", math.inf):
        out.append("[model] num_experts_per_tok: must be <= n_routed_experts")
    if "n_group" in ints and ints.get("n_routed_experts", 0) % ints["n_group"]:
        out.append("[model] n_routed_experts: must be a multiple of n_group")
    if ints.get("topk_group", 0) > ints.get("n_group", math.inf):
        out.append("[model] topk_group: must be <= n_group")
    if "num_key_value_heads" in ints and ints.get("num_attention_heads", 0) % ints["num_key_value_heads"]:
        out.append("[model] num_attention_heads: must be a multiple of num_key_value_heads")
    if (need := _largest_matrix_bytes(ints)) > (have := _host_memory_bytes()):
        out.append(
            f"[model] hidden_size = {ints.get('hidden_size')}: its largest weight alone needs "
            f"{need / 2**30:,.0f} GiB, more than this host's {have / 2**30:,.0f} GiB of memory"
        )
    return out


def _largest_matrix_bytes(model: dict[str, int]) -> int:
    """fp32 bytes of the model's largest single weight (the embedding or an MLP), a lower bound of what
    one rank allocates: `job` with hidden_size = 1e9 died in every rank asking for 4 TB."""
    hidden = model.get("hidden_size", 128)
    widest = max(model.get(k, 0) for k in ("vocab_size", "intermediate_size", "moe_intermediate_size"))
    return 4 * hidden * max(widest, hidden)


def _host_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 2**62


def problems(data: dict[str, Any]) -> list[str]:
    """One line per bad key of the merged spec data (unknown keys are spec.py's to report)."""
    out: list[str] = []
    for section, rules in RULES.items():
        table = data.get(section)
        if not isinstance(table, dict):
            continue
        for key, (what, ok) in rules.items():
            if key in table and not ok(table[key]):
                out.append(f"[{section}] {key} = {_show(table[key])}: must be {what}")
    env = (data.get("distributed") or {}).get("env") if isinstance(data.get("distributed"), dict) else None
    if env is not None and not isinstance(env, dict):
        out.append('[distributed.env]: must be a table of NAME = "value"')
    for name, value in (env or {}).items() if isinstance(env, dict) else ():
        if not _ENV_NAME.match(name):
            out.append(f"[distributed.env] {_show(name)}: not a valid environment variable name")
        elif not isinstance(value, str) or "\0" in value:
            out.append(f"[distributed.env] {name} = {_show(value)}: must be a string (quote it)")
    model = data.get("model")
    if isinstance(model, dict):
        out += _model_problems(model)
    return out
