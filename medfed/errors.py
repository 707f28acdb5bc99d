"""Exceptions raised for bad user input.

Every message names the offending file or configuration key and says what was
expected, so a user can fix the input without reading medfed's source.
Input that is legal but probably not what the user meant is reported with
:func:`warn`: one line on stderr (``medfed: warning: ...``) through the
``medfed`` logger, which the command line configures.
"""

import logging

INTERRUPTED = 130
"""The exit status of a command ended by Ctrl-C (the shell's status for a process ended by SIGINT)."""


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


class MessageError(ValueError):
    """A message received over a link is malformed or refused: its bytes, shape, size, values or fields.

    Raised by every decoder of what crosses the site boundary (the codecs,
    :class:`~medfed.federated.link.Link`, the deployment's records) for any
    input they cannot vouch for, before they allocate for it. The message
    names the sender and the payload key where they are known
    (:meth:`about` adds them on the way up). A ``ValueError``, so a site's
    reply that raises it fails that site like any other bad reply.
    """

    def __init__(self, reason: str, sender: str | None = None, key: str | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.sender = sender
        self.key = key

    def about(self, sender: str | None = None, key: str | None = None) -> "MessageError":
        """This error with the sender and key filled in where not yet known (returns itself)."""
        self.sender = self.sender if self.sender is not None else sender
        self.key = self.key if self.key is not None else key
        return self

    def __str__(self) -> str:
        where = ", ".join(part for part in (
            None if self.sender is None else f"from {self.sender}", None if self.key is None else f"payload {self.key!r}"
        ) if part)
        return f"message {where}: {self.reason}" if where else self.reason


class RunFailed(SiteFailure):
    """The run ended without learning: every site failed in every round, or every site was excluded. Its results are
    written; resuming would fail the same way, so the cause must be fixed (the message says which failures)."""
