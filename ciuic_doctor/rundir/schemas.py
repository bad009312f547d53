"""The record schema of every stream: field -> the JSON types it may hold, and one `validate` function.

Readers (`store.read_jsonl`, and any columnar reader of the same files) call `validate(stream, record)`
and skip a record it refuses, counting it like a torn line, so a bad field cannot crash an analysis:
a fuzz of single fields across every stream found 42 crash sites in analyze and report.

A schema names the fields the analyses read; a field not named is free (probes add fields), a field
named may be absent unless it is in `REQUIRED`. Types are JSON's: "int" (not bool), "number" (int or
float, or the "nan" / "inf" / "-inf" strings `store.dumps` writes for non-finite floats), "str", "bool",
"list", "dict", "null", and "numbers" / "ints" (a list of them).

>>> validate("steps", {"step": 3, "loss": 2.5, "rank": 0})
>>> validate("steps", {"step": "3", "loss": 2.5})
'step: expected int, got str'
>>> validate("steps", {"loss": 2.5})
'step: missing'
"""

from __future__ import annotations

import math
from typing import Any

# checkpoint stream: the `variant` of the resume record every other variant is compared with
RESUME_REFERENCE = "reference"

NON_FINITE = frozenset({"nan", "inf", "-inf", "NaN", "Infinity", "-Infinity"})

INT = frozenset({"int"})
OPT_INT = frozenset({"int", "null"})
NUM = frozenset({"number"})
OPT_NUM = frozenset({"number", "null"})
STR = frozenset({"str"})
OPT_STR = frozenset({"str", "null"})
BOOL = frozenset({"bool"})
OPT_BOOL = frozenset({"bool", "null"})
LIST = frozenset({"list"})
OPT_LIST = frozenset({"list", "null"})
DICT = frozenset({"dict"})
NUMBERS = frozenset({"numbers"})  # a list whose every element is a number
OPT_NUMBERS = frozenset({"numbers", "null"})
OPT_INTS = frozenset({"ints", "null"})  # a list of whole numbers
OPT_DICT = frozenset({"dict", "null"})

# Every record: `store.JsonlWriter` adds schema, t, host and (when known) rank. An imported log's rows
# (`stability LOG --out RUN`) have host null: the log does not say where it ran.
COMMON: dict[str, frozenset[str]] = {"schema": INT, "t": NUM, "host": OPT_STR, "rank": OPT_INT}

SCHEMAS: dict[str, dict[str, frozenset[str]]] = {
    "steps": {
        **COMMON,
        "step": INT,
        "step_time_s": OPT_NUM,
        "pre_backward_s": OPT_NUM,
        "loss": OPT_NUM,
        "lr": OPT_NUM,
        "grad_norm": OPT_NUM,
        "grad_norm_source": OPT_STR,
        "clip_max_norm": OPT_NUM,
        "loss_scale": OPT_NUM,
        "skipped": frozenset(
            {"bool", "int", "null"}
        ),  # watch: a bool; an imported row: skips in its interval
        "backward_calls": OPT_INT,
        "mem_allocated": OPT_NUM,
        "mem_reserved": OPT_NUM,
        "mem_active_peak": OPT_NUM,
        "alloc_retries": OPT_INT,  # a counter: never NaN
        "rss": OPT_NUM,
        "uss": OPT_NUM,
        "weights_checksum": OPT_NUM,
        "desync_ranks": OPT_INTS,
        "tokens": OPT_NUM,
        "samples": OPT_NUM,
        "optimizer": OPT_INT,  # watch: several optimizers (index in creation order)
        "optimizer_class": OPT_STR,
        "loss_scale_next": OPT_NUM,  # what GradScaler.update() set after the step
        "segment": OPT_INT,  # which watch session of the run
        "interval_steps": OPT_INT,  # an imported row: the steps it covers
        "series": OPT_INT,  # an imported row: its engine or run
        "nonfinite": OPT_INT,
        "attempted_scale": OPT_NUM,
    },
    "comm": {
        **COMMON,
        "collective": STR,
        "algo": STR,
        "backend": OPT_STR,
        "dtype": OPT_STR,
        "world_size": OPT_INT,
        "nccl_version": OPT_STR,
        "nccl_algo_env": OPT_STR,
        "status": OPT_STR,
        "inplace": OPT_BOOL,
        "algo_used": OPT_STR,
        "proto_used": OPT_STR,
        "bytes": OPT_INT,
        "count": OPT_INT,
        "iters": OPT_INT,
        "time_us": OPT_NUM,
        "time_us_min": OPT_NUM,
        "time_us_max": OPT_NUM,
        "time_us_p50": OPT_NUM,
        "time_us_p99": OPT_NUM,
        "algbw_gbps": OPT_NUM,
        "busbw_gbps": OPT_NUM,
        "busbw_factor": OPT_NUM,
        "wrong": OPT_INT,
        "slowest_rank": OPT_INT,
        "slowest_host": OPT_STR,
        "rank_time_us": OPT_NUMBERS,
        "splits": OPT_STR,  # comm-bench --splits-from: "routed" (the job's routing) or "even"
        "layer": OPT_INT,
        "max_send_bytes": OPT_INT,
        "max_recv_bytes": OPT_INT,
        "round_p50_us": OPT_NUMBERS,  # --splits-from: per timed round, the slowest rank's median iteration
        "hidden": OPT_INT,
        "hidden_source": OPT_STR,  # where the routed token's width came from (recorded, or assumed)
    },
    "memwatch": {
        **COMMON,
        "pid": INT,
        "role": STR,
        "sample": OPT_INT,
        "rss": OPT_NUM,
        "anon": OPT_NUM,
        "vms": OPT_NUM,
        "uss": OPT_NUM,
        "pss": OPT_NUM,
        "swap": OPT_NUM,
        "cpu_percent": OPT_NUM,
        "threads": OPT_INT,
        "uss_every": OPT_INT,
        "gpu_bytes": OPT_NUM,
        "gpu_devices": OPT_LIST,
        "gpu_total_bytes": OPT_NUM,
        "sys_available_bytes": OPT_NUM,
        "sys_total_bytes": OPT_NUM,
        "shm_used_bytes": OPT_NUM,
        "shm_free_bytes": OPT_NUM,
    },
    "memwatch_events": {
        **COMMON,
        "kind": OPT_STR,
        "pid": OPT_INT,
        "ppid": OPT_INT,
        "target_pid": OPT_INT,
        "interval_s": OPT_NUM,
        "duration_s": OPT_NUM,
        "role": OPT_STR,
        "name": OPT_STR,
        "cmdline": OPT_STR,
        "reason": OPT_STR,
        "note": OPT_STR,
        "samples": OPT_INT,
    },
    "loader": {
        **COMMON,
        "kind": OPT_STR,
        "config": OPT_STR,
        "status": OPT_STR,
        "num_workers": OPT_INT,
        "prefetch_factor": OPT_INT,
        "pin_memory": OPT_BOOL,
        "persistent_workers": OPT_BOOL,
        "batch_size": OPT_INT,
        "round": OPT_INT,
        "samples": OPT_NUM,
        "samples_per_s": OPT_NUM,
        "elapsed_s": OPT_NUM,
        "batch_latency_p50_ms": OPT_NUM,
        "batch_latency_p99_ms": OPT_NUM,
        "epoch_start_s": OPT_NUM,
        "group_s": OPT_NUMBERS,
        "cpu": OPT_DICT,
        "current": OPT_DICT,
        "dataset": OPT_DICT,
        "workers": OPT_LIST,
        "prefetch": OPT_LIST,
        "configs": OPT_LIST,
        "kept": OPT_LIST,
        "dropped": OPT_LIST,
        "finalists": OPT_LIST,
        "over_budget": OPT_BOOL,
        "eligible": OPT_BOOL,
        "is_current": OPT_BOOL,
        "worker_uss_growth_bytes": OPT_NUM,
        "worker_rss_growth_bytes": OPT_NUM,
        "worker_pss_growth_bytes": OPT_NUM,
        "worker_uss_bytes": OPT_NUM,
        "shm_need_bytes": OPT_INT,
        "shm_free_bytes": OPT_INT,
        "shm_total_bytes": OPT_INT,
        "batch_bytes": OPT_INT,
        "local_world_size": OPT_INT,
        "cpu_budget_per_rank": OPT_INT,
        "lightning_rule_workers": OPT_INT,
        "sweep": frozenset({"str", "int", "null"}),  # an id: a string in real sweeps, a number in samples
        "budget_s": OPT_NUM,
        "timeout_s": OPT_NUM,
        "step_ms": OPT_NUM,
        "taken_samples_per_s": OPT_NUM,
        "window_wall_s": OPT_NUM,
        "wall_s": OPT_NUM,
        "slot_s": OPT_NUM,
        "warmup_batches": OPT_INT,
        "window_batches": OPT_INT,
        "worker_pids": OPT_INT,
        "persistent_restart_s": OPT_NUM,
        "explicit_workers": OPT_BOOL,
        "torch_threads": OPT_INT,
    },
    # watch's MoE router hook, one record per router per sampled step (probes/watch/moe.py)
    "moe": {
        **COMMON,
        "step": INT,
        "layer": INT,
        "name": OPT_STR,
        "experts": OPT_INT,
        "top_k": OPT_INT,
        "tokens": OPT_INT,  # token rows the router saw in the step (all micro-batches)
        "calls": OPT_INT,
        "counts": OPT_INTS,  # tokens each expert received: a fixed-size list, one per expert
    },
    "checkpoint": {
        **COMMON,
        "kind": OPT_STR,
        "method": OPT_STR,
        "variant": OPT_STR,
        "step": OPT_INT,
        "repeat": OPT_INT,
        "nproc": OPT_INT,
        "save_s": OPT_NUM,
        "load_s": OPT_NUM,
        "read_s": OPT_NUM,
        "restore_s": OPT_NUM,
        "gather_s": OPT_NUM,
        "barrier_wait_s": OPT_NUM,
        "broadcast_wait_s": OPT_NUM,
        "size_bytes": OPT_NUM,
        "peak_rss_bytes": OPT_NUM,
        "rss_delta_bytes": OPT_NUM,
        "held_bytes": OPT_NUM,
        "median_step_s": OPT_NUM,
        "first_step": OPT_INT,
        "losses": OPT_NUMBERS,
        "fingerprint": OPT_DICT,
        "variants": OPT_LIST,
        "missing": OPT_LIST,
        "drop": OPT_LIST,
        "restored": OPT_LIST,
        "not_applicable": OPT_LIST,
        "unsafe_globals": OPT_LIST,
        "safe": OPT_BOOL,
        "weights_only_loaded": OPT_BOOL,
        "path": OPT_STR,
        "error": OPT_STR,
    },
}

# Fields without which a record means nothing to its analysis (a step without its number).
REQUIRED: dict[str, tuple[str, ...]] = {
    "steps": ("step",),
    "comm": ("collective",),
    "memwatch": ("pid", "role"),
    "moe": ("step", "layer", "counts"),
}


# The hang files (not streams: one JSON object a file), checked by hang_shapes before a field is read;
# validate("hang.dump", record) as for a stream.
HANG_SHAPES: dict[str, dict[str, frozenset[str]]] = {
    "hang.armed": {
        "rank": OPT_INT,
        "world_size": OPT_INT,
        "host": OPT_STR,
        "pid": OPT_INT,
        "start_ticks": OPT_INT,
    },
    "hang.dump": {
        "rank": OPT_INT,
        "host": OPT_STR,
        "reason": OPT_STR,
        "error": OPT_STR,
        "t": OPT_NUM,
        "resumed_t": OPT_NUM,
        "pg_status": OPT_DICT,
        "fr_file": OPT_STR,
        "threads": OPT_LIST,
        "peers": OPT_LIST,
    },
    "hang.last": {"op": OPT_STR, "file": OPT_STR, "line": OPT_INT, "function": OPT_STR},
    "hang.pyspy": {
        "pid": OPT_INT,
        "state": OPT_STR,
        "watched": OPT_BOOL,
        "threads": OPT_LIST,
        "error": OPT_STR,
        "fr_file": OPT_STR,
        "pg_status": OPT_DICT,
        "moving": OPT_BOOL,
    },
    "hang.peer": {"rank": frozenset({"int"}), "pid": OPT_INT, "state": OPT_STR, "threads": OPT_LIST},
    "hang.thread": {"main": BOOL},
}
SCHEMAS.update(HANG_SHAPES)

# Fields required only in some records: (field, value it has) -> fields those records need.
# Each field named is required in those records, with the types given.
CONDITIONAL: dict[str, list[tuple[str, Any, dict[str, frozenset[str]]]]] = {
    # a measured row (status "ok", the default) has its figures; a "not_run" row has a reason instead
    "comm": [("status", "ok", {"bytes": INT, "busbw_gbps": NUM, "time_us": NUM})],
    # a loader measurement names its configuration and counts what it measured
    "loader": [
        ("kind", "measure", {"config": STR, "num_workers": INT, "status": STR}),
        ("status", "ok", {"round": INT, "samples": INT}),
    ],
}


_JSON_TYPES = ((bool, "bool"), (int, "int"), (float, "number"), (str, "str"), (list, "list"), (dict, "dict"))


def json_type(value: Any) -> str:
    """The schema token of a parsed JSON value ("number" covers the non-finite strings)."""
    if value is None:
        return "null"
    # bool before int: True is an int to Python, never a count to a schema
    return next((name for kind, name in _JSON_TYPES if isinstance(value, kind)), type(value).__name__)


def _fits(value: Any, allowed: frozenset[str]) -> bool:
    kind = json_type(value)
    if kind in allowed:
        return True
    if kind == "list" and "numbers" in allowed:
        return all(_fits(v, NUM) for v in value)
    if kind == "list" and "ints" in allowed:
        return all(json_type(v) == "int" for v in value)
    if "number" in allowed:
        return kind == "int" or (kind == "str" and value in NON_FINITE)
    return False


def validate(stream: str, record: Any) -> str | None:
    """Why `record` does not fit `stream`'s schema (one short reason), or None when it fits.

    A stream without a schema (one a later version adds) takes any JSON object.
    """
    if not isinstance(record, dict):
        return f"not a JSON object ({json_type(record)})"
    schema = SCHEMAS.get(stream)
    if schema is None:
        return None
    for name in REQUIRED.get(stream, ()):
        if name not in record:
            return f"{name}: missing"
    for key, value, needed in CONDITIONAL.get(stream, ()):
        if record.get(key, "ok" if key == "status" and stream == "comm" else None) != value:
            continue
        for name, allowed in needed.items():
            if name not in record:
                return f"{name}: missing (in a record with {key} {value!r})"
            if not _fits(record[name], allowed):
                return f"{name}: expected {' or '.join(sorted(allowed))}, got {json_type(record[name])}"
    nonnegative = NONNEGATIVE.get(stream, ())
    for name, value in record.items():
        allowed = schema.get(name)
        if allowed is not None and not _fits(value, allowed):
            want = " or ".join(sorted(allowed))
            return f"{name}: expected {want}, got {json_type(value)}"
        if allowed is not None and not _bounded(value):
            return f"{name}: beyond ±{NUMBER_BOUND:g}"
        if allowed is not None and "number" not in allowed and not _whole_bounded(value):
            return f"{name}: beyond ±2**53"
        if allowed is not None and must_be_finite(stream, name) and _non_finite(value):
            return f"{name}: not finite"
        if name in nonnegative and isinstance(value, int | float) and value < 0:
            return f"{name}: negative"
    return None


# A finite number beyond ±1e150 in a record is off schema: no measurement ciuic-doctor reads comes near
# it (float32 / bf16 end at 3.4e38, a day is 8.6e10 us), and means, ratios and differences of 1e308
# overflow (compare and report raised on them). Non-finite values stay: they are findings.
NUMBER_BOUND = 1e150
# Measurements that cannot be negative (a busbw of -1e308 made compare take the log of a negative ratio).
NONNEGATIVE: dict[str, frozenset[str]] = {
    "comm": frozenset({"bytes", "time_us", "busbw_gbps", "algbw_gbps"}),
    "steps": frozenset({"step_time_s", "pre_backward_s", "loss_scale", "tokens", "samples"}),
}


# A whole-number field (step, rank, schema, counts) beyond ±2**53 is off schema: a float64 no longer holds
# it exactly, and a 64-bit column not at all past 2**63 (a `step` of 2**70 was dropped without a word).
MAX_WHOLE = 2**53
# Times, durations, sizes and rates are finite: an inf there is no measurement (a loss, a grad norm or a
# loss scale of inf is one, and stays: it is a finding).
_FINITE_SUFFIXES = ("_s", "_us", "_bytes", "_gbps")


def must_be_finite(stream: str, name: str) -> bool:
    """Whether a non-finite value of `name` is off schema (t, durations, sizes, rates, nonnegatives)."""
    return name == "t" or name.endswith(_FINITE_SUFFIXES) or name in NONNEGATIVE.get(stream, ())


def _non_finite(value: Any) -> bool:
    return (isinstance(value, float) and not math.isfinite(value)) or (
        isinstance(value, str) and value in NON_FINITE
    )


def _whole_bounded(value: Any) -> bool:
    if isinstance(value, int) and not isinstance(value, bool):
        return abs(value) <= MAX_WHOLE
    if isinstance(value, list):
        return all(_whole_bounded(v) for v in value[:10_000])
    return True


def _bounded(value: Any) -> bool:
    if isinstance(value, float):
        return not math.isfinite(value) or abs(value) <= NUMBER_BOUND
    if isinstance(value, int) and not isinstance(value, bool):
        return abs(value) <= NUMBER_BOUND
    if isinstance(value, list):
        return all(_bounded(v) for v in value[:10_000])
    return True


def stream_of(file_name: str) -> str:
    """The stream a file belongs to: `steps.rank3.jsonl` -> "steps", `comm.jsonl` -> "comm"."""
    base = file_name[: -len(".jsonl")] if file_name.endswith(".jsonl") else file_name
    head, _, tail = base.rpartition(".rank")
    return head if head and tail.isdigit() else base


# meta.json's top level: what each key must be when present (the readers use .get() on the dicts).
META: dict[str, frozenset[str]] = {
    "schema": INT,
    "run": STR,
    "created": NUM,
    "tool": DICT,
    "env": DICT,
    "spec": DICT,
    "probes": DICT,
    "checkup": DICT,
    "job": DICT,
    "source": frozenset({"str", "dict", "null"}),
    "observed": OPT_DICT,
    "model": OPT_DICT,  # the watched model's class, config fields, seq_len (probes/watch/moe.py)
    "mfu": OPT_DICT,  # the peak a user gave (analyze --peak-tflops)
}
# One level down, where the readers go: probes.<name> and env.cpu / env.world / env.env are dicts,
# env.devices a list of dicts.
_META_NESTED_DICTS = {"probes": None, "env": ("cpu", "world", "env", "nccl_conf", "packages")}


def clean_meta(meta: Any) -> tuple[dict[str, Any], list[str]]:
    """meta.json with every value of the wrong type dropped, and one reason per dropped key.

    >>> clean_meta({"run": "r", "probes": [1], "env": {"cpu": 3}})
    ({'run': 'r', 'env': {}}, ['probes: expected dict, got list', 'env.cpu: expected dict, got int'])
    """
    if not isinstance(meta, dict):
        return {}, [f"meta.json: not a JSON object ({json_type(meta)})"]
    out: dict[str, Any] = {}
    bad: list[str] = []
    for key, value in meta.items():
        allowed = META.get(key)
        if allowed is not None and not _fits(value, allowed):
            bad.append(f"{key}: expected {' or '.join(sorted(allowed))}, got {json_type(value)}")
            continue
        out[key] = value
    probes = out.get("probes")
    if isinstance(probes, dict):
        for name, entry in list(probes.items()):
            if not isinstance(entry, dict):
                bad.append(f"probes.{name}: expected dict, got {json_type(entry)}")
                probes = {k: v for k, v in probes.items() if k != name}
        out["probes"] = probes
    env = out.get("env")
    if isinstance(env, dict):
        kept = dict(env)
        for name in _META_NESTED_DICTS["env"] or ():
            if name in kept and not isinstance(kept[name], dict):
                bad.append(f"env.{name}: expected dict, got {json_type(kept[name])}")
                del kept[name]
        devices = kept.get("devices")
        if devices is not None and not (
            isinstance(devices, list) and all(isinstance(d, dict) for d in devices)
        ):
            bad.append("env.devices: expected a list of objects")
            del kept["devices"]
        for name in ("torch", "cuda", "nccl", "host"):
            if name in kept and not isinstance(kept[name], str | None):
                bad.append(f"env.{name}: expected str, got {json_type(kept[name])}")
                del kept[name]
        out["env"] = kept
    return out, bad
