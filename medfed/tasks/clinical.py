"""The clinical task: federated risk prediction from tabular patient records under label imbalance.

Records come from a CSV (:func:`medfed.data.tabular.read_tabular_csv`): a
binary target column, optionally a site column, every other column a numeric
feature or a text (categorical) one, one-hot encoded over the levels found in
the file; missing cells are filled with 0 (pFedNet, section VI-A). The embedded
default is REAL data, not generated: the Wisconsin diagnostic breast-cancer
table shipped inside scikit-learn (569 records, 30 features, target
``diagnosis``, positive ``malignant``), written to ``csv`` as an ordinary file
and read back through the same reader as user data. A federation is built in
four seeded steps:

1. **Sites.** From the site column when configured (its distinct values,
   sorted, are sites 0 .. S-1; each must hold both classes), otherwise a
   seeded shuffle of the records dealt into S sites of
   ``federation.site_sizes`` (equal: round robin).
2. **Train/test by record.** Each site's records are split 80/20 (the
   federation's ``test_fraction``) with a seeded draw per site, stratified by
   class, so train and test each hold both classes. With
   ``federation.validation_fraction`` > 0 the training records are split
   again, by the same stratified draw with seeds of their own, into train
   and validation; with ``federation.holdout: validation`` the test records
   are set aside and the validation split replaces test for the run.
3. **Label ratio.** Within each split, every site keeps records at its own
   ratio delta_s = n_negative / n_positive around the federation's delta
   (:mod:`medfed.tasks.label_imbalance`): train, test and validation
   carry the same ratio.
4. **Scaling to [-1, 1] per site.** Each feature's minimum and maximum are
   fitted on the site's own *training* records only and applied to that
   site's train, test and validation records (values beyond the range
   are clipped).
   No statistic of one site's data reaches another site, and no test record
   shapes its own scaling.

Samples: ``x`` float32 (n, f), ``y`` int64 (n,), 1 = the positive value.
``SiteData.info`` records each site's train and test (or validation, plus
the set-aside test) records (0-based positions among the file's records),
the ratios, class counts and records the label ratio dropped, and the
scaling's origin. ``Federation.features`` (in results.json) lists the
feature names, the categorical columns with their levels, and the missing
cells per column.
"""

from __future__ import annotations

import csv
import tempfile
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import TensorDataset

from medfed.config import FederationConfig
from medfed.data.csv_rows import read_csv_rows
from medfed.data.federation import (
    Federation,
    SiteData,
    SiteSplit,
    refuse_site_sizes,
    site_of_positions,
    site_sizes_summary,
    site_too_small,
    split_site,
)
from medfed.data.tabular import (
    TabularData,
    check_sites_have_both_classes,
    fit_minmax,
    read_tabular_csv,
    scale_to_unit_interval,
    write_breast_cancer_csv,
)
from medfed.errors import ConfigError, DataError
from medfed.options.tasks import ClinicalOptions as Options
from medfed.tasks.label_imbalance import refuse_label_ratio, sites_at_label_ratio

NAME = "clinical"
CLASS_NAMES = ("negative", "positive")  # label 0, label 1


def build_federation(options: Options, federation: FederationConfig, seed: int, progress: bool = True) -> Federation:
    """Read the records, place them at sites, split, impose the label ratios, scale per site."""
    path = Path(options.csv)
    if options.embedded is not None:
        _write_embedded_table(path, options.embedded)
    data = read_tabular_csv(
        path,
        target=options.target,
        positive=options.positive,
        site_column=options.site_column,
        exclude_columns=tuple(options.exclude_columns),
    )
    site_of_record, site_names = _sites(data, federation, seed, path, options.site_column)
    evaluated, set_aside, in_validation, set_aside_of_site = _split_sites(data, site_of_record, federation, seed, path, options)
    kept = sites_at_label_ratio(
        data.labels,
        site_of_record,
        evaluated,
        n_sites=federation.n_sites,
        label_ratio=federation.label_ratio,
        seed=seed,
        source=str(path),
        set_aside=set_aside,
        evaluation_split=federation.holdout,
        noun="records",
        in_validation=in_validation if in_validation.any() else None,
    )

    sites = [_site_data(data, index, samples, site_names[index], set_aside_of_site[index], federation.holdout) for index, samples in enumerate(kept)]
    origin = (
        "REAL data: scikit-learn's Wisconsin diagnostic breast-cancer table"
        if options.embedded == "breast_cancer"
        else "clinical records"
    )
    description = (
        f"{origin} ({path}; target {options.target!r} = {options.positive!r}; "
        f"{len(data.feature_names)} features, {len(data.categories)} categorical column(s) one-hot encoded, "
        f"{data.n_missing} missing cells filled with 0)"
    )
    features = {
        "names": list(data.feature_names),
        "categorical": {column: list(levels) for column, levels in data.categories.items()},
        "missing_per_column": data.missing_per_column,
    }
    return Federation(
        task=NAME,
        sites=sites,
        input_shape=(len(data.feature_names),),
        num_classes=2,
        description=description,
        generated=False,
        holdout=federation.holdout,
        features=features,
        site_sizes=site_sizes_summary(federation, np.bincount(site_of_record, minlength=federation.n_sites), "records"),
    )


def _split_sites(
    data: Any, site_of_record: np.ndarray, federation: FederationConfig, seed: int, path: Path, options: Options
) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[list[int]]]:
    """Each site's records split (:func:`split_site`): the masks over all records of the evaluated, set-aside and
    validation ones, and each site's set-aside record indices."""
    evaluated = np.zeros(len(data), dtype=bool)
    set_aside = np.zeros(len(data), dtype=bool)
    in_validation = np.zeros(len(data), dtype=bool)
    set_aside_of_site = []
    for index in range(federation.n_sites):
        draw = partial(_draw_records, labels=data.labels, site=f"site{index}", path=path)
        records = np.flatnonzero(site_of_record == index)
        try:
            split = split_site(records, draw, federation, seed, index)
        except DataError as error:
            if options.site_column is None and federation.site_sizes != "equal":
                raise site_too_small(federation, f"site{index} gets {len(records)} of the {len(data)} records", error) from None
            raise
        evaluated[split.evaluation] = True
        set_aside[split.set_aside] = True
        in_validation[np.asarray(split.validation, dtype=np.int64)] = True  # (a bare () would index every record)
        set_aside_of_site.append(np.asarray(split.set_aside, dtype=np.int64).tolist())
    return evaluated, set_aside, in_validation, set_aside_of_site


def _site_data(data: Any, index: int, samples: Any, source_site: str, set_aside: list[int], holdout: str) -> SiteData:
    """Site ``index``'s splits of the records ``samples`` keeps, min/max-scaled on its own training records."""
    lo, hi = fit_minmax(data.features[samples.train])
    validation = [] if samples.validation is None else samples.validation.tolist()
    records = SiteSplit(holdout, samples.train.tolist(), samples.test.tolist(), set_aside, validation)
    info = {
        "source_site": source_site,
        **records.info("records"),
        **samples.info,
        "scaling": f"min/max per feature fitted on this site's {len(samples.train)} training records only",
    }
    return SiteData(
        name=f"site{index}",
        train=_dataset(data, samples.train, lo, hi),
        test=_dataset(data, samples.test, lo, hi),
        info=info,
        validation=None if samples.validation is None else _dataset(data, samples.validation, lo, hi),
    )


def build_site(
    options: Options, federation: FederationConfig, seed: int, site_index: int, data_root: Path, progress: bool = True
) -> Federation:
    """One site's member alone, from its own records (a deployed hospital, :mod:`medfed.deploy`).

    The site's CSV is ``data_root / <the file name of data.csv>``, read by the
    same reader; every record in it belongs to site ``site_index`` (no site
    column needed, ``data.embedded`` is not written). The rest is
    :func:`build_federation`'s for that site: the same stratified train/test
    (and validation) draw with the site's own seeds, the same per-site
    scaling. Given the records the simulator deals to site ``site_index``, in
    the file's order (:func:`site_records`), the member's tensors are the
    simulator's; ``info`` counts records in the site's own file.

    Returns:
        A federation of one site, named ``site<site_index>``.

    Raises:
        ConfigError: ``federation.label_ratio`` is set: its draw runs over
            every site's records at once, which no single site holds.
        DataError: the site's file (reader errors), or a class with fewer
            than 2 records.
    """
    del progress  # one small table: nothing to report
    refuse_label_ratio(federation)
    path = Path(data_root) / Path(options.csv).name
    data = read_tabular_csv(
        path,
        target=options.target,
        positive=options.positive,
        site_column=options.site_column,
        exclude_columns=tuple(options.exclude_columns),
    )
    draw = partial(_draw_records, labels=data.labels, site=f"site{site_index}", path=path)
    split = split_site(np.arange(len(data), dtype=np.int64), draw, federation, seed, site_index)
    train, test, validation = (np.sort(np.asarray(records, dtype=np.int64)) for records in (split.train, split.evaluation, split.validation))
    lo, hi = fit_minmax(data.features[train])
    info = {
        "source": "the site's own records",
        **split.info("records"),
        "scaling": f"min/max per feature fitted on this site's {len(train)} training records only",
    }
    site = SiteData(
        name=f"site{site_index}", train=_dataset(data, train, lo, hi), test=_dataset(data, test, lo, hi), info=info,
        validation=_dataset(data, validation, lo, hi) if len(validation) else None,
    )
    return Federation(
        task=NAME,
        sites=[site],
        input_shape=(len(data.feature_names),),
        num_classes=2,
        description=f"clinical records of site{site_index} ({len(data)} records, {len(data.feature_names)} features)",
        generated=False,
        holdout=federation.holdout,
        features={"names": list(data.feature_names), "categorical": {c: list(v) for c, v in data.categories.items()}},
    )


def site_records(options: Options, federation: FederationConfig, seed: int, out_dir: Path) -> list[Path]:
    """Write each site's records, as :func:`build_federation` deals them, to ``out_dir/site<i>/<csv name>``.

    A rehearsal of a deployment on one machine: each SuperNode's data root
    then holds only its own hospital's records (the header and the rows,
    cells unchanged, in the file's order), and :func:`build_site` builds the
    simulator's member from them.

    Returns:
        The written files, site order.
    """
    path = Path(options.csv)
    if options.embedded is not None:
        _write_embedded_table(path, options.embedded)
    data = read_tabular_csv(
        path, target=options.target, positive=options.positive, site_column=options.site_column,
        exclude_columns=tuple(options.exclude_columns),
    )
    site_of_record, _ = _sites(data, federation, seed, path, options.site_column)
    header, numbered_rows = read_csv_rows(path)  # the rows the reader keeps (blank lines skipped), one per record
    rows = [row for _, row in numbered_rows]
    written = []
    for index in range(federation.n_sites):
        target = Path(out_dir) / f"site{index}" / path.name
        target.parent.mkdir(parents=True, exist_ok=True)
        with target.open("w", newline="") as handle:
            writer = csv.writer(handle, lineterminator="\n")
            writer.writerow(header)
            writer.writerows(rows[record] for record in np.flatnonzero(site_of_record == index))
        written.append(target)
    return written


def _write_embedded_table(path: Path, name: str) -> None:
    """Write the embedded table ``name`` to ``path``; a different file already there is an error, never replaced."""
    if not path.is_file():
        write_breast_cancer_csv(path)
        return
    with tempfile.TemporaryDirectory() as scratch:
        if write_breast_cancer_csv(Path(scratch) / path.name).read_bytes() != path.read_bytes():
            raise DataError(
                f"{path}: exists and is not the embedded {name!r} table; set data.embedded=null to read it, "
                "or choose another data.csv"
            )


def _sites(
    data: TabularData, federation: FederationConfig, seed: int, path: Path, site_column: str | None
) -> tuple[np.ndarray, list[str | None]]:
    """int64 (n,) site index of every record, and each site's value in the site column (None without one).

    Without a site column, record r takes position ``permutation[r]`` of a
    seeded shuffle, dealt to sites by :func:`~medfed.data.federation.site_of_positions`.

    Raises:
        ConfigError: the site column has another number of values than ``federation.n_sites``,
            or ``federation.site_sizes`` is not ``equal`` with one; there are fewer records
            than sites, or too few for the site sizes.
        DataError: a site whose records are all one class.
    """
    n_sites = federation.n_sites
    if data.sites is None:
        if len(data) < n_sites:
            raise ConfigError(f"config key 'federation.n_sites' = {n_sites}: {path} has only {len(data)} records")
        position = np.random.default_rng(seed).permutation(len(data))
        return site_of_positions(len(data), federation, seed)[position], [None] * n_sites
    refuse_site_sizes(federation, f"data.site_column {site_column!r} places the records at sites")
    names, site_of_record = np.unique(data.sites, return_inverse=True)
    if len(names) != n_sites:
        raise ConfigError(
            f"config key 'federation.n_sites' = {n_sites}: site column {site_column!r} of {path} holds "
            f"{len(names)} sites {names.tolist()[:10]}; set them equal"
        )
    check_sites_have_both_classes(data.labels, data.sites, source=f"{path}, site column {site_column!r}")
    return site_of_record.astype(np.int64), names.tolist()


def _draw_records(
    records: Sequence[int], fraction: float, seed_of: Callable[[int], int], *, labels: np.ndarray, site: str, path: Path
) -> tuple[np.ndarray, np.ndarray]:
    """The clinical :data:`~medfed.data.federation.SplitDraw`: stratified by class, one generator for both classes.

    Draws round(fraction * k) of the site's k records of each class (>= 1, <= k - 1).

    Returns:
        ``(kept, drawn)``: sorted int64 record positions.

    Raises:
        DataError: fewer than 2 records of a class (one for each side).
    """
    records = np.sort(np.asarray(records, dtype=np.int64))
    rng = np.random.default_rng(seed_of(0))
    drawn = []
    for label in (0, 1):
        members = records[labels[records] == label]
        if len(members) < 2:
            raise DataError(
                f"{path}: {site} has {len(members)} {CLASS_NAMES[label]} record(s); "
                "its train/test split needs at least 2 of each class"
            )
        n_drawn = min(max(1, round(fraction * len(members))), len(members) - 1)
        drawn.append(rng.choice(members, size=n_drawn, replace=False))
    drawn = np.sort(np.concatenate(drawn))
    return np.setdiff1d(records, drawn), drawn


def _dataset(data: TabularData, records: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> TensorDataset:
    """``x`` float32 (n, f) scaled to [-1, 1] with the site's (lo, hi), ``y`` int64 (n,)."""
    x = torch.from_numpy(scale_to_unit_interval(data.features[records], lo, hi))
    y = torch.from_numpy(data.labels[records])
    return TensorDataset(x, y)
