"""The BraTS challenge's official scores: lesion-wise Dice, NSD and HD95 per region, computed by ``brats-evaluation``.

BraTS ranks segmentations by *lesion-wise* scores (BraTS 2023 on): each
region's connected components are lesions, predicted lesions are matched to
true ones, and a patient's score is over the matched lesions, a missed or
spurious lesion counting as a miss. The official code is the
``brats-evaluation`` package (Kofler et al.; ``pip install -e ".[brats]"``),
a set of configs for ``panoptica`` (Kofler, Möller et al., the instance-wise
evaluation library). How a distance is computed is part of the result:
eleven open-source HD95 implementations differ by more than 100 mm on the
same masks (Podobnik and Vrtovec 2024), so medfed computes these scores with
the package itself and names it and its version in results.json
(:func:`metric_code`), beside medfed's own whole-volume ("legacy") Dice and
HD95 (:mod:`medfed.evaluation.volume`).

For one patient, with the package's glioma config (``config_gli.yaml``: labels
1 NETC, 2 SNFH, 3 ET, regions WT = {1, 2, 3}, TC = {1, 3}, ET = {3}, which are
medfed's :class:`~medfed.data.brats.TumourLabel` values), each region is
scored as ``brats-parse-metrics seg`` reports it:

* lesions: 26-connected components (``cc3d``) of the region in the prediction
  and in the ground truth, matched one to one by maximum bipartite matching
  on Dice (any overlap, Dice > 1e-6, can match);
* ``lesion_dice_<r>``, ``lesion_nsd_<r>``, ``lesion_hd95_<r>``: the mean over
  the matched lesion pairs (panoptica's ``sq_dsc``, ``sq_nsd``, ``sq_hd95``),
  each pair's HD95 the 95th percentile of the two directed surface distances
  pooled (mm, from the voxel spacing) and its NSD at a tolerance of the
  smallest voxel side;
* once a pair matches, unmatched lesions (a missed true lesion, a spurious
  predicted one) do not enter these means: the package's ``seg`` report counts
  them only in its detection columns (TP, FP, FN), which medfed does not
  record; so a prediction with spurious lesions far from the tumour keeps a
  high lesion-wise Dice while its whole-volume Dice and HD95 drop;
* no matched pair while either side has a lesion (a missed tumour, or only
  spurious ones): Dice 0, NSD 0, HD95 373 mm (the package's penalty, the
  diagonal of the 1 mm SRI-24 grid, in place of panoptica's infinity);
* no lesion on either side: undefined (NaN, ``null`` in JSON; a site's mean
  is over the patients where it is defined).

The package is optional: without it these keys are absent and
:func:`metric_code` says why. ``evaluation.lesion_wise`` (null: when the
package is installed; true: required; false: never) decides.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import io
import math
import warnings
from collections.abc import Sequence
from functools import cache
from typing import Any

import numpy as np

from medfed.config import LESION_WISE_INSTALL, lesion_wise_available

PACKAGE = "brats-evaluation"
CONFIG = "gli"
"""The package's bundled config medfed uses: adult glioma (the BraTS 2023+ GLI task, whose regions are WT, TC, ET)."""
MISS_HD95_MM = 373.0
"""The package's HD95 for a region with no matched lesion (``brats_evaluation.metrics_parser``: "diameter of the cube in SRI space")."""
METRICS = ("lesion_dice", "lesion_nsd", "lesion_hd95")
_PANOPTICA_KEYS = {"lesion_dice": "sq_dsc", "lesion_nsd": "sq_nsd", "lesion_hd95": "sq_hd95"}
_OTHER_GROUPS = ("netc", "snfh", "rc")
"""The config's single-label groups, not BraTS regions: never evaluated."""


def metric_code(lesion_wise: bool) -> dict[str, Any]:
    """results.json's ``volume_metrics.code``: which code computed each whole-volume score, with versions.

    Args:
        lesion_wise: whether this run computed the lesion-wise scores.
    """
    legacy = (
        "medfed.evaluation.volume: Dice and IoU of the whole-volume masks; HD95 = the larger of the two directed 95th "
        "percentiles of the edge-to-edge distances (MONAI's definition, scipy's exact EDT; the grid's diagonal when one mask is empty)"
    )
    if not lesion_wise:
        reason = "not installed" if not lesion_wise_available() else "evaluation.lesion_wise is false"
        return {"legacy": legacy, "lesion_wise": None, "lesion_wise_note": f"{PACKAGE}: {reason} ({LESION_WISE_INSTALL})"}
    return {
        "legacy": legacy,
        "lesion_wise": {
            "package": PACKAGE,
            "version": importlib.metadata.version(PACKAGE),
            "panoptica": importlib.metadata.version("panoptica"),
            "config": f"config_{CONFIG}.yaml",
            "scores": {name: f"panoptica {key}" for name, key in _PANOPTICA_KEYS.items()},
            "miss_hd95_mm": MISS_HD95_MM,
        },
    }


@cache
def _evaluator() -> Any:
    """The package's glioma evaluator, loaded once per process (its citation banner off: medfed's docs cite it)."""
    from brats_evaluation import config_path
    from panoptica import Panoptica_Evaluator
    from panoptica.utils.citation_reminder import disable_citation_reminder

    disable_citation_reminder()
    with contextlib.redirect_stdout(io.StringIO()):  # it prints "the same labels were assigned to two groups": WT, TC, ET overlap by design
        return Panoptica_Evaluator.load_from_config(str(config_path(CONFIG)))


def lesion_wise_scores(
    prediction: np.ndarray, truth: np.ndarray, spacing_mm: Sequence[float], regions: Sequence[str]
) -> dict[str, float]:
    """``lesion_dice_<r>``, ``lesion_nsd_<r>``, ``lesion_hd95_<r>`` of one patient for each of ``regions``.

    Args:
        prediction, truth: ``(X, Y, Z)`` :class:`~medfed.data.brats.TumourLabel` arrays (0 background, 1 necrotic
            core, 2 oedema, 3 enhancing) on the same grid; for a whole-tumour model, any tumour label marks its tumour.
        spacing_mm: the voxel size along X, Y, Z.
        regions: a subset of ``("wt", "tc", "et")``.

    Returns:
        Floats; NaN where neither side has a lesion of the region (module docstring).
    """
    if prediction.shape != truth.shape:
        raise ValueError(f"prediction shape {prediction.shape} differs from the ground truth's {truth.shape}")
    evaluator = _evaluator()
    skipped = [name for name in (*_OTHER_GROUPS, "wt", "tc", "et") if name not in regions]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results = evaluator.evaluate(
            prediction.astype(np.uint8), truth.astype(np.uint8), voxelspacing=tuple(float(s) for s in spacing_mm), skip_groups=skipped
        )
    scores = {}
    for region in regions:
        values = results[region].to_dict()
        for name, key in _PANOPTICA_KEYS.items():
            scores[f"{name}_{region}"] = official_value(name, values[key])
    return scores


def official_value(name: str, value: Any) -> float:
    """A panoptica ``sq_*`` value as the package reports it: a float, infinity (no matched lesion) as 373 mm for HD95."""
    value = float("nan") if value is None else float(value)
    if name == "lesion_hd95" and math.isinf(value):
        return MISS_HD95_MM
    return value
