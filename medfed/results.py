"""The run's results: ``results.json`` and the per-site table printed at the end.

Both engines, the simulator (:mod:`medfed.experiment`) and a Flower
deployment's ServerApp (:mod:`medfed.deploy.server_app`), write one schema,
:func:`run_results`, so that ``python -m medfed compare``
(:mod:`medfed.compare.tables`) and :func:`format_table` read either:

* ``medfed_version``, ``engine`` (``"simulator"`` or ``"flower-deployment"``),
  ``strategy``, ``seed``, ``num_threads`` (torch's intra-op threads of the
  process that wrote it: the server's in a deployment);
* ``federation``: the data, ``task``, ``description``, ``generated``,
  ``holdout``, ``input_shape``, ``num_classes`` and per site ``sites``
  (``name``, ``n_train``, ``n_<holdout>``, more facts where the engine has
  them: the simulator all of :meth:`~medfed.data.federation.Federation.summary`,
  a deployment what each site declared when it identified itself);
* ``pooled`` (the centralised reference only), ``sites`` and ``mean`` (the
  last round's metrics, :func:`summarise`), ``failures``, ``excluded``,
  ``communication`` (:func:`communication_totals`), ``compute``
  (:func:`~medfed.federated.compute.compute_summary`), ``timing``
  (:func:`timing_summary`), ``executor`` (how the sites trained: ``name``,
  ``sequential`` or ``batched``, and under ``batched`` the ``sequential_plans``
  that trained one site at a time, with the reason:
  :meth:`~medfed.federated.sites.InProcessSites.record`; a deployment's
  sites each train alone), ``config`` (the resolved config), ``history``
  (the loop's round records), ``execution`` (the ``device`` the sites
  trained on, as the engine saw it, and the ``precision`` and ``compile``
  they trained with: ``trainer.precision``, ``trainer.compile``), and
  ``outcome`` when nothing was learned (:func:`learned_nothing`);
* the simulator's also ``baselines`` (the trivial predictors' scores on each
  site's evaluated split, :func:`~medfed.evaluation.baselines.site_baselines`:
  they read every site's data, which a deployment's server never sees) and,
  where whole volumes were evaluated, ``volume_metrics``
  (:func:`volume_metrics`: which code computed each whole-volume score, with
  its version, and every patient's scores);
* last, ``integrity``: the SHA-256 of everything before it (:func:`write_results`),
  so that a results.json changed by hand or by a damaged disk is refused by name
  where it is read back (``compare``, :func:`results_fault`).
"""

from __future__ import annotations

import hashlib
import json
import math
import platform
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

import medfed
from medfed.atomic import atomic_write
from medfed.federated.compute import compute_summary

if TYPE_CHECKING:
    from medfed.federated.loop import FederatedLoop


def run_results(
    loop: FederatedLoop,
    *,
    engine: str,
    federation: dict[str, Any],
    timing: dict[str, Any],
    config: dict[str, Any],
    executor: dict[str, Any],
    device: str,
    pooled: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """results.json of a run (module docstring), from its loop's state after the rounds it has run.

    Args:
        loop: the run's loop (its history, links, exclusions, strategy, seed).
        engine: ``"simulator"`` or ``"flower-deployment"``.
        federation: the ``federation`` section; its ``holdout`` and each
            site's ``n_<holdout>`` size the table's rows.
        timing: :func:`timing_summary` (and whatever an engine adds to it).
        config: the resolved config.
        executor: how the sites trained (module docstring).
        device: where the sites trained (the simulator's device; a deployment: ``trainer.device``, each
            SuperNode resolving it for itself).
        pooled: the pooled reference's account (:func:`~medfed.data.pooling.pooled_reference`), None for a federated run.
    """
    holdout = federation["holdout"]
    sizes = {site["name"]: site[f"n_{holdout}"] for site in federation["sites"]}
    results = {
        "medfed_version": medfed.__version__,
        "engine": engine,
        "strategy": loop.strategy.name,
        "seed": loop.seed,
        "num_threads": torch.get_num_threads(),
        "federation": federation,
        **({"pooled": pooled} if pooled is not None else {}),
        **summarise(loop.history, sizes, holdout),
        "failures": [failure for record in loop.history for failure in record["failures"]],
        "excluded": loop.excluded,
        "communication": communication_totals(loop.links),
        "compute": compute_summary(loop.history, loop.site_names),
        "timing": timing,
        "executor": executor,
        "config": config,
        "history": loop.history,
        "execution": {"device": device, "precision": config["trainer"]["precision"], "compile": config["trainer"]["compile"]},
    }
    failed = learned_nothing(loop.history)
    if failed is not None:
        results["outcome"] = f"failed: {failed}"
    return results


def timing_summary(
    history: list[dict[str, Any]], wall_s: float, device: torch.device, steps: dict[str, float] | None = None, tracker_s: float = 0.0
) -> dict[str, Any]:
    """results.json's ``timing``: the run's wall time and its split, the server step's and codecs' shares of the rounds, the machine.

    Args:
        history: the loop's round records (their ``timing``: ``round_s``, ``train_s``, ``eval_s``, ``server_s``,
            ``codec_s``, and ``volume_eval_s``, ``round_start_s`` where measured; seconds).
        wall_s: seconds since the run (this part of a resumed run) started.
        device: where the loop's tensors live.
        steps: the steps outside the rounds that the engine timed: ``data_s`` (building the federation),
            ``setup_s`` (round 0: the sites' setup replies, the server's setup, the first delivery),
            ``checkpoint_s`` (on the training path: copying each round's state, waiting for a write),
            ``checkpoint_write_s`` (the background writer's, beside the training), ``figures_s``.
        tracker_s: the loggers' own time (starting and finishing them, W&B images).
    """
    steps = steps or {}
    round_s = sum(r["timing"]["round_s"] for r in history)
    server_s = sum(r["timing"]["server_s"] for r in history)
    codec_s = sum(r["timing"]["codec_s"] for r in history)
    return {
        "data_s": steps.get("data_s", 0.0),
        "setup_s": steps.get("setup_s", 0.0),
        "train_s": sum(r["timing"].get("train_s", 0.0) for r in history),
        "patch_eval_s": sum(r["timing"].get("eval_s", 0.0) for r in history),
        "volume_eval_s": sum(r["timing"].get("volume_eval_s", 0.0) for r in history),
        "round_start_s": sum(r["timing"].get("round_start_s", 0.0) for r in history),
        "checkpoint_s": steps.get("checkpoint_s", 0.0),
        "checkpoint_write_s": steps.get("checkpoint_write_s", 0.0),
        "logging_s": tracker_s,
        "figures_s": steps.get("figures_s", 0.0),
        "wall_s": wall_s,
        "rounds_s": round_s,
        "mean_round_s": round_s / max(len(history), 1),
        "server_step_s": server_s,
        "server_step_share": server_s / round_s if round_s else 0.0,
        "codec_s": codec_s,
        "codec_share": codec_s / round_s if round_s else 0.0,
        "machine": f"{platform.machine()} {platform.processor() or ''} threads={torch.get_num_threads()} device={device}".strip(),
    }


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
    mean = {n: _mean_of_reported([row[n] for row in rows]) for n in names}
    return {"sites": rows, "mean": mean}


def volume_metrics(history: list[dict[str, Any]], lesion_wise: bool) -> dict[str, Any]:
    """results.json's ``volume_metrics``: the code (and version) behind each whole-volume score, and every patient's scores.

    Returns:
        ``{"code": ..., "round": r, "patients": {site: {case: {metric: value}}}}`` of the last round with
        whole-volume scores (``round`` null and no patients before any); the site means are in ``sites``.
    """
    from medfed.evaluation.lesion_wise import metric_code

    evaluated = [record for record in history if "volumes" in record]
    last = evaluated[-1] if evaluated else None
    return {"code": metric_code(lesion_wise), "round": last["round"] if last else None, "patients": last["volumes"] if last else {}}


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


VOLUME_METRIC = re.compile(r"(lesion_dice|lesion_nsd|lesion_hd95|dice|iou|hd95)_(wt|tc|et)")
"""A whole-volume score's key: ``<metric>_<region>`` (:mod:`medfed.evaluation.volume`, :mod:`medfed.evaluation.lesion_wise`)."""
VOLUME_COLUMNS = ("dice", "iou", "hd95", "lesion_dice", "lesion_nsd", "lesion_hd95")
REGION_TITLES = {"wt": "WT, whole tumour", "tc": "TC, tumour core", "et": "ET, enhancing tumour"}


def format_table(results: dict[str, Any]) -> str:
    """Plain-text table: one row per site, then the mean over sites; data provenance on top.

    Metrics on a validation split (``federation.holdout``) say so in the title
    and in the size column's name (``n_validation``). A site excluded for
    failing is marked ``*`` and a line under the table says when and why. A
    pooled run (``results["pooled"]``) says above the table that it is the
    centralised reference, not a federated result. Whole-volume scores follow
    in one block per region (:func:`volume_blocks`).
    """
    split = results["federation"].get("holdout", "test")
    size = f"n_{split}"
    rows = results["sites"]
    names = [k for k in rows[0] if k not in ("site", size)]
    volume = [name for name in names if VOLUME_METRIC.fullmatch(name)]
    names = [name for name in names if name not in volume]
    header = ["site", *names, size]
    excluded = results.get("excluded", {})
    mark = lambda site: site + ("*" if site in excluded else "")
    body = [[mark(row["site"]), *(format_cell(row[n]) for n in names), str(row[size])] for row in rows]
    body.append(["mean", *(format_cell(results["mean"][n]) for n in names), str(sum(r[size] for r in rows))])
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
    client_dp = results.get("privacy", {}).get("client_dp")
    if client_dp:  # client-level DP at aggregation (medfed.federated.privacy.ClientDP)
        epsilon = math.inf if client_dp["epsilon"] is None else client_dp["epsilon"]
        notes.append(
            f"client-level DP (rdp, delta={client_dp['delta']:g}, C={client_dp['clipping_norm']:g}, sigma={client_dp['noise_multiplier']:g}): "
            f"epsilon {epsilon:.3g} after {client_dp['releases']} noised aggregations"
        )
    pooled = results.get("pooled")
    if pooled:  # not a federated result: say so above the table
        title += f"\n{pooled['reference']} ({pooled['n_train']} training samples, held at {pooled['pool_site']})"
    if volume:
        notes.append(f"{', '.join(names)}: over all {split} patches of a site ({size} = patches)")
    lines = [title, *text_grid(header, body, ruled_last=True), *notes]
    if volume:
        lines += volume_blocks(rows, results["mean"], volume, split, results["federation"], results.get("volume_metrics", {}).get("code"))
    return "\n".join(lines)


def volume_blocks(
    rows: list[dict[str, Any]], mean: dict[str, float], names: list[str], split: str, federation: dict[str, Any], code: dict[str, Any] | None
) -> list[str]:
    """The whole-volume scores as one small table per region: a row per site and the mean, a column per score.

    Args:
        rows, mean: the table's site rows and means (``<metric>_<region>`` keys among them).
        names: the whole-volume keys present.
        split: the evaluated split (its patients are averaged).
        federation: results.json's ``federation`` (each site's ``<split>_cases`` count the patients).
        code: results.json's ``volume_metrics.code`` (which code computed what), if known.
    """
    patients = sorted({len(site.get(f"{split}_cases", [])) for site in federation.get("sites", [])})
    per_site = ""
    if patients and patients[-1]:
        per_site = f" ({patients[0]} per site)" if len(patients) == 1 else f" ({patients[0]}-{patients[-1]} per site)"
    lesion = (code or {}).get("lesion_wise")
    by = f"lesion_*: brats-evaluation {lesion['version']} (panoptica {lesion['panoptica']}), a missed lesion's HD95 = {lesion['miss_hd95_mm']:g} mm" if lesion else ""
    lines = [
        f"whole volumes: mean over each site's {split} patients{per_site}; HD95 in mm; dice, iou, hd95: medfed's whole-volume "
        f"(legacy) scores" + (f"; {by}" if by else "")
    ]
    note = (code or {}).get("lesion_wise_note")
    if note and not lesion:
        lines[0] += f"; no lesion-wise scores ({note})"
    for region in REGION_TITLES:
        columns = [column for column in VOLUME_COLUMNS if f"{column}_{region}" in names]
        if not columns:
            continue
        header = [REGION_TITLES[region], *columns]
        body = [[row["site"], *(format_cell(row[f"{column}_{region}"]) for column in columns)] for row in rows]
        body.append(["mean", *(format_cell(mean[f"{column}_{region}"]) for column in columns)])
        lines += text_grid(header, body, ruled_last=True)
    return lines


def format_cell(value: Any) -> str:
    """A table cell: 4 decimals, or ``-`` where a score is undefined (NaN, null)."""
    return "-" if value is None or value != value else f"{value:.4f}"


def text_grid(header: list[str], body: list[list[str]], ruled_last: bool = False) -> list[str]:
    """Aligned text rows: a rule, the header, a rule, the body (the last row under a rule of its own with ``ruled_last``)."""
    widths = [max(len(header[i]), *(len(r[i]) for r in body)) for i in range(len(header))]
    line = lambda cells: "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    rule = "-" * (sum(widths) + 2 * (len(widths) - 1))
    if ruled_last:
        return [rule, line(header), rule, *map(line, body[:-1]), rule, line(body[-1])]
    return [rule, line(header), rule, *map(line, body)]


def _mean_of_reported(values: list[float]) -> float:
    """The mean over the sites that reported a value (a site whose delivery failed has NaN); NaN when none did."""
    reported = [value for value in values if value == value]
    return float(np.mean(reported)) if reported else float("nan")


INTEGRITY = "integrity"
"""results.json's last key, its trailer: ``{"sha256": <hex>}`` of everything before it (:func:`write_results`)."""


def write_results(path: str | Path, results: dict[str, Any]) -> None:
    """Write results.json (:func:`write_json_atomic`) with its integrity trailer last: the SHA-256 of the rest in
    canonical JSON (keys sorted, no spaces), which ``compare`` checks before it counts or tabulates a run (:func:`results_fault`)."""
    body = json.loads(json.dumps(_finite_or_null(results), default=_json_default))
    write_json_atomic(path, {**body, INTEGRITY: {"sha256": _digest(body)}})


def results_fault(results: dict[str, Any]) -> str | None:
    """Why a results.json read back cannot be trusted as a run wrote it (no trailer, or content that does not match it), or None."""
    trailer = results.get(INTEGRITY)
    if not isinstance(trailer, dict) or not isinstance(trailer.get("sha256"), str):
        return f"holds no integrity trailer ({INTEGRITY!r}, written with every results.json since medfed sealed them)"
    if _digest({key: value for key, value in results.items() if key != INTEGRITY}) != trailer["sha256"]:
        return "does not match its SHA-256 integrity trailer: it was changed after the run wrote it"
    return None


def _digest(body: dict[str, Any]) -> str:
    """The SHA-256 of ``body`` as canonical JSON (keys sorted, no spaces, UTF-8)."""
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()).hexdigest()


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
