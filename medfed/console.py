"""How medfed's commands speak on a terminal: ``medfed: warning: ...`` and ``medfed: error: ...`` lines.

:func:`show_warnings` sends the ``medfed`` logger's records (:func:`medfed.errors.warn`)
to stderr as one line each; :func:`one_line_errors` runs a command and turns bad
input (:class:`~medfed.errors.ConfigError`, :class:`~medfed.errors.DataError`) into
one line and exit status 2. The command line and each run ``compare`` starts use both.
Every such line is :func:`one_line`: a line feed or other control character in
a message (a folder named with a newline) is written escaped (``\\n``), so the
line stays one line.
"""

from __future__ import annotations

import logging
import re
import sys
from collections.abc import Callable

from medfed.errors import ConfigError, DataError

BAD_INPUT = 2
"""The exit status of a command refused for bad input (a config key or a data file)."""
_CONTROL = re.compile("[\x00-\x1f\x7f]")


def one_line(text: object) -> str:
    """``text`` with every control character (line feed, carriage return, NUL, ...) escaped as Python writes it (``\\n``)."""
    return _CONTROL.sub(lambda match: repr(match.group())[1:-1], str(text))


def error_line(message: object) -> str:
    """``medfed: error: <message>`` on one line (:func:`one_line`)."""
    return f"medfed: error: {one_line(message)}"


def show_warnings(quiet: bool = False) -> None:
    """Send the ``medfed`` logger's records to stderr as ``medfed: warning: ...`` (``info``, ...) lines; ``quiet``: warnings only."""
    logger = logging.getLogger("medfed")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(_OneLineFormatter())
        logger.addHandler(handler)
    logger.setLevel(logging.WARNING if quiet else logging.INFO)


def one_line_errors(command: Callable[[], int]) -> int:
    """``command()``'s exit status; bad input is one line ``medfed: error: ...`` on stderr and :data:`BAD_INPUT`."""
    try:
        return command()
    except (ConfigError, DataError) as error:
        print(error_line(error), file=sys.stderr)
        return BAD_INPUT


class _OneLineFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return f"medfed: {record.levelname.lower()}: {one_line(record.getMessage())}"
