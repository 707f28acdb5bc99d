"""Clinical tabular data: a CSV of patient records -> features, binary labels and sites.

pFedNet (section VI-A) predicts a clinical event with logistic regression on
tabular records, "first fill all missing values by using zeros, and normalize
values between -1 and 1". This module does those two steps:

* :func:`read_tabular_csv` reads any CSV with a header row: one target column
  (the event; exactly two classes), optionally a site column (the hospital of
  each record), every other column a feature. Missing cells (empty, ``NA``,
  ``N/A``, ``NaN``, ``null``; any case) become 0 on the raw scale, as in the
  paper, and are counted per column.
* A feature column is **numeric** when every non-missing cell is a finite
  number, **categorical** when none is (``gender`` = ``female`` / ``male``);
  a column mixing numbers and text is an error, as it is usually a typo. A
  categorical column with levels l_1 < ... < l_K becomes K indicator features
  named ``column=level``: x_k = 1 if the cell is l_k, else 0, so a missing cell
  is all zeros (one-hot encoding). The levels are the sorted distinct
  non-missing values of the column *in the whole file*: like the column names,
  they are the schema every site agrees on before training, so every site's
  model has the same inputs in the same order (a level seen only elsewhere is
  an all-zero input here). They tell which values occur, never how often or
  at which site. A column with more than :data:`MAX_LEVELS` levels, or a
  different value in every record (an identifier, free text), is refused:
  exclude it instead.
* :func:`fit_minmax` / :func:`scale_to_unit_interval` map features to [-1, 1]
  (indicators: 0 -> -1, 1 -> 1). The caller fits the range per site on that
  site's training rows only and applies it to that site's own rows, so no
  site's values reach another site.

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
from medfed.data.csv_rows import read_csv_rows
from medfed.errors import DataError
from medfed.options.tasks import BREAST_CANCER_TARGET

MISSING_TOKENS = frozenset({"", "na", "n/a", "nan", "null"})  # compared after strip() and lower()
MAX_LEVELS = 50  # most levels a categorical feature column may have
# what YAML 1.1 reads as a boolean when unquoted (after lower()), for the hint of a boolean positive value
YAML_BOOLEANS = {True: frozenset({"y", "yes", "true", "on"}), False: frozenset({"n", "no", "false", "off"})}


@dataclass(frozen=True)
class TabularData:
    """Records of a tabular data set.

    Attributes:
        features: float32 (n, f), raw scale, missing values already 0
            (numeric) or all-zero indicators (categorical).
        labels: int64 (n,), 1 = positive (the event), 0 = negative.
        sites: str (n,), the site column of each record, or None when not read.
        feature_names: the f feature names in file column order: a numeric
            column's name, or ``column=level`` for each level of a categorical one.
        categories: ``{column: levels}`` of the categorical columns, in file
            order, each column's levels sorted.
        missing_per_column: ``{column: missing cells}`` of every feature column, in file order.
    """

    features: np.ndarray
    labels: np.ndarray
    sites: np.ndarray | None
    feature_names: tuple[str, ...]
    categories: dict[str, tuple[str, ...]]
    missing_per_column: dict[str, int]

    @property
    def n_missing(self) -> int:
        """Total missing feature cells (filled with 0)."""
        return sum(self.missing_per_column.values())

    def __len__(self) -> int:
        return len(self.labels)


def read_tabular_csv(
    path: str | Path,
    *,
    target: str,
    positive: str | int | bool,
    site_column: str | None = None,
    exclude_columns: tuple[str, ...] = (),
) -> TabularData:
    """Read a CSV of records with a binary target.

    Args:
        path: CSV file with a header row.
        target: name of the label column.
        positive: the target value that means the event (label 1), compared as
            text with the cell (``positive=1`` matches cells ``1``, ``True``
            matches ``True``); the column must hold exactly one other value
            (label 0). A bool that matches no cell gets a hint: it came from an
            unquoted YAML ``yes`` / ``no`` / ``on`` / ``off``, to be quoted.
        site_column: name of the column giving each record's site, if any.
        exclude_columns: columns that are neither features nor read (e.g. a patient id).

    Returns:
        Features in file column order (all columns but target, site and
        excluded), categorical columns one-hot encoded.

    Raises:
        DataError: naming the file and column, for a missing file, a duplicate
            or missing column, a row with another number of fields, a column
            mixing numbers and text (with a sample), a categorical column with
            too many levels, a missing target or site value, or a target that
            is not the positive value plus exactly one other class.
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

    blocks = [_feature_block(path, header[i], cells[:, i], line_numbers) for i in feature_columns]
    labels = _binary_labels(path, target, cells[:, header.index(target)], line_numbers, positive)
    sites = None
    if site_column is not None:
        sites = cells[:, header.index(site_column)]
        _require_no_missing(path, site_column, sites, line_numbers)
    return TabularData(
        features=np.concatenate([block.values for block in blocks], axis=1),
        labels=labels,
        sites=sites,
        feature_names=tuple(name for block in blocks for name in block.names),
        categories={block.column: block.levels for block in blocks if block.levels is not None},
        missing_per_column={block.column: block.n_missing for block in blocks},
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
    first, numbered_rows = read_csv_rows(path)
    header = [name.strip() for name in first or []]
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


FLOAT32_MAX = float(np.finfo(np.float32).max)
"""Largest magnitude a feature may have: features are float32 tensors (3.4e38)."""


def _is_missing(cells: np.ndarray) -> np.ndarray:
    return np.isin(np.char.lower(cells), list(MISSING_TOKENS))


@dataclass(frozen=True)
class _FeatureBlock:
    """The features one column becomes.

    Attributes:
        column: the column's name.
        values: float32 (n, k): the numeric column (k = 1) or its k level indicators.
        names: the k feature names.
        levels: the categorical column's sorted levels, None for a numeric column.
        n_missing: missing cells of the column.
    """

    column: str
    values: np.ndarray
    names: tuple[str, ...]
    levels: tuple[str, ...] | None
    n_missing: int


def _feature_block(path: Path, column: str, cells: np.ndarray, line_numbers: np.ndarray) -> _FeatureBlock:
    """Encode one feature column: numeric (missing -> 0) or categorical (one-hot, missing -> all zeros)."""
    missing = _is_missing(cells)
    present = np.flatnonzero(~missing)
    try:
        is_number = np.isfinite(np.where(missing, "0", cells).astype(np.float64))[present]
    except ValueError:
        is_number = np.array([_is_number(cell) for cell in cells[present]], dtype=bool)
    if is_number.all():
        numbers = np.where(missing, "0", cells).astype(np.float64)
        too_large = np.flatnonzero(np.abs(numbers) > FLOAT32_MAX)
        if too_large.size:
            raise DataError(
                f"{path}: column {column!r} holds {str(cells[too_large[0]])!r} on line {line_numbers[too_large[0]]}, beyond "
                f"float32's range (|x| <= {FLOAT32_MAX:.4g}); {too_large.size} value(s) so large: check the column's units"
            )
        values = numbers.astype(np.float32)[:, None]
        return _FeatureBlock(column, values, (column,), None, int(missing.sum()))
    if is_number.any():
        odd_ones_are_text = (~is_number).sum() <= is_number.sum()
        odd = present[~is_number if odd_ones_are_text else is_number]
        raise DataError(
            f"{path}: column {column!r} mixes numbers and text: {len(odd)} of {len(present)} values are "
            f"{'not finite numbers' if odd_ones_are_text else 'numbers among text'}, first {str(cells[odd[0]])!r} "
            f"on line {line_numbers[odd[0]]}; a feature column must be all numbers or all text (categorical)"
        )
    levels, codes = np.unique(cells[present], return_inverse=True)
    infinite = next((str(level) for level in levels if _is_float(str(level))), None)  # text only: every such level is inf or nan
    if infinite is not None:
        first = present[np.flatnonzero(cells[present] == infinite)[0]]
        raise DataError(
            f"{path}: column {column!r} holds {infinite!r} on line {line_numbers[first]}, a number that is not finite "
            f"(a missing value is empty or one of {', '.join(sorted(token for token in MISSING_TOKENS if token))}); "
            "a feature column must be all finite numbers or all text (categorical)"
        )
    one_per_record = len(levels) == len(present) > 1
    if len(levels) > MAX_LEVELS or one_per_record:
        raise DataError(
            f"{path}: column {column!r} is text with {len(levels)} distinct values"
            f"{' (a different one in every record)' if one_per_record else ''}, too many for a categorical "
            f"feature (at most {MAX_LEVELS}, each shared by records); list it in data.exclude_columns "
            "if it is an identifier or free text"
        )
    values = np.zeros((len(cells), len(levels)), dtype=np.float32)
    values[present, codes] = 1.0
    levels = tuple(str(level) for level in levels)
    return _FeatureBlock(column, values, tuple(f"{column}={level}" for level in levels), levels, int(missing.sum()))


def _is_number(cell: str) -> bool:
    return _is_float(cell) and bool(np.isfinite(float(cell)))


def _is_float(cell: str) -> bool:
    """Whether ``cell`` reads as a float, finite or not (``inf``, ``-Infinity``, ``nan``)."""
    try:
        float(cell)
    except ValueError:
        return False
    return True


def _binary_labels(
    path: Path, target: str, values: np.ndarray, line_numbers: np.ndarray, positive: str | int | bool
) -> np.ndarray:
    """int64 (n,) 1 where the target equals ``positive`` as text; DataError unless there is exactly one other class."""
    _require_no_missing(path, target, values, line_numbers)
    text = str(positive).strip()
    classes = sorted(set(values.tolist()))
    others = [value for value in classes if value != text]
    if text not in classes or len(others) != 1:
        raise DataError(
            f"{path}: column {target!r} must hold the positive value {text!r} and exactly one other "
            f"class, found {classes[:10]}{' ...' if len(classes) > 10 else ''}{_boolean_hint(positive, classes)}"
        )
    return (values == text).astype(np.int64)


def _boolean_hint(positive: str | int | bool, classes: list[str]) -> str:
    """For a bool positive value: the config read an unquoted YAML boolean; say which value to quote."""
    if not isinstance(positive, bool):
        return ""
    spelled = [value for value in classes if value.lower() in YAML_BOOLEANS[positive]]
    example = spelled[0] if len(spelled) == 1 else ("yes" if positive else "no")
    return (
        f"; the config read the positive value as the boolean {positive} (YAML reads an unquoted true/false, "
        f"and YAML 1.1 also yes/no/on/off, as booleans): quote it, e.g. data.positive: \"{example}\""
    )


def _require_no_missing(path: Path, column: str, values: np.ndarray, line_numbers: np.ndarray) -> None:
    missing = np.flatnonzero(_is_missing(values))
    if missing.size:
        raise DataError(
            f"{path}: column {column!r} has {missing.size} missing value(s), first on line {line_numbers[missing[0]]}"
        )
