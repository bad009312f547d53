"""all_to_all as an MoE dispatch does it: `comm-bench --splits-from RUN` sends the split sizes the job's
recorded routing produced (RUN/moe.rank<R>.jsonl, from watch's router hook), beside equal splits of the
same volume, so the report says what the router's imbalance costs in all_to_all time.

The plan (pure, no torch): for each recorded MoE layer, each rank's tokens per expert (the mean over its
sampled steps); experts are placed on the benchmark's ranks as expert parallelism places them, in
contiguous blocks (expert e on rank e·W // E: Megatron's and torchtitan's layout); rank s sends to rank d
the tokens it routed to d's experts, each token `hidden_size` elements (meta.json `model`), top-k copies
of a token counted once per expert that receives it. When the run had as many ranks as the benchmark,
rank s uses rank s's counts; otherwise each benchmark rank sends 1/W of the layer's total. The even plan
sends the same total volume in W² equal blocks.

The timing is comm-bench's: a barrier, `iters` back-to-back `all_to_all_single` calls with split sizes,
one device sync, divided by iters; routed and even alternate layer by layer. Each call's result is
checked (every block received from rank s holds s).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ciuic_doctor.errors import UserError
from ciuic_doctor.rundir.store import RunDir

MAX_LAYERS = 8  # the most uneven layers measured (a 61-layer model would take minutes)
DEFAULT_HIDDEN = 7168  # DeepSeek-V3's hidden size, when the run recorded no model config
# What a recorded run may ask for, checked before any rank allocates: the records are data from a run
# directory, and 10^6 experts asked for 28 GB, hidden_size 10^12 for 240 TB. Published MoE models stay
# far inside (DeepSeek-V3: 256 routed experts, hidden 7,168).
MAX_EXPERTS = 1 << 16
MAX_HIDDEN = 1 << 20


@dataclass(kw_only=True)
class SplitPlan:
    layer: int
    name: str
    routed: list[list[int]]  # [source rank][destination rank] elements
    even: list[list[int]]
    hidden: int
    experts: int
    imbalance: float  # busiest destination's received volume / mean
    hidden_source: str = "recorded"  # where `hidden` came from: recorded | the router's weight | assumed

    def to_dict(self) -> dict[str, Any]:
        keys = ("layer", "name", "routed", "even", "hidden", "experts", "imbalance", "hidden_source")
        return {k: getattr(self, k) for k in keys}


def owner(expert: int, experts: int, world: int) -> int:
    """The rank holding `expert` when `experts` are split over `world` ranks in contiguous blocks.

    >>> [owner(e, 8, 2) for e in range(8)]
    [0, 0, 0, 0, 1, 1, 1, 1]
    """
    return expert * world // experts


def plan_from_run(path: str | Path, world: int, *, max_layers: int = MAX_LAYERS) -> list[SplitPlan]:
    """The split plans of RUN's recorded routing for a `world`-rank all_to_all; UserError if it has none."""
    try:
        run = RunDir.open(path)
    except UserError as exc:
        raise UserError(f"--splits-from {path}: {exc}") from None
    records = run.read("moe").records
    if not records:
        raise UserError(
            f"--splits-from {path}: no MoE routing recorded there (moe.rank<R>.jsonl); record it with "
            "ciuic-doctor watch or job on an MoE model"
        )
    model = run.read_meta().get("model")
    config = model.get("config") if isinstance(model, dict) else None
    recorded = config.get("hidden_size") if isinstance(config, dict) else None
    hidden_size, source = token_size(model)
    if recorded is not None:  # a recorded width that is no width is refused, never replaced by a guess
        hidden_size = recorded
    if (
        isinstance(hidden_size, bool)
        or not isinstance(hidden_size, int)
        or not 1 <= hidden_size <= MAX_HIDDEN
    ):
        raise UserError(
            f"--splits-from {path}: meta.json's model hidden_size must be a whole number from 1 to "
            f"{MAX_HIDDEN:,}, not {_short(hidden_size)}"
        )
    try:
        found = plans(records, world, hidden_size=hidden_size, max_layers=max_layers)
    except ValueError as exc:
        raise UserError(f"--splits-from {path}: {exc}") from None
    for plan in found:
        plan.hidden_source = source
    return found


def token_size(model: Any) -> tuple[int, str]:
    """(elements a routed token carries, where that number comes from): the model config's hidden_size,
    else the router weight's input width watch recorded (meta.json model.moe.hidden_size), else
    DeepSeek-V3's 7,168, said as an assumption (a tiny model's bytes would read 100× too large).

    >>> token_size({"config": {"hidden_size": 4096}}), token_size({"moe": {"hidden_size": 32}})[0]
    ((4096, 'recorded'), 32)
    >>> token_size(None)[1]
    "assumed DeepSeek-V3's hidden size 7168: the run recorded no model config nor router width"
    """
    model = model if isinstance(model, dict) else {}
    config = model.get("config") if isinstance(model.get("config"), dict) else {}
    if isinstance(config.get("hidden_size"), int) and config["hidden_size"] > 0:
        return config["hidden_size"], "recorded"
    moe = model.get("moe") if isinstance(model.get("moe"), dict) else {}
    width = moe.get("hidden_size")
    if isinstance(width, int) and not isinstance(width, bool) and width > 0:
        return width, "the router weight's input width, as watch recorded it (no model config)"
    why = "the run recorded no model config nor router width"
    return DEFAULT_HIDDEN, f"assumed DeepSeek-V3's hidden size {DEFAULT_HIDDEN}: {why}"


def bytes_per_rank(layers: list[SplitPlan], elem_bytes: int) -> int:
    """The most memory one rank's all_to_all buffers take over `layers` (both modes): its send buffer,
    its receive buffer and the float32 copy the check makes of what it received."""
    need = 0
    for plan in layers:
        for matrix in (plan.routed, plan.even):
            world = len(matrix)
            for rank in range(world):
                send = sum(matrix[rank])
                recv = sum(matrix[s][rank] for s in range(world))
                need = max(need, send * elem_bytes + recv * (elem_bytes + 4))
    return need


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:40] + "..."


def plans(
    records: list[dict[str, Any]], world: int, *, hidden_size: int, max_layers: int = MAX_LAYERS
) -> list[SplitPlan]:
    """Plans from moe records (see the module docstring), the most uneven layers first.

    >>> recs = [{"layer": 1, "rank": 0, "step": 1, "counts": [6, 2, 0, 0]},
    ...         {"layer": 1, "rank": 1, "step": 1, "counts": [4, 0, 2, 2]}]
    >>> p = plans(recs, 2, hidden_size=1)[0]
    >>> p.routed, p.even
    ([[8, 0], [4, 4]], [[4, 4], [4, 4]])
    Raises ValueError on counts no router produces (negative, not finite) or more than MAX_EXPERTS.
    """
    sums: dict[int, dict[int, list[float]]] = {}
    samples: dict[tuple[int, int], int] = {}
    names: dict[int, str] = {}
    for r in records:
        layer, rank, counts = r.get("layer"), r.get("rank"), r.get("counts")
        if (
            not isinstance(layer, int)
            or not isinstance(rank, int)
            or not isinstance(counts, list)
            or not counts
        ):
            continue
        if len(counts) > MAX_EXPERTS:
            raise ValueError(
                f"layer {layer} records {len(counts):,} experts; at most {MAX_EXPERTS:,} are measured"
            )
        acc = sums.setdefault(layer, {}).setdefault(rank, [0.0] * len(counts))
        if len(acc) != len(counts):
            continue
        for i, c in enumerate(counts):
            try:
                value = float(c) if isinstance(c, int | float) and not isinstance(c, bool) else 0.0
            except OverflowError:  # an int past 1.8e308
                value = math.inf
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(
                    f"layer {layer} rank {rank} records {_short(c)} tokens for expert {i} "
                    "(a count is 0 or more)"
                )
            acc[i] += value
        samples[layer, rank] = samples.get((layer, rank), 0) + 1
        names.setdefault(layer, str(r.get("name") or f"layer {layer}"))
    out = []
    for layer, by_rank in sums.items():
        experts = len(next(iter(by_rank.values())))
        if experts < world:
            continue  # fewer experts than ranks: no expert-parallel layout to mimic
        mean = {rank: [c / samples[layer, rank] for c in counts] for rank, counts in by_rank.items()}
        if sorted(mean) == list(range(world)):
            sources = [mean[s] for s in range(world)]
        else:
            total = [sum(c[e] for c in mean.values()) for e in range(experts)]
            sources = [[t / world for t in total]] * world
        routed = [[0] * world for _ in range(world)]
        for s, counts in enumerate(sources):
            for e, tokens in enumerate(counts):
                routed[s][owner(e, experts, world)] += round(tokens) * hidden_size
        volume = sum(map(sum, routed))
        block = max(1, volume // (world * world))
        even = [[block] * world for _ in range(world)]
        received = [sum(routed[s][d] for s in range(world)) for d in range(world)]
        mean_recv = sum(received) / world
        imbalance = max(received) / mean_recv if mean_recv > 0 else math.nan
        out.append(
            SplitPlan(layer=layer, name=names[layer], routed=routed, even=even, hidden=hidden_size,
                      experts=experts, imbalance=round(imbalance, 3))
        )  # fmt: skip
    out.sort(key=lambda p: -p.imbalance if math.isfinite(p.imbalance) else 0)
    return out[:max_layers]
