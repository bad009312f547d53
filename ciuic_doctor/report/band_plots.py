"""Plots of many ranks that stay readable at 10,000 ranks: cross-rank bands with the outlier ranks drawn
on top and labelled, and a host × rank heat-map (a raster image inside the SVG, so its size does not grow
with the number of ranks in SVG paths).

Inputs are the tidy frames and matrices of `report.rank_view`, never records; outputs are inline SVG
strings like every plot of the report (`plots.to_svg`: theme colours, fluid width).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ciuic_doctor.report.plots import INK, PALETTE, _pyplot, _text, to_svg

if TYPE_CHECKING:
    import numpy as np
    import pandas as pd

MAX_HOST_LABELS = 40  # tick labels on the heat-map's host axis; more would overlap
MAX_HEAT_HOSTS = 64  # rows of the heat-map: beyond, a row is too thin to see


def natural_key(name: str) -> list:
    """node-96 before node-1025: digit runs compare as numbers."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def _band(ax: Any, frame: pd.DataFrame, unit: str, color: str) -> None:
    x = frame["step"].to_numpy()
    ax.fill_between(
        x, frame[f"min_{unit}"], frame[f"max_{unit}"], color=color, alpha=0.18, linewidth=0, label="min–max"
    )
    ax.plot(x, frame[f"p99_{unit}"], color=color, linewidth=0.9, linestyle="--", label="p99")
    ax.plot(x, frame[f"p50_{unit}"], color=color, linewidth=1.4, label="median")


def band_plot(
    panels: Sequence[dict[str, Any]],
    *,
    name: str,
    ranks: int,
) -> str | None:
    """One panel per dict: {frame (rank_view.bands), unit, ylabel, lines [(label, xs, ys)], fits
    [(label, (x0, x1), (y0, y1))]}; the band is over all `ranks`, the lines are the outliers."""
    panels = [p for p in panels if p["frame"] is not None and len(p["frame"])]
    if not panels:
        return None
    plt = _pyplot()
    fig, axes = plt.subplots(
        len(panels),
        1,
        figsize=(9.5, 2.6 * len(panels) + 0.3),
        sharex=True,
        squeeze=False,
        layout="constrained",
    )
    for ax, panel in zip(axes[:, 0], panels, strict=True):
        _band(ax, panel["frame"], panel["unit"], PALETTE[0])
        for i, (label, xs, ys) in enumerate(panel.get("lines") or []):
            color = PALETTE[(i + 1) % len(PALETTE)]
            ax.plot(xs, ys, linewidth=1.1, color=color, label=_text(label))
            if xs:
                ax.annotate(
                    _text(label),
                    (xs[-1], ys[-1]),
                    fontsize=7,
                    color=color,
                    xytext=(2, 0),
                    textcoords="offset points",
                    va="center",
                )
        for label, (x0, x1), (y0, y1) in panel.get("fits") or []:
            ax.plot([x0, x1], [y0, y1], linestyle=":", color=INK, linewidth=1.2, label=_text(label))
        ax.set_ylabel(panel["ylabel"])
        ax.legend(fontsize=7, ncol=4, loc="upper left")
    axes[-1, 0].set_xlabel(f"step (band over {ranks} ranks; outliers drawn and labelled)")
    return to_svg(fig, name)


def host_heatmap(
    hosts: Sequence[str | None],
    ranks: Sequence[int],
    values: dict[str, np.ndarray],
    *,
    name: str,
) -> str | None:
    """Host (rows) × the host's n-th rank (columns) of each value (one panel each, e.g. step time relative
    to the typical rank, peak memory); a slow host is a bright row, a slow rank a bright cell."""
    import numpy as np

    names = sorted({h for h in hosts if h}, key=natural_key)
    if len(names) < 2 or not values:
        return None
    title_note = ""
    if len(names) > MAX_HEAT_HOSTS:
        # 1,250 hosts would be 1,250 one-pixel rows: show the hosts the first panel ranks highest
        first = np.asarray(next(iter(values.values())), dtype=float)
        worst: dict[str, float] = {}
        for host, value in zip(hosts, first, strict=True):
            if host and np.isfinite(value):
                worst[host] = max(worst.get(host, -np.inf), value)
        top = set(sorted(worst, key=lambda h: -worst[h])[:MAX_HEAT_HOSTS])
        title_note = f" ({MAX_HEAT_HOSTS} of {len(names)} hosts: the highest first-panel values)"
        names = [n for n in names if n in top]
        keep = [h in top for h in hosts]
        hosts = [h for h, k in zip(hosts, keep, strict=True) if k]
        ranks = [r for r, k in zip(ranks, keep, strict=True) if k]
        values = {t: np.asarray(v, dtype=float)[keep] for t, v in values.items()}
    row_of = {h: i for i, h in enumerate(names)}
    slots: dict[str, int] = {}
    cells = []
    for _, host in sorted(zip(ranks, hosts, strict=True), key=lambda p: p[0]):
        if host:
            cells.append((row_of[host], slots.get(host, 0)))
            slots[host] = slots.get(host, 0) + 1
        else:
            cells.append(None)
    width = max(slots.values())
    plt = _pyplot()
    height = min(9.0, 1.2 + 0.14 * len(names))
    fig, axes = plt.subplots(
        1, len(values), figsize=(4.6 * len(values), height), squeeze=False, layout="constrained"
    )
    order = np.argsort(np.asarray(ranks))
    for ax, (title, data) in zip(axes[0], values.items(), strict=True):
        grid = np.full((len(names), width), np.nan)
        for cell, value in zip(cells, np.asarray(data, dtype=float)[order], strict=True):
            if cell is not None:
                grid[cell] = value
        image = ax.imshow(grid, aspect="auto", cmap="viridis", interpolation="nearest")
        stride = max(1, -(-len(names) // MAX_HOST_LABELS))
        ax.set_yticks(range(0, len(names), stride), [_text(n) for n in names[::stride]], fontsize=7)
        ax.set_xlabel("rank within host")
        ax.set_title(_text(title + (title_note if ax is axes[0][0] else "")), fontsize=9)
        ax.grid(False)
        fig.colorbar(image, ax=ax)
    return to_svg(fig, name)
