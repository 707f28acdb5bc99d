"""CSV files as the readers of medfed take them: UTF-8 text, with or without a byte-order mark, one line per error.

Hospitals' tables come from Excel ("CSV UTF-8" starts with a byte-order mark,
plain "CSV" is the machine's code page), database exports and scripts.
:func:`read_csv_rows` decodes a file as UTF-8, dropping a leading BOM (which
would otherwise become an invisible first character of the first column's
name), and turns what the :mod:`csv` module or the decoder would raise into
one :class:`~medfed.errors.DataError` naming the file and line: bytes that are
not UTF-8 (Latin-1 or Windows-1252 exports), control characters such as
NUL (:data:`CONTROL_CHARACTERS`: a damaged or binary file, whose bytes would
otherwise become a category) and fields longer than :data:`MAX_FIELD_CHARS`
(a broken quote swallowing the rest of the file).
"""

from __future__ import annotations

import csv
import io
import re
from pathlib import Path

from medfed.errors import DataError

CONTROL_CHARACTERS = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")
"""Characters no table's text holds (C0 controls but tab, line feed and carriage return; DEL): a damaged or binary file."""
MAX_FIELD_CHARS = 131_072
"""Longest field read (the :mod:`csv` module's default limit; no cell of a clinical table or LUNA16 CSV comes near it)."""


def read_csv_rows(path: Path) -> tuple[list[str] | None, list[tuple[int, list[str]]]]:
    """The first row of ``path`` (None for an empty file) and every later non-blank row with its line number (1-based).

    Raises:
        DataError: the file is missing or unreadable, not UTF-8 text (the
            message names the line and the first offending byte), or has a
            field longer than :data:`MAX_FIELD_CHARS` or another CSV syntax
            error (the message names the line).
    """
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise DataError(f"{path}: file not found") from None
    except OSError as error:
        raise DataError(f"{path}: cannot be read ({error.strerror})") from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        line = raw[: error.start].count(b"\n") + 1
        raise DataError(
            f"{path}, line {line}: not UTF-8 text (byte 0x{raw[error.start]:02x} at offset {error.start}, e.g. a Latin-1 or "
            "Windows-1252 export); save the file as UTF-8 (in Excel: CSV UTF-8)"
        ) from None
    control = CONTROL_CHARACTERS.search(text)
    if control is not None:
        line = text.count("\n", 0, control.start()) + 1
        raise DataError(
            f"{path}, line {line}: holds the control character U+{ord(control.group()):04X} at offset {control.start()} "
            "(a NUL or other control byte: a damaged or binary file, not a table's text)"
        )
    reader = csv.reader(io.StringIO(text, newline=""))
    try:
        header = next(reader, None)
        rows = [(reader.line_num, row) for row in reader if "".join(row).strip()]
    except csv.Error as error:
        raise DataError(f"{path}, line {reader.line_num + 1}: not a readable CSV row ({error})") from None
    return header, rows
