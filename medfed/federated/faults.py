"""What the loop does about a failing site: the checks on a reply, and the state it puts back.

A participant *fails* in a phase of a round when

1. its part of the phase raises (receiving the server's message, local
   training, e.g. a loss that became NaN, or making its reply);
2. its reply holds a NaN or an infinity (any entry, sample counts included);
3. its reply is an *update outlier*: for some model-vector key its update
   norm exceeds ``update_norm_limit`` times the median of that key's update
   norms over the phase's replies (the failing one included; a median of 0
   flags nothing). With two replies the median is their mean, which no norm
   exceeds twice: the check needs three or more participants to single one out.

The *update* of a reply entry carrying a model vector (a ``coded_keys``
entry) is the entry minus the same part of the site's model as it stood
after receiving the phase's message, i.e. what it trained from (FedAvg: the
model it was sent; FedAMP: its cloud model; APPLE's "core/i": its own core
model; pFedNet: the part it trains this phase). An entry declared against
zeros (PGFed's "gradient") has no such model: its update is the entry itself.
:func:`update_norms` measures it; the site's starting vectors are copied for
the site in progress only, so the check keeps nothing per site.

Checks 2 and 3 run on the reply before it is encoded, so a refused reply
never crosses the link: neither end's link state changes, exactly as for a
site that did not reply. The server's message of the phase did reach the
site (its bytes count; a lossy codec's known value K holds it at both
ends), as a message reaches a site that then skips its reply: the link
stays consistent. The server aggregates the phase without the site, and the
site takes no further part in the round (``federation.on_site_failure:
drop``); it is then put back to its state at the start of the round (module,
optimiser, data order, strategy state) and receives the round's delivery like
a site that did not take part. ``stop`` raises :class:`~medfed.errors.SiteFailure`
instead, before the round is checkpointed.

*Where the start-of-round state is kept.* Holding every participant's
module and optimiser state in memory until its round ends would double the
memory each site costs (Adam: three model-sized vectors per site, on top of
the three the site holds). :class:`RoundStartStates` writes them to disk
instead, one participant at a time as the round starts (``torch.save``
streams tensor by tensor, no copy in memory), and reads back only the state
of a site that fails. That is one extra write of each participant's share of
the checkpoint per round; the run's own checkpoint would hold the same
states, but not before round 1, and a loop need not have one.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from medfed.federated.link import ZEROS, coded_prefix
from medfed.federated.strategies.base import Payload

if TYPE_CHECKING:
    from medfed.federated.site import Site


def non_finite_keys(payload: Payload) -> list[str]:
    """The keys of ``payload`` whose tensor holds a NaN or an infinity."""
    return [key for key, value in payload.items() if not bool(torch.isfinite(value).all())]


def model_parts(coded_keys: dict[str, str]) -> set[str]:
    """The parts of the model (``"all"``, ``"shared"`` ...) that coded payload entries carry."""
    return {name for name in coded_keys.values() if name != ZEROS}


def update_norms(reply: Payload, start: dict[str, torch.Tensor], coded_keys: dict[str, str]) -> dict[str, float]:
    """The norm of each model-vector entry's update, by ``coded_keys`` prefix (APPLE's "core/i" under "core").

    Args:
        reply: the site's reply.
        start: ``{part: vector}``, the site's model parts when it started to train (:func:`model_parts`).
        coded_keys: the strategy's ``coded_keys``.

    Returns:
        ``{prefix: ||entry - start[part]||_2}`` (``||entry||`` for a key
        declared against zeros); other and empty entries are not measured.
    """
    norms = {}
    for key, value in reply.items():
        prefix = coded_prefix(key, coded_keys)
        if prefix is None or value.numel() == 0:
            continue
        part = coded_keys[prefix]
        update = value if part == ZEROS else value - start[part].to(value)
        norms[prefix] = float(torch.linalg.vector_norm(update.reshape(-1), dtype=torch.float64))
    return norms


def update_outliers(norms: dict[int, dict[str, float]], limit: float) -> dict[int, str]:
    """The replies whose update norm on some key exceeds ``limit`` times that key's median.

    Args:
        norms: ``{site index: {key prefix: update norm}}`` of one phase's replies.
        limit: the factor c of ``federation.update_norm_limit``.

    Returns:
        ``{site index: reason}`` for each outlier (its first outlying key).
    """
    reasons: dict[int, str] = {}
    for prefix in sorted({prefix for site_norms in norms.values() for prefix in site_norms}):
        values = {index: site_norms[prefix] for index, site_norms in norms.items() if prefix in site_norms}
        median = float(np.median(list(values.values())))
        for index, value in values.items():
            if median > 0 and value > limit * median and index not in reasons:
                reasons[index] = (
                    f"update norm {value:.3g} of {prefix!r} is over {limit:g} x the median {median:.3g} of {len(values)} replies"
                )
    return reasons


class RoundStartStates:
    """The state of each participant at the start of the round, on disk, to put a failing site back.

    Args:
        directory: where the files go (a temporary folder is made inside;
            ``None``: the system's temporary directory).
    """

    def __init__(self, directory: Path | None) -> None:
        if directory is not None:
            Path(directory).mkdir(parents=True, exist_ok=True)
        self.directory = Path(tempfile.mkdtemp(prefix=".round-start-", dir=directory))

    def save(self, site: Site) -> None:
        """Write the site's state now (before its first phase of the round)."""
        torch.save(site.state_dict(), self._path(site))

    def restore(self, site: Site) -> None:
        """Put the site back to the state :meth:`save` wrote."""
        site.load_state_dict(torch.load(self._path(site), map_location=site.fabric.device, weights_only=True))

    def close(self) -> None:
        """Delete the files."""
        shutil.rmtree(self.directory, ignore_errors=True)

    def _path(self, site: Site) -> Path:
        return self.directory / f"site{site.index}.pt"
