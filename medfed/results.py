"""The run's results: ``results.json`` and the per-site table printed at the end."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from medfed.atomic import atomic_write


def summarise(history: list[dict[str, Any]], site_sizes: dict[str, int], split: str = "test") -> dict[str, Any]:
    """Final per-site metrics and their mean over sites, from the last round of ``history``.

    Args:
        history: the loop's per-round records.
        site_sizes: ``{site name: samples evaluated}``.
        split: the split the metrics are on (``federation.holdout``: test or validation).

    Returns:
        ``{"sites": [{"site", <metrics>, "n_<split>"}], "mean": {<metrics>}}``.
    """
    final = history[-1]["metrics"]
    names = list(next(iter(final.values())).keys())
    size = f"n_{split}"
    rows = [{"site": site, **{n: metrics[n] for n in names}, size: site_sizes[site]} for site, metrics in final.items()]
    mean = {n: float(np.mean([row[n] for row in rows])) for n in names}
    return {"sites": rows, "mean": mean}


def learned_nothing(history: list[dict[str, Any]]) -> str | None:
    """Why the run learned nothing, or None: every round's participants all failed (no reply was aggregated in any round).

    The returned text counts the rounds and quotes the first failure, e.g.
    ``every site failed in every one of the 3 rounds (first: site0 in round 1, local phase: non-finite reply ('all'))``.
    """
    if not history or any(set(record["participants"]) - {failure["site"] for failure in record["failures"]} for record in history):
        return None
    failures = [failure for record in history for failure in record["failures"]]
    first = f" (first: {failures[0]['site']} in round {failures[0]['round']}, {failures[0]['phase']} phase: {failures[0]['reason']})" if failures else ""
    return f"every site failed in every one of the {len(history)} rounds{first}"


def communication_totals(links: list) -> dict[str, Any]:
    """Bytes up and down over the whole run (setup included) and the ratio against dense float32.

    Args:
        links: the run's :class:`~medfed.federated.link.Link` objects.
    """
    totals: dict[str, Any] = {}
    for direction in ("up", "down"):
        sent = sum(link.bytes_sent[direction] for link in links)
        dense = sum(link.dense_bytes[direction] for link in links)
        totals[f"bytes_{direction}"] = sent
        totals[f"dense_float32_bytes_{direction}"] = dense
        totals[f"compression_ratio_{direction}"] = dense / sent if sent else None
    return totals


def format_table(results: dict[str, Any]) -> str:
    """Plain-text table: one row per site, then the mean over sites; data provenance on top.

    Metrics on a validation split (``federation.holdout``) say so in the title
    and in the size column's name (``n_validation``). A site excluded for
    failing is marked ``*`` and a line under the table says when and why. A
    pooled run (``results["pooled"]``) says above the table that it is the
    centralised reference, not a federated result.
    """
    split = results["federation"].get("holdout", "test")
    size = f"n_{split}"
    rows = results["sites"]
    names = [k for k in rows[0] if k not in ("site", size)]
    header = ["site", *names, size]
    excluded = results.get("excluded", {})
    mark = lambda site: site + ("*" if site in excluded else "")
    body = [[mark(row["site"]), *(f"{row[n]:.4f}" for n in names), str(row[size])] for row in rows]
    body.append(["mean", *(f"{results['mean'][n]:.4f}" for n in names), str(sum(r[size] for r in rows))])
    widths = [max(len(header[i]), *(len(r[i]) for r in body)) for i in range(len(header))]
    line = lambda cells: "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    rule = "-" * (sum(widths) + 2 * (len(widths) - 1))
    title = f"{results['strategy']} on {results['federation']['task']}, data: {results['federation']['description']}"
    if split != "test":
        title += f"; metrics on the {split.upper()} split (test split set aside)"
    notes = [f"* {site}: excluded after round {info['round']}, its last failure: {info['reason']}" for site, info in excluded.items()]
    dp = results.get("privacy", {}).get("dp_sgd")
    if dp:  # DP-SGD at each site (medfed.federated.privacy): each site's epsilon under the table
        first = next(iter(dp.values()))
        epsilons = ", ".join(f"{site} {math.inf if info['epsilon'] is None else info['epsilon']:.3g}" for site, info in dp.items())  # null: inf
        notes.append(f"DP-SGD ({first['accountant']}, delta={first['delta']:g}, C={first['max_grad_norm']:g}): epsilon {epsilons}")
        notes += [f"DP-SGD model change: {change}" for change in results["privacy"].get("model_changes", [])]
    pooled = results.get("pooled")
    if pooled:  # not a federated result: say so above the table
        title += f"\n{pooled['reference']} ({pooled['n_train']} training samples, held at {pooled['pool_site']})"
    return "\n".join([title, rule, line(header), rule, *map(line, body[:-1]), rule, line(body[-1]), *notes])


def write_json_atomic(path: str | Path, obj: Any) -> None:
    """Write JSON to a temporary file next to ``path`` and rename it into place (:func:`~medfed.atomic.atomic_write`).

    Non-finite floats (NaN, inf) become ``null``: standard JSON has no such values.
    """
    obj = _finite_or_null(obj)
    with atomic_write(path) as handle:
        json.dump(obj, handle, indent=2, default=_json_default)


def _finite_or_null(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite_or_null(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_or_null(item) for item in value]
    return value


def _json_default(value: Any) -> Any:
    if isinstance(value, (np.integer, np.floating)):
        return value.item()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")
