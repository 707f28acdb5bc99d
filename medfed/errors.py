"""Exceptions raised for bad user input.

Every message names the offending file or configuration key and says what was
expected, so a user can fix the input without reading medfed's source.
"""


class DataError(ValueError):
    """A data file or data set is missing, unreadable, or not what was expected."""


class ConfigError(ValueError):
    """A configuration key is unknown, missing, or has an impossible value."""
