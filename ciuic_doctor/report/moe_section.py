"""The report's "Throughput, MFU and MoE expert load" section: what analysis/throughput.py and analysis/moe.py
judged, drawn from their findings' evidence (so a plot never disagrees with the verdict above it):

- FLOPs per token and MFU side by side in each convention (ciuic, torchtitan, Megatron);
- the layer × expert heat-map of load ÷ the layer's mean load (1.0 everywhere is balanced);
- the busiest expert's load ÷ mean per layer over the sampled steps.

Present when either analysis produced a finding. Also the comm section's table of `comm-bench
--splits-from` (all_to_all with the job's routing beside equal splits), `splits_table`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from ciuic_doctor.report.blocks import Section, Table
from ciuic_doctor.rundir.findings import Finding, sort_findings

MAX_LINES = 8  # layers drawn one line each; beyond, the worst MAX_LINES


def model_sections(findings: Sequence[Finding]) -> list[Section]:
    ours = [f for f in findings if f.probe in ("throughput", "moe")]
    if not ours:
        return []
    section = Section(
        id="model",
        title="Throughput, MFU and MoE expert load",
        command="watch",
        probes=("throughput", "moe"),
        streams=(),
        intro="Tokens/s from the token ids each step's model saw; MFU = FLOPs/token × tokens/s ÷ the "
        "device's dense peak, in each counting convention (docs/mfu.md); expert load per layer from the MoE "
        "routers (sampled every --moe-every steps), summed over ranks.",
        ran=True,
        findings=sort_findings(ours),
    )
    mfu = next((f for f in ours if f.check == "mfu" and f.evidence.get("flops")), None)
    if mfu is not None:
        section.tables.append(_conventions(mfu.evidence))
    imbalance = next((f for f in ours if f.check == "expert_imbalance"), None)
    if imbalance is not None:
        for svg in (_heatmap(imbalance.evidence), _over_steps(imbalance.evidence)):
            if svg:
                section.plots.append(svg)
    return [section]


def _conventions(evidence: dict[str, Any]) -> Table:
    flops = evidence["flops"]
    per_token = flops.get("flops_per_token") or {}
    notes = flops.get("conventions") or {}
    achieved = evidence.get("achieved_tflops") or {}
    mfu = evidence.get("mfu") or {}
    rows = []
    for name, value in per_token.items():
        v = value if isinstance(value, int | float) else None
        m = mfu.get(name)
        rows.append(
            [
                (name, name),
                (f"{v / 1e9:.4g}" if v is not None else "—", v or 0),
                (
                    f"{achieved[name]:.3g}" if isinstance(achieved.get(name), int | float) else "—",
                    achieved.get(name) or 0,
                ),
                (f"{100 * m:.1f}" if isinstance(m, int | float) else "not run", m or 0),
                (str(notes.get(name, "")), str(notes.get(name, ""))),
            ]
        )
    peak = evidence.get("peak_tflops")
    where = f"{peak:g} TFLOP/s ({evidence.get('peak_source')})" if peak else "no peak (not run)"
    return Table(
        title=f"FLOPs per token at seq {flops.get('seq_len')} and MFU against {where}",
        headers=["convention", "GFLOP/token", "TFLOP/s per rank", "MFU %", "what is counted"],
        rows=rows,
        numeric=[1, 2, 3],
    )


def _heatmap(evidence: dict[str, Any]) -> str | None:
    from ciuic_doctor.report.plots import _pyplot, _text, to_svg

    heat = evidence.get("heatmap") or {}
    layers, share = heat.get("layers") or [], heat.get("load_over_mean") or []
    rows = [row for row in share if isinstance(row, list) and row]
    if not rows or len({len(r) for r in rows}) != 1:
        return None
    plt = _pyplot()
    experts = len(rows[0])
    fig, ax = plt.subplots(figsize=(9, max(1.6, 0.28 * len(rows) + 1.2)))
    image = ax.imshow(rows, aspect="auto", cmap="magma", vmin=0, vmax=max(2.0, *(max(r) for r in rows)),
                      interpolation="nearest")  # fmt: skip
    ax.set_yticks(range(len(rows)), [_text(layer) for layer in layers][: len(rows)])
    ax.set_xlabel(f"expert (0–{experts - 1})")
    ax.set_ylabel("layer")
    ax.grid(False)
    fig.colorbar(image, ax=ax, label="load ÷ layer mean")
    ax.set_title("Expert load per layer (1.0 = balanced)")
    fig.tight_layout()
    return to_svg(fig, "MoE expert load heat-map")


def _over_steps(evidence: dict[str, Any]) -> str | None:
    from ciuic_doctor.report.plots import _pyplot, _text, to_svg

    series = evidence.get("over_steps") or {}
    steps, layers = series.get("steps") or [], series.get("layers") or {}
    if not steps or not layers:
        return None

    def worst(item: tuple[str, list[Any]]) -> float:
        values = [v for v in item[1] if isinstance(v, int | float) and math.isfinite(v)]
        return -max(values, default=0.0)

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 3.2))
    for layer, values in sorted(layers.items(), key=worst)[:MAX_LINES]:
        points = [(s, v) for s, v in zip(steps, values, strict=False) if isinstance(v, int | float)]
        if points:
            ax.plot(*zip(*points, strict=True), marker=".", label=f"layer {_text(layer)}")
    threshold = evidence.get("threshold_max_over_mean")
    if isinstance(threshold, int | float):
        ax.axhline(threshold, linestyle=":", color="#999999", label=f"warn at {threshold:g}")
    ax.set_xlabel("step")
    ax.set_ylabel("busiest expert ÷ mean")
    ax.legend(loc="upper left", fontsize=8, ncol=3)
    ax.set_title("Load imbalance over steps")
    fig.tight_layout()
    return to_svg(fig, "MoE load imbalance over steps")


def splits_table(records: Sequence[dict[str, Any]]) -> Table | None:
    """comm-bench --splits-from: per layer, equal splits beside the recorded routing's splits."""
    pairs: dict[Any, dict[str, dict[str, Any]]] = {}
    for r in records:
        if r.get("splits") in ("even", "routed") and r.get("status", "ok") == "ok":
            pairs.setdefault(r.get("layer"), {})[r["splits"]] = r
    rows = []
    for layer, pair in sorted(pairs.items(), key=lambda kv: str(kv[0])):
        even, routed = pair.get("even") or {}, pair.get("routed") or {}
        e, r = _num(even.get("time_us_p50")), _num(routed.get("time_us_p50"))
        ratio = r / e if e and r else None
        rows.append(
            [
                (str(layer), layer if isinstance(layer, int) else -1),
                (str(routed.get("router") or even.get("router") or ""), str(routed.get("router") or "")),
                _bytes(routed.get("bytes")),
                _bytes(even.get("max_recv_bytes")),
                _bytes(routed.get("max_recv_bytes")),
                _us(e),
                _us(r),
                (f"{ratio:.2f}" if ratio else "—", ratio or 0),
            ]
        )
    if not rows:
        return None
    return Table(
        title="all_to_all with the job's routing (comm-bench --splits-from): equal splits vs the recorded "
        "ones, same volume; medians of the iterations",
        headers=[
            "layer",
            "router",
            "bytes/rank",
            "even: busiest rank recv",
            "routed: busiest rank recv",
            "even µs",
            "routed µs",
            "routed / even",
        ],
        rows=rows,
        numeric=[0, 2, 3, 4, 5, 6, 7],
    )


def _num(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _us(value: float | None) -> tuple[str, Any]:
    return (f"{value:.1f}", value) if value is not None else ("—", 0)


def _bytes(value: Any) -> tuple[str, Any]:
    from ciuic_doctor.units import format_bytes

    number = _num(value)
    return (format_bytes(number), number) if number is not None else ("—", 0)
