"""Site membership files in the FeTS challenge format.

The FeTS 2021/2022 challenges distribute the institution of each BraTS case as
a CSV with the header ``Partition_ID,Subject_ID`` (``partitioning_1.csv``).
medfed reads the same format to place subjects (BraTS cases, LUNA16 series,
...) at sites, and its data generators write it next to the data they make.
"""

from __future__ import annotations

import csv
from pathlib import Path

from medfed.data.csv_rows import read_csv_rows
from medfed.errors import DataError

HEADER = ("Partition_ID", "Subject_ID")


def find_partition_csv(path: str | Path | None, root: Path) -> Path | None:
    """The partition file a task uses: ``path`` when given, else ``root/partitioning.csv`` if present, else None.

    Raises:
        DataError: ``path`` was given and is not a file.
    """
    if path is None:
        default = root / "partitioning.csv"
        return default if default.is_file() else None
    if not Path(path).is_file():
        raise DataError(f"{path}: partition file not found")
    return Path(path)


def read_partition_csv(path: str | Path) -> dict[str, int]:
    """Map each subject id to its partition (site) id.

    Args:
        path: CSV file with the header ``Partition_ID,Subject_ID``.

    Returns:
        ``{subject_id: partition_id}``; partition ids are the integers in the
        file, unchanged.

    Raises:
        DataError: the file is missing, has another header, a non-integer
            partition id, or lists a subject twice.
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: partition file not found")
    header, rows = read_csv_rows(path)
    if header is None or tuple(h.strip() for h in header[:2]) != HEADER:
        raise DataError(f"{path}: expected the header {','.join(HEADER)}, found {header}")
    mapping: dict[str, int] = {}
    for line_no, row in rows:
        if len(row) < 2:
            raise DataError(f"{path}, line {line_no}: expected 'Partition_ID,Subject_ID', found {row}")
        partition, subject = row[0].strip(), row[1].strip()
        try:
            partition_id = int(partition)
        except ValueError:
            raise DataError(f"{path}, line {line_no}: Partition_ID must be an integer, found {partition!r}") from None
        if subject in mapping:
            raise DataError(f"{path}, line {line_no}: subject {subject!r} is listed twice")
        mapping[subject] = partition_id
    if not mapping:
        raise DataError(f"{path}: no subjects listed")
    return mapping


def write_partition_csv(path: str | Path, mapping: dict[str, int]) -> None:
    """Write ``{subject_id: partition_id}`` in the FeTS format, sorted by partition then subject."""
    path = Path(path)
    rows = sorted(mapping.items(), key=lambda item: (item[1], item[0]))
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(HEADER)
        for subject, partition in rows:
            writer.writerow([partition, subject])
