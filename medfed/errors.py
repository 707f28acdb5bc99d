"""Exceptions raised for bad user input.

Every message names the offending file or configuration key and says what was
expected, so a user can fix the input without reading medfed's source.
Input that is legal but probably not what the user meant is reported with
:func:`warn`: one line on stderr (``medfed: warning: ...``) through the
``medfed`` logger, which the command line configures.
"""

import logging


class DataError(ValueError):
    """A data file or data set is missing, unreadable, or not what was expected."""


class ConfigError(ValueError):
    """A configuration key is unknown, missing, or has an impossible value."""


def warn(message: str) -> None:
    """Report legal but suspicious input as one line, e.g. a label ratio that drops most of a site's records."""
    logging.getLogger("medfed").warning(message)


class SiteFailure(RuntimeError):
    """A site failed in a round under ``federation.on_site_failure: stop``, every site has been excluded, or a
    deployed site cannot go back to the round its resumed server continues from."""


class RunFailed(SiteFailure):
    """The run ended without learning: every site failed in every round, or every site was excluded. Its results are
    written; resuming would fail the same way, so the cause must be fixed (the message says which failures)."""
