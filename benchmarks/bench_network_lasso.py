"""Time pFedNet's server step (network lasso) at U-Net scale across lambda, optionally against another solver.

Synthetic personal parameters for N sites: a common part, a part shared by a
cluster of sites, and site noise (standard deviations 0.05, 0.01, 0.003). The
graph is the symmetric k-NN graph of random site sketches (k = 3 on 5 sites
gives 8-9 edges). For each penalty norm p and each lambda of a grid, the
script solves round 1 cold, then round 2 (centres = round 1's solution plus a
local update of standard deviation 0.002) warm-started from round 1's state,
and prints iterations, wall time and the process's CPU time (all threads;
less sensitive to other load on the machine than wall time). Each solver first
runs once on a 64-row slice, so one-off start-up (numba's, ~0.65 s per
process) is left out of the table.

lambda is a multiple (``--fractions``) of the fusion bound: the largest over
connected components of ``sum_n ||z~_n - component mean||_q / eta`` (q the dual
norm of p), above which every component is proven to fuse (see
tests/test_network_lasso.py).

``--compare FILE`` also times the ``solve_network_lasso`` of another copy of
the module, side by side, e.g. the previous commit's:

    git show HEAD~1:medfed/federated/strategies/solvers/network_lasso.py > outputs/old_network_lasso.py
    python -m benchmarks.bench_network_lasso --compare outputs/old_network_lasso.py

Run from the repository root:  python -m benchmarks.bench_network_lasso [--d 316495] [--sites 5] [--k 3]
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import sys
import time

import torch

from medfed.federated.strategies.solvers.graph import connected_components, incidence_matrix, knn_edges
from medfed.federated.strategies.solvers.network_lasso import solve_network_lasso

DUAL_NORM = {1: math.inf, 2: 2, math.inf: 1}


def synthetic_centres(d: int, n_sites: int, generator: torch.Generator) -> torch.Tensor:
    """``(d, n_sites)`` float64: common + cluster (two clusters) + site parts."""
    common = 0.05 * torch.randn(d, 1, generator=generator, dtype=torch.float64)
    cluster_of_site = torch.arange(n_sites) * 2 // n_sites
    cluster = 0.01 * torch.randn(d, 2, generator=generator, dtype=torch.float64)[:, cluster_of_site]
    site = 0.003 * torch.randn(d, n_sites, generator=generator, dtype=torch.float64)
    return common + cluster + site


def fusion_bound(Z_tilde: torch.Tensor, edges, eta: float, p: float) -> float:
    """The lambda above which every connected component is proven to fuse to its mean."""
    bound = 0.0
    for component in connected_components(edges, Z_tilde.shape[1]):
        deviations = Z_tilde[:, component] - Z_tilde[:, component].mean(dim=1, keepdim=True)
        bound = max(bound, torch.linalg.vector_norm(deviations, ord=DUAL_NORM[p], dim=0).sum().item() / eta)
    return bound


def load_solver(path: str):
    """``solve_network_lasso`` of the module file at ``path``."""
    spec = importlib.util.spec_from_file_location("compared_network_lasso", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module.solve_network_lasso


def timed(solver, **kwargs) -> tuple[object, str]:
    """The result and a cell ``iterations, wall s (CPU s)``; '!' marks a solve that hit max_iter."""
    wall, cpu = time.perf_counter(), time.process_time()
    result = solver(**kwargs)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return result, f"{result.iterations:4d} it {wall:6.2f} s ({cpu:6.2f} s){'' if result.converged else '!'}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--d", type=int, default=316_495, help="personal parameters per site (U-Net d2)")
    parser.add_argument("--sites", type=int, default=5)
    parser.add_argument("--k", type=int, default=3, help="neighbours per site in the k-NN graph")
    parser.add_argument("--eta", type=float, default=0.5, help="server step")
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.001, 0.01, 0.03, 0.1, 0.3, 1.0, 10.0])
    parser.add_argument("--norms", nargs="+", default=["1", "2", "inf"])
    parser.add_argument("--max-iter", type=int, default=500, help="pFedNet's default admm_max_iter")
    parser.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    parser.add_argument("--compare", metavar="FILE", help="another network_lasso.py to time side by side")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    generator = torch.Generator().manual_seed(args.seed)
    dtype = getattr(torch, args.dtype)
    edges = knn_edges(torch.randn(args.sites, 8, generator=generator), args.k)
    Q = incidence_matrix(edges, args.sites, dtype=dtype)
    round_1 = synthetic_centres(args.d, args.sites, generator)
    local_update = 0.002 * torch.randn(args.d, args.sites, generator=generator, dtype=torch.float64)
    solvers = {"this": solve_network_lasso} | ({"compared": load_solver(args.compare)} if args.compare else {})
    for solver in solvers.values():  # one-off start-up (numba's ~0.65 s per process) is not a round's cost
        for p in (float(norm) for norm in args.norms):
            solver(Z_tilde=round_1[:64].to(dtype), Q=Q, lam=1e-3, eta=args.eta, p=p, max_iter=5)
    print(
        f"d={args.d} N={args.sites} M={len(edges)} (k={args.k}) {args.dtype} eta={args.eta} "
        f"max_iter={args.max_iter}, torch threads={torch.get_num_threads()}"
    )
    print("per solve: iterations, wall seconds (CPU seconds of this process, all threads)")
    columns = [f"{name} {kind}" for name in solvers for kind in ("round 1 cold", "round 2 warm")]
    print(f"{'p':>4} {'x bound':>8} {'lam':>10} | " + " | ".join(f"{c:>27}" for c in columns))
    for p in (float(norm) for norm in args.norms):
        bound = fusion_bound(round_1, edges, args.eta, p)
        for fraction in args.fractions:
            problem = dict(Q=Q, lam=fraction * bound, eta=args.eta, p=p, max_iter=args.max_iter)
            cells = []
            for solver in solvers.values():
                first, cell_1 = timed(solver, Z_tilde=round_1.to(dtype), **problem)
                round_2 = (first.Z.double() + local_update).to(dtype)
                _, cell_2 = timed(solver, Z_tilde=round_2, warm_start=first.state, **problem)
                cells += [cell_1, cell_2]
            print(f"{p:>4} {fraction:8.3g} {fraction * bound:10.4g} | " + " | ".join(f"{c:>27}" for c in cells), flush=True)
    print("'!' marks a solve that hit max_iter without converging.")


if __name__ == "__main__":
    main()
