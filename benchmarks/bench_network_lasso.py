"""Time pFedNet's server step (network lasso by ADMM) at U-Net scale.

Synthetic personal parameters for N sites: a common part, a part shared by a
cluster of sites, and site noise (standard deviations 0.05, 0.01, 0.003). The
graph is the symmetric k-NN graph of random site sketches. For each penalty
norm p the script solves round 1 cold, then round 2 (centres = round 1's
solution plus a local update of standard deviation 0.002) both cold and
warm-started from round 1's state, and prints iterations, wall time and the
process's CPU time (less sensitive to other load on the machine).

``lam`` is ``--lam-fraction`` times a fusion scale: the mean over sites of the
dual norm of each site's deviation from the mean of all sites, over eta. (N
times that scale is a proven upper bound above which every connected
component fuses; see tests/test_network_lasso.py.)

Run from the repository root:  python -m benchmarks.bench_network_lasso [--d 800000] [--sites 5] [--k 3]
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from medfed.federated.graph import incidence_matrix, knn_edges
from medfed.federated.network_lasso import NetworkLassoResult, solve_network_lasso

DUAL_NORM = {1: math.inf, 2: 2, math.inf: 1}


def synthetic_centres(d: int, n_sites: int, generator: torch.Generator) -> torch.Tensor:
    """``(d, n_sites)`` float64: common + cluster (two clusters) + site parts."""
    common = 0.05 * torch.randn(d, 1, generator=generator, dtype=torch.float64)
    cluster_of_site = torch.arange(n_sites) * 2 // n_sites
    cluster = 0.01 * torch.randn(d, 2, generator=generator, dtype=torch.float64)[:, cluster_of_site]
    site = 0.003 * torch.randn(d, n_sites, generator=generator, dtype=torch.float64)
    return common + cluster + site


def timed_solve(**kwargs) -> tuple[NetworkLassoResult, float, float]:
    """The result, wall seconds, and CPU seconds of this process (all threads; robust to other load)."""
    wall, cpu = time.perf_counter(), time.process_time()
    result = solve_network_lasso(**kwargs)
    return result, time.perf_counter() - wall, time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--d", type=int, default=800_000, help="personal parameters per site")
    parser.add_argument("--sites", type=int, default=5)
    parser.add_argument("--k", type=int, default=3, help="neighbours per site in the k-NN graph")
    parser.add_argument("--eta", type=float, default=0.5, help="server step")
    parser.add_argument("--lam-fraction", type=float, default=0.3)
    parser.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    generator = torch.Generator().manual_seed(args.seed)
    dtype = getattr(torch, args.dtype)
    sketches = torch.randn(args.sites, 8, generator=generator)
    edges = knn_edges(sketches, args.k)
    Q = incidence_matrix(edges, args.sites, dtype=dtype)
    round_1 = synthetic_centres(args.d, args.sites, generator)
    local_update = 0.002 * torch.randn(args.d, args.sites, generator=generator, dtype=torch.float64)
    print(
        f"d={args.d} N={args.sites} M={len(edges)} (k={args.k}) {args.dtype} eta={args.eta} "
        f"lam={args.lam_fraction} x fusion scale, torch threads={torch.get_num_threads()}"
    )
    print("per solve: iterations, wall seconds (CPU seconds of this process, all threads)")
    header = " | ".join(f"{name:>26}" for name in ("round 1 cold", "round 2 cold", "round 2 warm"))
    print(f"{'p':>4} {'lam':>10} | {header} | wall s/iter")
    for p in (1, 2, math.inf):
        deviations = round_1 - round_1.mean(dim=1, keepdim=True)
        lam = args.lam_fraction * torch.linalg.vector_norm(deviations, ord=DUAL_NORM[p], dim=0).mean().item() / args.eta
        problem = dict(Q=Q, lam=lam, eta=args.eta, p=p)
        first = timed_solve(Z_tilde=round_1.to(dtype), **problem)
        round_2 = (first[0].Z.double() + local_update).to(dtype)
        cold = timed_solve(Z_tilde=round_2, **problem)
        warm = timed_solve(Z_tilde=round_2, warm_start=first[0].state, **problem)
        solves = (first, cold, warm)
        cells = [
            f"{r.iterations:4d} it {wall:6.2f} s ({cpu:6.2f} s){'' if r.converged else '!'}"
            for r, wall, cpu in solves
        ]
        per_iteration = sum(wall for _, wall, _ in solves) / sum(r.iterations for r, _, _ in solves)
        print(f"{p:>4} {lam:10.4g} | " + " | ".join(cells) + f" | {per_iteration:.3f}")
    print("'!' marks a solve that hit max_iter without converging.")


if __name__ == "__main__":
    main()
