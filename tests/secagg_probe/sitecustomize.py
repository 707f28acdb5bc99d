"""A probe on what a strategy's server half receives, for tests/test_deploy_secagg.py (a test tool, never in a run).

Python imports ``sitecustomize`` at start-up from the first folder on its
path that holds one; tests/test_deploy_secagg.py puts this folder first on
the ``PYTHONPATH`` of its Flower processes, so the ServerApp process Flower
starts loads it too. With ``MEDFED_SECAGG_PROBE`` set to a folder, it wraps
``ServerHalf.aggregate`` and ``ServerHalf.aggregate_summed`` of every class
of ``medfed.federated.strategies.fedavg`` and ``.base`` as they are imported:
each call is saved to that folder (``torch.save``: the method, the keys of
the replies it got and every tensor in them) before the half runs it. In a
site's process it wraps ``medfed.deploy.secure_aggregation.fit_reply`` too:
what each site hands SecAgg+ to mask (its vectors and weight, the round) is
saved as ``site-*.pt``.
"""

import importlib.abc
import itertools
import os
import sys

FOLDER = os.environ.get("MEDFED_SECAGG_PROBE")
TARGETS = {"medfed.federated.strategies.base": ("ServerHalf", "aggregate_summed"),
           "medfed.federated.strategies.fedavg": ("FedAvgServer", "aggregate"),
           "medfed.deploy.secure_aggregation": (None, "fit_reply")}
_calls = itertools.count()


def _wrap(module) -> None:
    """Replace the probed method of the module's class by one that saves each call first."""
    import torch

    class_name, method = TARGETS[module.__name__]
    if class_name is None:
        _wrap_fit_reply(module)
        return
    cls = getattr(module, class_name)
    original = getattr(cls, method)

    def probed(self, ctx, replies):
        received = {"method": method, "round": ctx.round, "phase": ctx.phase}
        if method == "aggregate":
            received["keys"] = sorted(replies)
            received["replies"] = {index: {key: value.detach().cpu().clone() for key, value in reply.items()} for index, reply in replies.items()}
        else:
            received["summed"] = {key: value.detach().cpu().clone() for key, value in replies.items()}
        torch.save(received, os.path.join(FOLDER, f"{os.getpid()}-{next(_calls):04d}.pt"))
        return original(self, ctx, replies)

    setattr(cls, method, probed)


def _wrap_fit_reply(module) -> None:
    """Save what a site hands SecAgg+ (site, round, vectors, weight) before the reply is made."""
    import torch

    original = module.fit_reply

    def probed(message, site_index, fields, vectors, weight):
        received = {"method": "fit_reply", "site": site_index, "round": int(message.metadata.group_id), "weight": weight,
                    "vectors": {key: value.detach().cpu().clone() for key, value in vectors.items()}}
        torch.save(received, os.path.join(FOLDER, f"site-{os.getpid()}-{next(_calls):04d}.pt"))
        return original(message, site_index, fields, vectors, weight)

    module.fit_reply = probed


class _Probe(importlib.abc.MetaPathFinder):
    """Finds the probed modules with the other finders and wraps their loading."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in TARGETS:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader_exec = spec.loader.exec_module

        def exec_module(module):
            loader_exec(module)
            _wrap(module)

        spec.loader.exec_module = exec_module
        return spec


if FOLDER:
    sys.meta_path.insert(0, _Probe())
