"""Clinical tabular data: a CSV of patient records -> features, binary labels and sites.

pFedNet (section VI-A) predicts a clinical event with logistic regression on
tabular records, "first fill all missing values by using zeros, and normalize
values between -1 and 1". This module does those two steps:

* :func:`read_tabular_csv` reads any CSV with a header row: one target column
  (the event; exactly two classes), optionally a site column (the hospital of
  each record), every other column a numeric feature. Missing cells (empty,
  ``NA``, ``N/A``, ``NaN``, ``null``; any case) become 0 on the raw scale, as in
  the paper, and are counted per feature.
* :func:`fit_minmax` / :func:`scale_to_unit_interval` map features to [-1, 1].
  The caller fits the range per site on that site's training rows only and
  applies it to that site's own rows, so no site's values reach another site.

The paper's CHD, Diabetes and Covid19 tables are private. The embedded default,
:func:`write_breast_cancer_csv`, writes the Wisconsin diagnostic breast-cancer
table that ships inside scikit-learn (569 records, 30 features, 212 malignant)
as an ordinary CSV, so it goes through the same reader as user data.
"""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from medfed.atomic import atomic_write
from medfed.errors import DataError

MISSING_TOKENS = frozenset({"", "na", "n/a", "nan", "null"})  # compared after strip() and lower()
BREAST_CANCER_TARGET = "diagnosis"
BREAST_CANCER_POSITIVE = "malignant"


@dataclass(frozen=True)
class TabularData:
    """Records of a tabular data set.

    Attributes:
        features: float32 (n, f), raw scale, missing values already 0.
        labels: int64 (n,), 1 = positive (the event), 0 = negative.
        sites: str (n,), the site column of each record, or None when not read.
        feature_names: the f feature column names, in file order.
        missing_per_feature: int64 (f,), missing cells filled with 0 per feature.
    """

    features: np.ndarray
    labels: np.ndarray
    sites: np.ndarray | None
    feature_names: tuple[str, ...]
    missing_per_feature: np.ndarray

    @property
    def n_missing(self) -> int:
        """Total missing cells filled with 0."""
        return int(self.missing_per_feature.sum())

    def __len__(self) -> int:
        return len(self.labels)


def read_tabular_csv(
    path: str | Path,
    *,
    target: str,
    positive: str | int,
    site_column: str | None = None,
    exclude_columns: tuple[str, ...] = (),
) -> TabularData:
    """Read a CSV of records with a binary target.

    Args:
        path: CSV file with a header row.
        target: name of the label column.
        positive: the target value that means the event (label 1), compared as
            text with the cell (``positive=1`` matches cells ``1``); the column
            must hold exactly one other value (label 0).
        site_column: name of the column giving each record's site, if any.
        exclude_columns: columns that are neither features nor read (e.g. a patient id).

    Returns:
        Features in file column order (all columns but target, site and excluded).

    Raises:
        DataError: naming the file and column, for a missing file, a duplicate
            or missing column, a row with another number of fields, a
            non-numeric feature value (with a sample), a missing target or site
            value, or a target that is not the positive value plus exactly one other class.
    """
    path = Path(path)
    header, cells, line_numbers = _read_cells(path)
    wanted = [target] + ([site_column] if site_column is not None else []) + list(exclude_columns)
    for name in wanted:
        if name not in header:
            raise DataError(f"{path}: column {name!r} not found; the columns are {', '.join(header)}")
    feature_columns = [i for i, name in enumerate(header) if name not in wanted]
    if not feature_columns:
        raise DataError(f"{path}: no feature columns besides {', '.join(wanted)}")

    features, missing_per_feature = _numeric_features(path, header, cells, line_numbers, feature_columns)
    labels = _binary_labels(path, target, cells[:, header.index(target)], line_numbers, str(positive).strip())
    sites = None
    if site_column is not None:
        sites = cells[:, header.index(site_column)]
        _require_no_missing(path, site_column, sites, line_numbers)
    return TabularData(
        features=features,
        labels=labels,
        sites=sites,
        feature_names=tuple(header[i] for i in feature_columns),
        missing_per_feature=missing_per_feature,
    )


def check_sites_have_both_classes(labels: np.ndarray, sites: np.ndarray, *, source: str = "data") -> None:
    """Raise DataError naming every site whose records are all one class.

    Args:
        labels: int (n,) 0/1 labels.
        sites: (n,) site of each record.
        source: what the records are (e.g. the file name), for the message.
    """
    labels, sites = np.asarray(labels), np.asarray(sites)
    problems = []
    for site in np.unique(sites):
        site_labels = labels[sites == site]
        n_pos = int((site_labels == 1).sum())
        if n_pos in (0, len(site_labels)):
            problems.append(f"{site!s}: {n_pos} positive, {len(site_labels) - n_pos} negative")
    if problems:
        raise DataError(f"{source}: every site needs both classes; single-class sites: {'; '.join(problems)}")


def fit_minmax(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-feature minimum and maximum of (n, f) finite values: two float64 (f,) arrays."""
    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 2 or x.shape[0] == 0:
        raise ValueError(f"fit_minmax needs an (n, f) array with n >= 1, got shape {x.shape}")
    if not np.isfinite(x).all():
        raise ValueError("fit_minmax needs finite values (fill missing values first)")
    return x.min(axis=0), x.max(axis=0)


def scale_to_unit_interval(x: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """float32 (n, f): 2 (x - lo) / (hi - lo) - 1, clipped to [-1, 1]; features with hi == lo become 0.

    Values outside [lo, hi] (test rows beyond the training range) are clipped.
    """
    x = np.asarray(x, dtype=np.float64)
    lo, hi = np.asarray(lo, dtype=np.float64), np.asarray(hi, dtype=np.float64)
    if x.ndim != 2 or lo.shape != (x.shape[1],) or hi.shape != lo.shape:
        raise ValueError(f"expected x (n, f) with lo and hi (f,), got {x.shape}, {lo.shape}, {hi.shape}")
    if np.any(hi < lo):
        raise ValueError("every hi must be >= its lo")
    width = hi - lo
    constant = width == 0
    scaled = 2.0 * (x - lo) / np.where(constant, 1.0, width) - 1.0
    return np.where(constant, 0.0, np.clip(scaled, -1.0, 1.0)).astype(np.float32)


def write_breast_cancer_csv(path: str | Path) -> Path:
    """Write scikit-learn's Wisconsin diagnostic breast-cancer table as a CSV (no network).

    Columns: ``diagnosis`` (``malignant`` / ``benign``) then the 30 features
    under scikit-learn's names. Read it with
    ``read_tabular_csv(path, target=BREAST_CANCER_TARGET, positive=BREAST_CANCER_POSITIVE)``.
    An existing file with the same content is left untouched; otherwise the
    file is written to a temporary name and renamed into place.
    """
    from sklearn.datasets import load_breast_cancer

    path = Path(path)
    data = load_breast_cancer()
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow([BREAST_CANCER_TARGET, *data.feature_names])
    for label, row in zip(data.target, data.data):
        writer.writerow([data.target_names[label], *(repr(float(value)) for value in row)])
    content = buffer.getvalue()
    if path.is_file() and path.read_text() == content:
        return path
    with atomic_write(path) as file:
        file.write(content)
    return path


def _read_cells(path: Path) -> tuple[list[str], np.ndarray, np.ndarray]:
    """The header, a str (n, columns) array of stripped cells, and each record's int (n,) line number."""
    if not path.is_file():
        raise DataError(f"{path}: file not found")
    with path.open(newline="") as handle:
        reader = csv.reader(handle)
        header = [name.strip() for name in next(reader, [])]
        numbered_rows = [(reader.line_num, row) for row in reader if "".join(row).strip()]
    if not header:
        raise DataError(f"{path}: empty file, expected a header row")
    duplicates = sorted({name for name in header if header.count(name) > 1})
    if duplicates:
        raise DataError(f"{path}: duplicate column names {duplicates}")
    if not numbered_rows:
        raise DataError(f"{path}: no records after the header")
    for line_number, row in numbered_rows:
        if len(row) != len(header):
            raise DataError(f"{path}, line {line_number}: expected {len(header)} fields, found {len(row)}")
    cells = np.array([[cell.strip() for cell in row] for _, row in numbered_rows], dtype=str)
    return header, cells, np.array([line_number for line_number, _ in numbered_rows])


def _is_missing(cells: np.ndarray) -> np.ndarray:
    return np.isin(np.char.lower(cells), list(MISSING_TOKENS))


def _numeric_features(
    path: Path, header: list[str], cells: np.ndarray, line_numbers: np.ndarray, columns: list[int]
) -> tuple[np.ndarray, np.ndarray]:
    """float32 (n, f) features with missing cells 0, and int64 (f,) missing counts."""
    text = cells[:, columns]
    missing = _is_missing(text)
    text = np.where(missing, "0", text)
    for k, column in enumerate(columns):
        try:
            values = text[:, k].astype(np.float64)
            bad = np.flatnonzero(~np.isfinite(values))
        except ValueError:
            bad = np.flatnonzero([not _is_number(cell) for cell in text[:, k]])
        if bad.size:
            raise DataError(
                f"{path}: column {header[column]!r} must be numeric, found {str(text[bad[0], k])!r} "
                f"on line {line_numbers[bad[0]]} ({bad.size} non-numeric value(s))"
            )
    return text.astype(np.float32), missing.sum(axis=0).astype(np.int64)


def _is_number(cell: str) -> bool:
    try:
        return bool(np.isfinite(float(cell)))
    except ValueError:
        return False


def _binary_labels(path: Path, target: str, values: np.ndarray, line_numbers: np.ndarray, positive: str) -> np.ndarray:
    """int64 (n,) 1 where the target equals ``positive``; DataError unless there is exactly one other class."""
    _require_no_missing(path, target, values, line_numbers)
    classes = sorted(set(values.tolist()))
    others = [value for value in classes if value != positive]
    if positive not in classes or len(others) != 1:
        raise DataError(
            f"{path}: column {target!r} must hold the positive value {positive!r} and exactly one other "
            f"class, found {classes[:10]}{' ...' if len(classes) > 10 else ''}"
        )
    return (values == positive).astype(np.int64)


def _require_no_missing(path: Path, column: str, values: np.ndarray, line_numbers: np.ndarray) -> None:
    missing = np.flatnonzero(_is_missing(values))
    if missing.size:
        raise DataError(
            f"{path}: column {column!r} has {missing.size} missing value(s), first on line {line_numbers[missing[0]]}"
        )
