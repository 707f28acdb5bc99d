"""Deployment across machines on Flower (``pip install medfed[deploy]``; docs/deploy.md).

The simulator (``python -m medfed fit``) keeps every site in one process and
never imports flwr. Here the same strategies run on Flower's Deployment
Runtime: the ServerApp (:mod:`medfed.deploy.server_app`) runs the strategy's
server half and the round logic on the coordinating machine, the ClientApp
(:mod:`medfed.deploy.client_app`) runs one hospital's site half on that
hospital's SuperNode, on data it reads from its own ``data-root``.
With ``deploy.secure_aggregation`` the phases a strategy declares summable
run inside Flower's SecAgg+ (:mod:`medfed.deploy.secure_aggregation`): the
server half receives their replies only as one sum.
:mod:`medfed.deploy.local` starts a SuperLink and SuperNodes on this machine
for a rehearsal, the tests and the benchmark.
"""
