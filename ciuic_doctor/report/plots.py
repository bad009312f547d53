"""Plots for the report: matplotlib figures as inline SVG that follow the page's light or dark theme.

Why SVG with `currentColor`: the report is one offline file, so plots are inline; text, axes and ticks are
drawn in a placeholder colour that becomes `currentColor`, and the figure background is transparent, so a
plot takes the page's text colour in both colour schemes (reference: dataloader-and-report.md). Text stays
text (`svg.fonttype = none`): smaller files, selectable labels.

Every function takes plain records (as the store reads them) and returns an SVG string, or None when the
records hold nothing to draw. Long series are thinned to MAX_POINTS per line; markers (spikes, skipped
steps) are drawn from every record, so thinning never hides an event. Step time and memory across ranks
are cross-rank bands, drawn by `band_plots` from `rank_view`'s frames.
"""

from __future__ import annotations

import html
import io
import math
import re
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

from ciuic_doctor.rundir.findings import Finding
from ciuic_doctor.rundir.store import as_float
from ciuic_doctor.units import format_size_short

INK = "#010203"  # placeholder for currentColor; no real plot uses this exact colour
# Mid-tone colours that read on white and on near-black alike (Okabe-Ito, colour-blind safe).
PALETTE = ("#0072b2", "#e69f00", "#009e73", "#cc79a7", "#56b4e9", "#d55e00", "#999999", "#f0e442")
MAX_POINTS = 600  # per line: more than a ~900 px wide plot can show
_PROLOG = re.compile(r"^.*?(?=<svg)", re.DOTALL)
_SIZE_ATTRS = re.compile(r'<svg([^>]*?) width="([\d.]+)pt" height="[^"]*"')
_METADATA = re.compile(r"<metadata>.*?</metadata>", re.DOTALL)


def _text(value: Any) -> str:
    """A label from a record, safe for matplotlib: `$` would start mathtext (and fail to parse)."""
    return str(value).replace("$", r"\$")


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update(
        {
            "svg.fonttype": "none",
            "font.family": "sans-serif",
            "font.size": 10,
            "text.color": INK,
            "axes.edgecolor": INK,
            "axes.labelcolor": INK,
            "axes.titlecolor": INK,
            "xtick.color": INK,
            "ytick.color": INK,
            "axes.facecolor": "none",
            "figure.facecolor": "none",
            "savefig.facecolor": "none",
            "legend.frameon": False,
            "axes.grid": True,
            "grid.color": "#888888",
            "grid.alpha": 0.25,
            "axes.prop_cycle": matplotlib.cycler(color=PALETTE),
            "axes.spines.top": False,
            "axes.spines.right": False,
        }
    )
    return plt


def to_svg(fig: Any, name: str) -> str:
    """The figure as an inline <svg> element: no XML prolog or DOCTYPE, ink -> currentColor, fluid width."""
    import matplotlib

    plt = _pyplot()
    buf = io.StringIO()
    with matplotlib.rc_context({"svg.hashsalt": name}):  # ids unique per plot when several are inlined
        fig.savefig(buf, format="svg", transparent=True, metadata={"Date": None})
    plt.close(fig)
    svg = _METADATA.sub("", _PROLOG.sub("", buf.getvalue(), count=1), count=1)
    svg = svg.replace(INK, "currentColor").replace(INK.upper(), "currentColor")
    label = html.escape(name, quote=True)
    # Scale down on narrow screens, never up past the drawn size (fonts stay the size they were drawn at).
    svg = _SIZE_ATTRS.sub(
        lambda m: (
            f'<svg{m.group(1)} class="plot" style="max-width:{m.group(2)}pt" role="img" aria-label="{label}"'
        ),
        svg,
        count=1,
    )
    return svg.strip()


def _thin(xs: Sequence[float], ys: Sequence[float]) -> tuple[list[float], list[float]]:
    step = max(1, len(xs) // MAX_POINTS)
    return list(xs[::step]), list(ys[::step])


def rank_of(record: dict[str, Any]) -> int | None:
    """The record's rank when it is a whole number (records from other tools may carry anything)."""
    rank = record.get("rank", 0)
    if rank is None:
        return 0
    return rank if isinstance(rank, int) and not isinstance(rank, bool) else None


def _num(record: dict[str, Any], key: str) -> float | None:
    value = as_float(record.get(key))
    return value if value is not None and math.isfinite(value) else None


# ---- comm-bench ----------------------------------------------------------------------------------


def busbw_plot(records: Iterable[dict[str, Any]]) -> str | None:
    """busbw vs message size, one panel per collective, one line per algorithm and placement (out-of-place
    solid, in-place dashed: gloo runs some collectives in one placement only)."""
    series: dict[str, dict[tuple[str, bool], dict[int, float]]] = defaultdict(lambda: defaultdict(dict))
    for r in records:
        busbw, size = _num(r, "busbw_gbps"), r.get("bytes")
        if busbw is None or not isinstance(size, int) or r.get("status", "ok") != "ok":
            continue
        algo = _text(r.get("algo") or r.get("algo_used") or "default")
        series[_text(r.get("collective", "?"))][(algo, bool(r.get("inplace")))][size] = busbw
    if not series:
        return None
    plt = _pyplot()
    names = sorted(series)
    cols = min(3, len(names))
    rows = -(-len(names) // cols)
    fig, axes = plt.subplots(
        rows, cols, figsize=(3.6 * cols, 2.6 * rows), squeeze=False, sharey=False, layout="constrained"
    )
    for ax, name in zip(axes.flat, names, strict=False):
        algos = sorted({algo for algo, _ in series[name]})
        for (algo, inplace), points in sorted(series[name].items()):
            xs = sorted(points)
            ax.plot(
                xs,
                [points[x] for x in xs],
                marker="o",
                markersize=2.5,
                linewidth=1.4,
                linestyle="--" if inplace else "-",
                color=PALETTE[algos.index(algo) % len(PALETTE)],
                label=f"{algo} ({'in-place' if inplace else 'out-of-place'})",
            )
        ax.set_xscale("log", base=2)
        ticks = sorted({x for pts in series[name].values() for x in pts})
        shown = ticks[:: max(1, len(ticks) // 5)]
        ax.set_xticks(shown, [format_size_short(t) for t in shown])
        ax.set_title(name)
        ax.set_xlabel("message size (bytes)")
        ax.set_ylabel("busbw (GB/s)")
        ax.legend(fontsize=8)
    for ax in axes.flat[len(names) :]:
        ax.set_visible(False)
    return to_svg(fig, "busbw vs message size per collective and algorithm")


# ---- job steps -----------------------------------------------------------------------------------


def _by_rank(records: Iterable[dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
    ranks: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        if isinstance(r.get("step"), int) and (rank := rank_of(r)) is not None:
            ranks[rank].append(r)
    for rows in ranks.values():
        rows.sort(key=lambda r: r["step"])
    return dict(sorted(ranks.items()))


def _curves(rows: Sequence[dict[str, Any]]) -> dict[str | None, list[dict[str, Any]]]:
    """One curve per series: an imported log's engines (`series`), or a watched script's optimizers
    (`optimizer`: a GAN's D and G), each drawn on its own instead of interleaved into one line."""
    for key, name in (("series", "series"), ("optimizer", "optimizer")):
        found = sorted({r[key] for r in rows if isinstance(r.get(key), int)})
        if len(found) > 1:
            return {f"{name} {k}": [r for r in rows if r.get(key) == k] for k in found}
    return {None: list(rows)}


def stability_plot(
    records: Sequence[dict[str, Any]], events: Sequence[Finding] = (), *, lr: bool = False
) -> str | None:
    """Loss, grad norm and loss scale of the lowest rank (and the LR with `lr`, for an imported log), with
    spikes (vertical lines) and skipped steps."""
    ranks = _by_rank(records)
    if not ranks:
        return None
    rows = next(iter(ranks.values()))
    names = (("loss", "loss"), ("grad_norm", "grad norm"), ("loss_scale", "loss scale"))
    names += (("lr", "learning rate"),) if lr else ()
    panels = [(k, t) for k, t in names if any(_num(r, k) is not None for r in rows)]
    if not panels:
        return None
    plt = _pyplot()
    fig, axes = plt.subplots(
        len(panels),
        1,
        figsize=(9.5, 2.0 * len(panels) + 0.4),
        sharex=True,
        squeeze=False,
        layout="constrained",
    )
    skipped = [r["step"] for r in rows if r.get("skipped")]
    spikes = sorted(
        {(int(f.where["step"]), f.check) for f in events if isinstance(f.where.get("step"), int | float)}
    )
    curves = _curves(rows)
    for ax, (key, title) in zip(axes[:, 0], panels, strict=True):
        values: dict[Any, float] = {}
        for i, (label, curve) in enumerate(curves.items()):
            pts = [(r["step"], v) for r in curve if (v := _num(r, key)) is not None]
            xs, ys = _thin([p[0] for p in pts], [p[1] for p in pts])
            ax.plot(xs, ys, linewidth=1.1, color=PALETTE[i % len(PALETTE)], label=label)
            values.update(pts)
        if key == "loss_scale" and values and min(values.values()) > 0:
            ax.set_yscale("log", base=2)
        marks = [s for s in skipped if s in values]
        if marks:
            ax.scatter(
                marks,
                [values[s] for s in marks],
                marker="x",
                s=18,
                color=PALETTE[5],
                zorder=3,
                label=f"skipped step ({len(skipped)})",
            )
        labelled: set[str] = set()
        for step, check in spikes:
            style = ":" if "grad" in check else "--"
            color = PALETTE[3] if "grad" in check else PALETTE[5]
            ax.axvline(
                step,
                color=color,
                linestyle=style,
                linewidth=1.2,
                label=None if check in labelled else _text(check),
            )
            labelled.add(check)
        ax.set_ylabel(title)
        if marks or spikes or len(curves) > 1:
            ax.legend(fontsize=8, loc="upper right")
    axes[-1, 0].set_xlabel(f"step (rank {next(iter(ranks))})")

    return to_svg(fig, "loss, grad norm and loss scale with spikes and skipped steps")


# ---- memwatch ------------------------------------------------------------------------------------


def memwatch_series(sample: dict[str, Any]) -> str:
    """The line of memwatch_plot a sample belongs to (its process's role, else its PID)."""
    return _text(sample.get("role") or sample.get("pid") or "process")


def memwatch_plot(samples: Sequence[dict[str, Any]], key: str | None = None) -> str | None:
    """Memory of every watched process over time (USS when readable, else RSS), grouped by role; `key`
    when the caller chose it over more samples than it passes (report/memwatch_view)."""
    series: dict[str, list[tuple[float, float]]] = defaultdict(list)
    key = key or ("uss" if any((_num(s, "uss") or 0) > 0 for s in samples) else "rss")
    t0 = min((t for s in samples if (t := _num(s, "t")) is not None), default=None)
    if t0 is None:
        return None
    for s in samples:
        value, t = _num(s, key), _num(s, "t")
        if value is None or t is None:
            continue
        series[memwatch_series(s)].append((t - t0, value / 2**20))
    if not series:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9.5, 3.0), layout="constrained")
    for role, pts in sorted(series.items())[:12]:
        pts.sort()
        xs, ys = _thin([p[0] for p in pts], [p[1] for p in pts])
        ax.plot(xs, ys, linewidth=1.1, label=role)
    ax.set_xlabel("time (s)")
    ax.set_ylabel(f"{key.upper()} (MiB)")
    ax.legend(fontsize=8, ncol=3)

    return to_svg(fig, f"memory ({key.upper()}) per process over time")


# ---- loader-sweep --------------------------------------------------------------------------------


def loader_configs(records: Iterable[dict[str, Any]]) -> dict[tuple, dict[str, Any]]:
    """The last (longest-measured) record of each DataLoader configuration that has a throughput."""
    configs: dict[tuple, dict[str, Any]] = {}
    for r in records:
        if _num(r, "samples_per_s") is None or r.get("status", "ok") != "ok":
            continue
        if not isinstance(r.get("num_workers"), int) or not isinstance(r.get("prefetch_factor") or 0, int):
            continue
        key = (
            r.get("num_workers"),
            r.get("prefetch_factor"),
            r.get("pin_memory"),
            r.get("persistent_workers"),
        )
        configs[key] = r
    return configs


def loader_plot(records: Iterable[dict[str, Any]], recommended: dict[str, Any] | None = None) -> str | None:
    """Throughput map: samples/s over num_workers × prefetch_factor (best over pin/persistent per cell)."""
    cells: dict[tuple[int, int], float] = {}
    for (workers, prefetch, _pin, _persist), r in loader_configs(records).items():
        cell = (int(workers), int(prefetch or 0))
        cells[cell] = max(cells.get(cell, 0.0), _num(r, "samples_per_s") or 0.0)
    if not cells:
        return None
    plt = _pyplot()
    workers = sorted({w for w, _ in cells})
    prefetch = sorted({p for _, p in cells})
    grid = [[cells.get((w, p), float("nan")) for w in workers] for p in prefetch]
    fig, ax = plt.subplots(
        figsize=(min(8, 2.0 + 0.8 * len(workers)), 1.0 + 0.5 * len(prefetch)), layout="constrained"
    )
    image = ax.imshow(grid, cmap="viridis", aspect="auto", origin="lower")
    top = max(cells.values()) or 1.0
    for yi, p in enumerate(prefetch):
        for xi, w in enumerate(workers):
            if (w, p) in cells:
                v = cells[(w, p)]
                ax.text(
                    xi,
                    yi,
                    f"{v:.0f}",
                    ha="center",
                    va="center",
                    fontsize=8,
                    color="#000000" if v > 0.6 * top else "#ffffff",
                )
    if recommended and recommended.get("num_workers") in workers:
        p = int(recommended.get("prefetch_factor") or 0)
        if p in prefetch:
            ax.add_patch(
                plt.Rectangle(
                    (workers.index(recommended["num_workers"]) - 0.5, prefetch.index(p) - 0.5),
                    1,
                    1,
                    fill=False,
                    edgecolor=PALETTE[5],
                    linewidth=2.2,
                )
            )
    ax.set_xticks(range(len(workers)), [str(w) for w in workers])
    ax.set_yticks(range(len(prefetch)), [str(p) if p else "—" for p in prefetch])
    ax.set_xlabel("num_workers")
    ax.set_ylabel("prefetch_factor")
    ax.grid(False)
    fig.colorbar(image, ax=ax, label="samples/s")

    return to_svg(fig, "DataLoader throughput map")
