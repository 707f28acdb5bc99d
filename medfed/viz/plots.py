"""Figures a run writes next to its results: learning curves, segmentation overlays, similarity graphs.

Each carries the data's provenance in its title, so a figure made from
generated data says so wherever it is shown.

Every function builds a :class:`matplotlib.figure.Figure` directly rather
than through pyplot: no backend is chosen or switched, so files are written
on machines without a display, and the same figure shows inline when a
notebook cell returns it (pyplot is left to whoever imports medfed).
"""

from __future__ import annotations

import math
import textwrap
from pathlib import Path
from typing import Any

import torch
from matplotlib.figure import Figure


def plot_learning_curves(history: list[dict[str, Any]], title: str) -> Figure:
    """One panel per metric: every site's test metric per round, and the mean over sites.

    Args:
        history: the loop's per-round records (``record["metrics"][site][name]``); a metric
            evaluated on some rounds only (whole-volume scores) is drawn on those rounds, with markers.
        title: figure title (strategy, task, data provenance).
    """
    names = list(dict.fromkeys(name for record in history for name in record["mean"]))  # some only on some rounds
    figure = Figure(figsize=(4.5 * len(names), 3.6))
    axes = figure.subplots(1, len(names), squeeze=False)
    for axis, name in zip(axes[0], names):
        records = [record for record in history if name in record["mean"]]
        rounds = [record["round"] for record in records]
        marker = "o" if len(records) < len(history) else None
        for site in history[0]["metrics"]:
            axis.plot(rounds, [r["metrics"][site][name] for r in records], lw=1, alpha=0.7, marker=marker, ms=3, label=site)
        axis.plot(rounds, [r["mean"][name] for r in records], "k-", lw=2.2, marker=marker, label="mean")
        axis.set_xlabel("round")
        axis.set_ylabel(name)
        axis.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=8, loc="lower right")
    figure.suptitle(textwrap.fill(title, 110), fontsize=9)
    figure.tight_layout()
    return figure


@torch.no_grad()
def plot_segmentation_examples(sites: list, title: str, per_site: int = 4, channel: int = 0) -> Figure | None:
    """Test patches of every site with the true (red) and predicted (cyan) tumour outlines.

    Args:
        sites: the run's sites; each site's model predicts on its own first test patches.
        title: figure title.
        per_site: patches shown per site.
        channel: image channel drawn as background (0 = FLAIR for BraTS); if
            that channel is all zero at a site (a missing sequence) the
            first non-zero channel is drawn instead.

    Returns:
        The figure, or ``None`` when the targets are not images (not a segmentation task).
    """
    x, y = sites[0].data.test.tensors
    if y.ndim not in (3, 4):  # (n, P, P) classes or (n, R, P, P) region masks
        return None
    figure = Figure(figsize=(2.1 * per_site, 2.2 * len(sites)))
    axes = figure.subplots(len(sites), per_site, squeeze=False)
    for row, site in zip(axes, sites):
        x, y = (t[:per_site] for t in site.data.test.tensors)
        site.module.eval()
        prediction = site.module.region_masks(site.module(site.fabric.to_device(x)))[:, 0].cpu()  # whole tumour
        y = y[:, 0] if y.ndim == 4 else y
        shown = channel if x[:, channel].abs().sum() > 0 else int((x.abs().sum(dim=(0, 2, 3)) > 0).float().argmax())
        for axis, image, truth, predicted in zip(row, x[:, shown], y, prediction):
            axis.imshow(image.numpy().T, cmap="gray", origin="lower")
            for mask, colour in ((truth, "red"), (predicted, "cyan")):
                if mask.any():
                    axis.contour(mask.numpy().T.astype(float), levels=[0.5], colors=colour, linewidths=1.0, origin="lower")
            axis.set_xticks([])
            axis.set_yticks([])
        row[0].set_ylabel(f"{site.name}\n(channel {shown})", fontsize=8)
    figure.suptitle(textwrap.fill(title, 18 * per_site) + "\nred: truth, cyan: prediction", fontsize=8)
    figure.tight_layout()
    return figure


def plot_similarity_graphs(panels: list[tuple[str, Any]], title: str) -> Figure:
    """One panel per graph: the sites on a circle, each edge drawn with width and label by its weight.

    Args:
        panels: ``(label, SimilarityGraph)`` pairs, e.g. one per rebuild of the graph.
        title: figure title.
    """
    figure = Figure(figsize=(4.2 * len(panels), 4.6))
    axes = figure.subplots(1, len(panels), squeeze=False)
    for axis, (label, graph) in zip(axes[0], panels):
        n = graph.n_sites
        angle = 2 * math.pi * torch.arange(n, dtype=torch.float64, device="cpu") / n
        xy = torch.stack([torch.sin(angle), torch.cos(angle)], dim=1).tolist()
        for (i, j), weight in zip(graph.edges, graph.weights):
            (x0, y0), (x1, y1) = xy[i], xy[j]
            axis.plot([x0, x1], [y0, y1], "-", color="tab:blue", lw=0.5 + 4.5 * weight, alpha=0.4 + 0.6 * weight, zorder=1)
            axis.text((x0 + x1) / 2, (y0 + y1) / 2, f"{weight:.2f}", fontsize=8, ha="center", va="center",
                      bbox={"boxstyle": "round,pad=0.15", "fc": "white", "ec": "none", "alpha": 0.8}, zorder=3)
        for index, (x, y) in enumerate(xy):
            axis.scatter([x], [y], s=600, color="white", edgecolors="black", zorder=2)
            axis.text(x, y, f"site{index}", fontsize=8, ha="center", va="center", zorder=4)
        axis.set_xlim(-1.35, 1.35)
        axis.set_ylim(-1.35, 1.35)
        axis.set_aspect("equal")
        axis.axis("off")
        axis.set_title(f"{label}: {len(graph.edges)} edges", fontsize=9)
    figure.suptitle(textwrap.fill(f"{title}; edge labels = weights", 110), fontsize=9)
    figure.tight_layout()
    return figure


def save_figure(figure: Figure, path: Path) -> None:
    """Write ``figure`` as PNG via a temporary file (renamed into place, so no half-written file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.png")
    figure.savefig(tmp, dpi=110)
    tmp.replace(path)

