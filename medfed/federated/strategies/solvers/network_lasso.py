"""pFedNet's server step: the network-lasso proximal problem, solved exactly by ADMM.

After the personal phase of a round the server holds ``Z_tilde`` (one column of
personal parameters per site) and computes

    Z* = argmin_Z  1/(2 eta) ||Z - Z_tilde||_F^2 + lam * sum_m ||(Z Q)[:, m]||_p

where ``Q`` is the N x M incidence matrix of the similarity graph (so
``(Z Q)[:, m] = z_i - z_j`` for edge ``m = (i, j)``) and ``p`` is 1, 2 or inf.
Small ``lam`` keeps every site's parameters; large ``lam`` fuses the sites of
each connected component to the component's mean.

The solver is scaled-form ADMM on the split ``W = Z Q`` (Boyd et al. 2011,
"Distributed optimization and statistical learning via the alternating
direction method of multipliers", sec. 3):

- Z-step: ``Z (I_N / eta + rho Q Q^T) = Z_tilde / eta + rho (W - U) Q^T``, an
  N x N symmetric positive definite system, Cholesky-factorised once per
  ``(Q, eta, rho)`` and applied to the d x N right-hand side by two
  triangular solves. The proximal centre is ``Z_tilde`` in every iteration
  (pFedNet's reference code re-centred it on the current iterate, which
  converges to another point).
- W-step: ``W = prox_{(lam / rho) ||.||_p}(Z Q + U)`` column by column
  (:func:`prox_sum_of_norms`).
- dual step: ``U = U + Z Q - W``.

The iteration is over-relaxed (Boyd sec. 3.4.3, ``alpha = 1.6``) and, since
only ``Z Q`` feeds the W-step, the Z-step is applied in edge space as one
``(M, M)`` product (:class:`_EdgeSpaceZStep`). For p = inf the l1-ball
thresholds of the W-step are found by Newton's method on the threshold started
from the previous iteration's (:func:`_l1_ball_threshold`), no sort; on CPU
a numba kernel runs those passes and the clip fused per row, with the torch
reductions as the path for other devices (:func:`_inf_norm_w_step`).

It stops when the primal residual ``||Z Q - W||_F`` and the dual residual
``rho ||(W_k - W_{k-1}) Q^T||_F`` are both within absolute plus relative
tolerances (Boyd sec. 3.3.1), and by default balances the two residuals by
rescaling ``rho`` (Boyd sec. 3.4.1), which cut iterations by up to 5x and
made them insensitive to the starting ``rho`` in our measurements. ``W``,
``U`` and ``rho`` are returned so the next round can warm-start from them.

Before iterating, two exact shortcuts: when the least-norm multiplier
``Z_tilde Q (Q^T Q)^+ / eta`` lies in the dual-norm balls, ``lam`` fuses every
connected component and the component means are returned at 0 iterations
(:func:`_fused_solution`); for p = 2 the minimiser lies in the span of the
centres, so ADMM runs on the ``(N, N)`` coordinates of a thin QR
(:func:`_solve_l2_in_the_span_of_the_centres`).

The API uses the paper's shapes (``Z`` is d x N); internally the solver keeps
the transposes (one contiguous row per site and per edge), where the per-edge
norms run about 5x faster on CPU. Returned tensors are transposed views of
those rows, so ``result.Z[:, n]`` is contiguous.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numba
import numpy as np
import torch

_SUPPORTED_DTYPES = (torch.float32, torch.float64)
# The norm dual to the penalty's: its ball is the subdifferential of ||.||_p at 0.
_DUAL_NORM = {1.0: math.inf, 2.0: 2.0, math.inf: 1.0}
# Residual balancing (Boyd sec. 3.4.1): rescale rho by _RHO_FACTOR when one
# residual exceeds _RHO_IMBALANCE times the other (checked every iteration,
# only during the first _RHO_ADAPT_ITERATIONS so that convergence is kept).
# Boyd's 10 never fired on the U-Net benchmark, whose dual residual stayed ~7x
# the primal; 3 cut p = 1 and inf iterations by ~30% there (2 or 5 and
# rescaling by sqrt(primal / dual) measured the same).
_RHO_IMBALANCE = 3.0
_RHO_FACTOR = 2.0
_RHO_ADAPT_ITERATIONS = 100
# Passes of Michelot's algorithm for the l1-ball threshold before falling back
# to a sort of the surviving entries (see _l1_ball_threshold).
_MICHELOT_MAX_PASSES = 30
# p = inf W-step on CPU by the numba kernel (False: the torch path everywhere).
# The first call in a process costs ~0.65 s of numba start-up (compiled code
# is cached in __pycache__; a fresh checkout compiles once, ~1 s per dtype).
_NUMBA_ON_CPU = True
# Over-relaxation (Boyd sec. 3.4.3): the W- and U-steps see alpha Z Q + (1 - alpha) W_k.
_OVER_RELAXATION = 1.6


@dataclass
class AdmmState:
    """ADMM variables carried from one solve to the next (warm start).

    Held in full, or (``basis`` given) as coordinates in the span of
    ``basis``: the p = 2 solve keeps its state so, since its iterates lie in
    the span of the centres, at O(d N) memory instead of O(d M) for M edges
    (pFedNet carries the state from round to round).

    Attributes:
        W: ``(d, M)`` split variable, or its ``(k, M)`` coordinates ``basis^T W``;
            equals ``Z Q`` at convergence.
        U: ``(d, M)`` scaled dual variable (Lagrange multiplier divided by
            ``rho``), or its ``(k, M)`` coordinates.
        rho: penalty parameter ``U`` is scaled by, ``> 0``.
        basis: ``None``, or ``(d, k)`` with orthonormal columns: then the
            state is ``W = basis @ W``, ``U = basis @ U``.
    """

    W: torch.Tensor
    U: torch.Tensor
    rho: float
    basis: torch.Tensor | None = None

    def full(self) -> AdmmState:
        """The same state with ``(d, M)`` W and U (itself when already so)."""
        if self.basis is None:
            return self
        return AdmmState(W=self.basis @ self.W.to(self.basis.dtype), U=self.basis @ self.U.to(self.basis.dtype), rho=self.rho)


@dataclass
class NetworkLassoResult:
    """Solution of the network-lasso problem and how the solver got there.

    Attributes:
        Z: ``(d, N)`` minimiser, same dtype and device as ``Z_tilde``.
        state: ADMM variables to pass as ``warm_start`` to the next solve.
        iterations: ADMM iterations run (0 when the answer is ``Z_tilde``).
        primal_residual: ``||Z Q - W||_F`` at the last iteration.
        dual_residual: ``rho ||(W_k - W_{k-1}) Q^T||_F`` at the last iteration.
        converged: both residuals met their tolerances before ``max_iter``.
    """

    Z: torch.Tensor
    state: AdmmState
    iterations: int
    primal_residual: float
    dual_residual: float
    converged: bool


@torch.no_grad()
def solve_network_lasso(
    Z_tilde: torch.Tensor,
    Q: torch.Tensor,
    *,
    lam: float,
    eta: float,
    p: float | int | str,
    rho: float | None = None,
    max_iter: int = 1000,
    abs_tol: float = 1e-6,
    rel_tol: float = 1e-5,
    adapt_rho: bool = True,
    warm_start: AdmmState | None = None,
) -> NetworkLassoResult:
    """Minimise ``1/(2 eta) ||Z - Z_tilde||_F^2 + lam * sum_m ||(Z Q)[:, m]||_p`` over ``Z``.

    Args:
        Z_tilde: ``(d, N)`` float32 or float64 proximal centre, one column per
            site. The solve runs on its device and in its dtype.
        Q: ``(N, M)`` graph incidence matrix (:func:`medfed.federated.strategies.solvers.graph.incidence_matrix`);
            any real ``(N, M)`` matrix is accepted.
        lam: penalty weight ``>= 0``.
        eta: server step size ``> 0``.
        p: column norm: 1, 2 or inf (``math.inf`` or the string ``"inf"``).
        rho: initial ADMM penalty ``> 0``; default ``1 / eta``, which puts the
            two quadratic terms of the Z-step on the same scale. Ignored when
            ``warm_start`` is given (its ``rho`` is used).
        max_iter: iteration limit ``>= 1``.
        abs_tol, rel_tol: absolute (per entry) and relative tolerances
            ``>= 0`` of the stopping rule (Boyd sec. 3.3.1).
        adapt_rho: balance the residuals by rescaling ``rho`` (Boyd sec.
            3.4.1) during the first iterations.
        warm_start: state returned by a previous solve on the same graph.

    Returns:
        The minimiser and the solver state; see :class:`NetworkLassoResult`.

    Raises:
        ValueError: an argument is out of range or a shape does not match; the
            message names the argument.
    """
    p = _canonical_norm(p)
    _check_problem(Z_tilde, Q, lam=lam, eta=eta)
    _check_solver_settings(rho=rho, max_iter=max_iter, abs_tol=abs_tol, rel_tol=rel_tol)
    d, n_sites = Z_tilde.shape
    Q = Q.to(dtype=Z_tilde.dtype, device=Z_tilde.device)
    n_edges = Q.shape[1]
    # Site-major layout: row n of z is site n's parameters, row m of w and u
    # belongs to edge m, so every per-edge norm reduces over contiguous memory.
    if warm_start is None:
        rho = 1.0 / eta if rho is None else float(rho)
        w, u = _exact_state_without_penalty(Z_tilde, Q)
        start = AdmmState(W=w.T, U=u.T, rho=rho)
    else:
        _check_warm_start(warm_start, like=Z_tilde, n_edges=n_edges)
        start, rho = warm_start, float(warm_start.rho)
    if lam == 0 or n_edges == 0:  # Z_tilde is the answer; return its exact state, not the warm one
        w, u = _exact_state_without_penalty(Z_tilde, Q)
        return NetworkLassoResult(
            Z=Z_tilde.clone(),
            state=AdmmState(W=w.T, U=u.T, rho=rho),
            iterations=0,
            primal_residual=0.0,
            dual_residual=0.0,
            converged=True,
        )

    fused = _fused_solution(Z_tilde, Q, lam=lam, p=p, eta=eta, rho=rho)
    if fused is not None:
        return fused
    settings = dict(lam=lam, eta=eta, p=p, max_iter=max_iter, abs_tol=abs_tol, rel_tol=rel_tol, adapt_rho=adapt_rho)
    if p == 2 and d > n_sites:
        return _solve_l2_in_the_span_of_the_centres(Z_tilde, Q, start, rho, **settings)
    full = start.full()
    w = full.W.T.to(dtype=Z_tilde.dtype, device=Z_tilde.device).contiguous()
    u = full.U.T.to(dtype=Z_tilde.dtype, device=Z_tilde.device).contiguous()
    del start, full
    return _admm(Z_tilde, Q, w, u, rho, **settings)


@torch.no_grad()
def network_lasso_objective(
    Z: torch.Tensor,
    Z_tilde: torch.Tensor,
    Q: torch.Tensor,
    *,
    lam: float,
    eta: float,
    p: float | int | str,
) -> float:
    """``1/(2 eta) ||Z - Z_tilde||_F^2 + lam * sum_m ||(Z Q)[:, m]||_p``, evaluated in float64.

    Args:
        Z, Z_tilde: ``(d, N)`` tensors.
        Q: ``(N, M)`` incidence matrix.
        lam, eta, p: as in :func:`solve_network_lasso`.
    """
    p = _canonical_norm(p)
    _check_problem(Z_tilde, Q, lam=lam, eta=eta)
    if not isinstance(Z, torch.Tensor) or Z.shape != Z_tilde.shape:
        raise ValueError(f"Z: expected shape {tuple(Z_tilde.shape)} like Z_tilde, found {_describe(Z)}")
    Z, Z_tilde = Z.double(), Z_tilde.to(device=Z.device, dtype=torch.float64)
    Q = Q.to(device=Z.device, dtype=torch.float64)
    fit = _norm(Z - Z_tilde) ** 2 / (2 * eta)
    penalty = torch.linalg.vector_norm(Z @ Q, ord=p, dim=0).sum().item() if Q.shape[1] else 0.0
    return fit + lam * penalty


def prox_sum_of_norms(V: torch.Tensor, tau: float, p: float, dim: int) -> torch.Tensor:
    """``argmin_W 1/2 ||W - V||_F^2 + tau * sum of the p-norms of W over dimension dim``.

    With ``dim=0`` the norms are those of the columns, as in the network-lasso
    penalty ``||W||_{1,p}``; with ``dim=1`` those of the rows. The problem
    separates over the slices, and by Moreau's decomposition the prox of
    ``tau ||.||_p`` is ``v`` minus the projection of ``v`` onto the
    ``tau``-ball of the dual norm:

    - p = 1: ``v - clamp(v, -tau, tau)`` (element-wise soft-threshold),
    - p = 2: ``v * max(0, 1 - tau / ||v||_2)`` (block soft-threshold),
    - p = inf: ``v - Proj_{l1 ball of radius tau}(v) = clamp(v, -t, t)``,
      where ``t >= 0`` solves ``sum_i max(|v_i| - t, 0) = tau`` (``t = 0``
      when ``||v||_1 <= tau``).

    Args:
        V: 2-D float tensor.
        tau: threshold ``>= 0``.
        p: 1, 2 or inf (``math.inf`` or ``"inf"``).
        dim: 0 or 1, the dimension the norms reduce over.

    Returns:
        Tensor like ``V``.

    Raises:
        ValueError: ``V`` is not a 2-D float tensor, or ``tau``, ``p`` or
            ``dim`` is out of range.
    """
    p = _canonical_norm(p)
    if not isinstance(V, torch.Tensor) or V.ndim != 2 or not V.is_floating_point():
        raise ValueError(f"V: expected a 2-D float tensor, found {_describe(V)}")
    if not _is_real(tau) or not tau >= 0 or not math.isfinite(tau):
        raise ValueError(f"tau: expected a finite number >= 0, found {tau!r}")
    if dim not in (0, 1):
        raise ValueError(f"dim: expected 0 or 1, found {dim!r}")
    if tau == 0:
        return V.clone()
    if p == 1:
        return V - V.clamp(-tau, tau)
    if p == 2:
        norms = torch.linalg.vector_norm(V, dim=dim, keepdim=True)
        return V * (1 - tau / norms).clamp(min=0)  # a zero slice gives -inf -> 0
    threshold = _l1_ball_threshold(V.abs(), tau, dim=dim)
    return torch.minimum(torch.maximum(V, -threshold), threshold)


def _l1_ball_threshold(
    magnitudes: torch.Tensor, radius: float, dim: int, start: torch.Tensor | None = None
) -> torch.Tensor:
    """Per slice, the ``t >= 0`` with ``sum_i max(a_i - t, 0) = radius`` (0 if ``sum_i a_i <= radius``).

    Projecting ``v`` onto the l1 ball of that radius is ``sign(v) max(|v| - t, 0)``.
    Duchi et al. (2008, "Efficient projections onto the l1-ball", fig. 1) read
    ``t`` off the sorted entries, but sorting ``d ~ 10^6`` entries per slice
    costs several times a whole ADMM iteration. Instead, Newton's method on

        f(t) = sum_i max(a_i - t, 0) - radius,    f'(t) = -n(t) = -#{i : a_i > t},

    ``t <- t + f(t) / n(t) = (sum_{a_i > t} a_i - radius) / n(t)``, which is
    Michelot's algorithm. ``f`` is convex, decreasing and piecewise linear, so
    from any ``t`` with ``n(t) > 0`` one step lands at or below the root (the
    tangent lies below ``f``), and from below the root the steps rise
    monotonically to it while the sets ``{a_i > t}`` shrink. Consecutive sets
    are therefore nested, and when ``n`` stops changing the set is the same
    as the one the step was computed from: ``t`` is exact (a fixed point),
    not an approximation.

    Each pass is two reductions over the data (``sum max(a - t, 0)`` and the
    count ``n(t)`` as the sum of its signs, ~4x cheaper than summing a boolean
    mask), no sort. Cold, ``t`` starts at ``(sum_i a_i - radius) / length``
    (below the root) and took 3-12 passes in our measurements; ADMM passes the
    previous iteration's thresholds as ``start``, which change little between
    iterations, and then 2-3 passes suffice. A slice whose start lies above
    all its entries (``n = 0``) restarts cold. Should a slice still move after
    ``_MICHELOT_MAX_PASSES`` (rounding can flip a tie back and forth), Duchi's
    sort finishes the job on the ``K`` largest entries of each slice (``K``:
    the most entries above the cold start in any slice, which contain every
    entry above the exact ``t``).

    Args:
        magnitudes: 2-D non-negative tensor ``a``.
        radius: ``> 0``.
        dim: the dimension that indexes the entries of a slice.
        start: optional first guess, shaped like the result (any values).

    Returns:
        Thresholds with ``dim`` kept as size 1, same dtype and device.
    """
    length = magnitudes.shape[dim]
    cold = ((magnitudes.sum(dim=dim, keepdim=True) - radius) / length).clamp(min=0)
    threshold = cold if start is None else start.to(dtype=magnitudes.dtype).clamp(min=0)
    # Counts are sums of signs: exact in float32 below 2^24 entries per slice, beyond that summed in float64.
    count_dtype = magnitudes.dtype if length < 2**24 else torch.float64
    beyond_any_count = torch.full_like(threshold, length + 1.0, dtype=count_dtype)
    n_above_before = beyond_any_count
    for passes in range(_MICHELOT_MAX_PASSES):
        excess = (magnitudes - threshold).clamp_(min=0)
        n_above = torch.sign(excess).sum(dim=dim, keepdim=True, dtype=count_dtype)
        value = excess.sum(dim=dim, keepdim=True) - radius  # f(t)
        if passes == 0:
            # Every slice steps once. A start at or below the root (f >= 0) is
            # already in Michelot's monotone phase; one above it lands below.
            moving = torch.ones_like(n_above, dtype=torch.bool)
            n_above_next = torch.where(value >= 0, n_above, beyond_any_count)
        else:
            # From below the root the set can only shrink: a slice whose set did
            # not shrink is at its fixed point (or one rounding step past it). It
            # stays frozen; more steps would only let rounding flip a tie.
            moving = n_above < n_above_before
            if not moving.any():
                return threshold
            n_above_next = torch.where(moving, n_above, n_above_before)
        newton = torch.where(n_above > 0, threshold + value / n_above.clamp(min=1), cold).clamp(min=0)
        threshold = torch.where(moving, newton, threshold)
        n_above_before = n_above_next
    n_candidates = int((magnitudes > cold).sum(dim=dim).max())
    return _duchi_threshold(magnitudes, radius, dim=dim, n_candidates=max(n_candidates, 1))


@dataclass
class _WStep:
    """ADMM's W-step and what the stopping rule needs from it, all ``(M, d)`` rows except the floats.

    ``step`` is ``W_{k+1} - W_k``; ``primal`` is ``||Z Q - W_{k+1}||_F``;
    ``zq_norm`` and ``w_norm`` are ``||Z Q||_F`` and ``||W_{k+1}||_F``.
    """

    w: torch.Tensor
    step: torch.Tensor
    primal: float
    zq_norm: float
    w_norm: float
    thresholds: torch.Tensor | None = None


def _w_step_statistics(zq: torch.Tensor, w: torch.Tensor, w_previous: torch.Tensor, **kwargs) -> _WStep:
    """:class:`_WStep` of a W-step computed elsewhere, by torch reductions."""
    return _WStep(w=w, step=w - w_previous, primal=_norm(zq - w), zq_norm=_norm(zq), w_norm=_norm(w), **kwargs)


def _inf_norm_w_step(
    v: torch.Tensor, zq: torch.Tensor, w_previous: torch.Tensor, tau: float, start: torch.Tensor | None
) -> _WStep:
    """ADMM's p = inf W-step on ``(M, d)`` rows: ``W = clamp(v, -t, t)`` per row; ``v`` becomes ``U = v - W``.

    ``t`` is :func:`_l1_ball_threshold` of ``|v|`` with radius ``tau`` (the prox
    of ``tau ||.||_inf`` is ``v`` minus the projection onto the l1 ball),
    started from ``start`` (the previous iteration's thresholds, ``(M, 1)``).

    On CPU a numba kernel does the same Newton passes per row, each one fused
    loop over the row (abs, excess, count in registers), then the clip,
    ``U``, ``W_{k+1} - W_k`` and the stopping rule's sums of squares in one
    more loop: the torch reductions it replaces took ~45 of the ~65 ms of an
    iteration at d = 316k, M = 9, the kernel ~10 ms. Other devices (CUDA)
    and rows the kernel could not settle within ``_MICHELOT_MAX_PASSES`` take
    the torch path, which gives the same thresholds (up to summation order:
    the kernel sums in float64).
    """
    if not (_NUMBA_ON_CPU and v.device.type == "cpu" and v.is_contiguous() and zq.is_contiguous()):
        t = _l1_ball_threshold(v.abs(), tau, dim=1, start=start)
        w = torch.minimum(torch.maximum(v, -t), t)
        v.sub_(w)
        return _w_step_statistics(zq, w, w_previous.contiguous(), thresholds=t)
    values = v.numpy()
    clipped, step = np.empty_like(values), np.empty_like(values)
    thresholds = np.empty(values.shape[0], dtype=values.dtype)
    squares = np.zeros((values.shape[0], 3))  # per row: (zq - w)^2, zq^2, w^2
    first_guess = np.zeros(0, dtype=values.dtype) if start is None else start.reshape(-1).numpy()
    unsettled = _inf_norm_w_step_kernel(
        values, zq.numpy(), w_previous.contiguous().numpy(), float(tau), first_guess, _MICHELOT_MAX_PASSES,
        clipped, step, thresholds, squares,
    )  # fmt: skip
    w, t, step = torch.from_numpy(clipped), torch.from_numpy(thresholds).reshape(-1, 1), torch.from_numpy(step)
    if unsettled.any():  # those rows of v are untouched: finish them with torch
        rows = torch.from_numpy(unsettled).nonzero().reshape(-1)
        t[rows] = _l1_ball_threshold(v[rows].abs(), tau, dim=1)
        w[rows] = torch.minimum(torch.maximum(v[rows], -t[rows]), t[rows])
        v[rows] -= w[rows]
        step[rows] = w[rows] - w_previous[rows]
        for column, rows_squared in enumerate(((zq[rows] - w[rows]) ** 2, zq[rows] ** 2, w[rows] ** 2)):
            squares[unsettled, column] = rows_squared.double().sum(dim=1).numpy()
    primal, zq_norm, w_norm = np.sqrt(squares.sum(axis=0)).tolist()
    return _WStep(w=w, step=step, primal=primal, zq_norm=zq_norm, w_norm=w_norm, thresholds=t)


@numba.njit(cache=True, nogil=True, fastmath=True)
def _inf_norm_w_step_kernel(
    values, zq, w_previous, radius, first_guess, max_passes, clipped, step, thresholds, squares
):  # pragma: no cover (compiled)
    """Numba body of :func:`_inf_norm_w_step`; returns a bool per row, true where it gave up (row untouched).

    The loops are branch-free so that LLVM vectorises them (``fastmath`` lets
    it reorder the float64 sums): a branchy loop measured 12x slower.
    """
    n_rows, length = values.shape
    zero = values.dtype.type(0)
    unsettled = np.zeros(n_rows, dtype=np.bool_)
    for m in range(n_rows):
        row = values[m]
        total = 0.0
        for i in range(length):
            total += abs(row[i])
        cold = max((total - radius) / length, 0.0)
        t = max(float(first_guess[m]), 0.0) if first_guess.shape[0] else cold
        n_before = length + 1
        settled = False
        for passes in range(max_passes):
            level = values.dtype.type(t)
            excess = 0.0
            n_above = 0
            for i in range(length):
                e = max(abs(row[i]) - level, zero)
                excess += e
                n_above += e > zero
            value = excess - radius
            if passes == 0:
                n_next = n_above if value >= 0 else length + 1
            else:
                if n_above >= n_before:
                    settled = True
                    break
                n_next = n_above
            t = max(t + value / n_above, 0.0) if n_above > 0 else cold
            n_before = n_next
        if not settled:
            unsettled[m] = True
            continue
        thresholds[m] = t
        bound = values.dtype.type(t)
        residual_squared, zq_squared, w_squared = 0.0, 0.0, 0.0
        for i in range(length):
            x = row[i]
            c = min(max(x, -bound), bound)
            clipped[m, i] = c
            row[i] = x - c
            step[m, i] = c - w_previous[m, i]
            r = zq[m, i] - c
            residual_squared += r * r
            zq_squared += zq[m, i] * zq[m, i]
            w_squared += c * c
        squares[m, 0] = residual_squared
        squares[m, 1] = zq_squared
        squares[m, 2] = w_squared
    return unsettled


def _duchi_threshold(magnitudes: torch.Tensor, radius: float, dim: int, n_candidates: int) -> torch.Tensor:
    """:func:`_l1_ball_threshold` by sorting, given that at most ``n_candidates`` entries per slice exceed ``t``."""
    largest = torch.topk(magnitudes, n_candidates, dim=dim, sorted=True).values
    partial_sums = largest.cumsum(dim=dim)
    shape = [1, 1]
    shape[dim] = n_candidates
    ranks = torch.arange(1, n_candidates + 1, dtype=magnitudes.dtype, device=magnitudes.device).reshape(shape)
    # Duchi's rule: the entries above t are the ranks j with a_(j) > (S_j - radius) / j.
    active = largest * ranks > partial_sums - radius
    n_active = (active * ranks).amax(dim=dim, keepdim=True).clamp(min=1)
    threshold = (partial_sums.gather(dim, n_active.long() - 1) - radius) / n_active
    return threshold.clamp(min=0)


def _fused_solution(
    Z_tilde: torch.Tensor, Q: torch.Tensor, *, lam: float, p: float, eta: float, rho: float
) -> NetworkLassoResult | None:
    """The exact answer when ``lam`` provably fuses every connected component, else ``None``.

    ``Z`` is optimal iff ``Z = Z_tilde - eta Lambda Q^T`` for some ``Lambda``
    ``(d, M)`` whose column ``m`` is ``lam`` times a subgradient of
    ``||.||_p`` at ``(Z Q)[:, m]`` (the optimality condition of the problem).
    Let ``Zbar`` be ``Z_tilde`` with each component's columns replaced by
    their mean. ``Zbar Q = 0``, where the subdifferential is the whole unit
    ball of the dual norm ``q`` (inf for p = 1, 2 for p = 2, 1 for p = inf),
    so ``Zbar`` is optimal iff ``Lambda Q^T = (Z_tilde - Zbar) / eta`` has a
    solution with every column in the ball of radius ``lam``. The rows of
    ``Z_tilde - Zbar`` are those of ``Z_tilde`` projected onto the range of
    ``Q`` (the vectors summing to zero on every component), i.e.
    ``Z_tilde - Zbar = Z_tilde Q (Q^T Q)^+ Q^T``, so

        Lambda_0 = Z_tilde Q (Q^T Q)^+ / eta        (d, M)

    is a solution, the one of least Frobenius norm; every other one adds a
    circulation around the graph's cycles. If ``Lambda_0``'s columns are in the
    ball the answer is ``Zbar``, exactly: the test costs one ``(M, N) x (N, d)``
    product and the column norms. On a forest ``Lambda_0`` is the only solution
    and the test is exact; on a graph with cycles a fusion that needs a
    circulation is left to the iteration.

    The returned state is ADMM's fixed point: ``W = Zbar Q = 0`` and
    ``U = Lambda_0 / rho`` (the multiplier is ``Lambda``).
    """
    Q64 = Q.double()
    coefficients = torch.linalg.pinv(Q64.T @ Q64, hermitian=True) @ Q64.T  # (M, N): (Q^T Q)^+ Q^T
    averaging = torch.eye(Q.shape[0], dtype=torch.float64, device=Q.device) - Q64 @ coefficients  # (N, N)
    multiplier = (coefficients.to(Z_tilde.dtype) @ Z_tilde.T) / eta  # (M, d): Lambda_0^T
    dual_norms = torch.linalg.vector_norm(multiplier, ord=_DUAL_NORM[p], dim=1)
    if dual_norms.max().item() > lam:
        return None
    z = averaging.to(Z_tilde.dtype) @ Z_tilde.T  # (N, d): each site's component mean (averaging is symmetric)
    return NetworkLassoResult(
        Z=z.T,
        state=AdmmState(W=torch.zeros_like(multiplier).T, U=(multiplier / rho).T, rho=rho),
        iterations=0,
        primal_residual=0.0,
        dual_residual=0.0,
        converged=True,
    )


def _solve_l2_in_the_span_of_the_centres(
    Z_tilde: torch.Tensor, Q: torch.Tensor, start: AdmmState, rho: float, *, abs_tol: float, **settings
) -> NetworkLassoResult:
    """p = 2 solved on an ``(N, N)`` problem: the minimiser lies in the span of the centres.

    Factor ``Z_tilde = B R`` (thin QR: ``B`` ``(d, N)`` with orthonormal
    columns, ``R`` ``(N, N)``). Any ``Z`` is ``B Y + V`` with ``B^T V = 0``; then
    ``||Z - Z_tilde||_F^2 = ||Y - R||_F^2 + ||V||_F^2`` and, column by column,
    ``||(Z Q)[:, m]||_2^2 = ||(Y Q)[:, m]||_2^2 + ||(V Q)[:, m]||_2^2``. Both
    terms only grow with ``V``, so ``V = 0`` at the minimiser and ``Y`` solves
    the same problem with centre ``R``. ADMM from a state in the span of ``B``
    stays there, and ``B`` maps the ``(N, .)`` iterates isometrically onto the
    ``(d, .)`` ones: the reduced run *is* the full run (same residuals, same
    iterations), started from the warm state projected onto the span, at
    ``O(N^2 M)`` instead of ``O(d N M)`` per iteration. ``abs_tol`` is scaled
    by ``sqrt(d / N)`` so the absolute thresholds (Boyd's ``sqrt(d M) abs_tol``)
    are the full problem's. The reduced run is in float64 (it is tiny); the
    costs are the QR and two ``(d, N)`` products. The state returned stays in
    coordinates (``AdmmState.basis`` = B), and a warm start held so is
    projected through ``B_old^T B`` (``(k, N)``), never expanded to ``(d, M)``.
    """
    d, n_sites = Z_tilde.shape
    basis, coordinates = torch.linalg.qr(Z_tilde)  # (d, N), (N, N)
    w, u = start.W.to(device=basis.device), start.U.to(device=basis.device)  # (d, M), or (k, M) in start.basis
    change = basis if start.basis is None else start.basis.to(device=basis.device, dtype=basis.dtype).T @ basis  # (d or k, N)
    reduced = _admm(
        coordinates.double(),
        Q.double(),
        (w.T.to(change.dtype) @ change).double(),  # (M, N): the warm state's coordinates in the basis
        (u.T.to(change.dtype) @ change).double(),
        rho,
        abs_tol=abs_tol * math.sqrt(d / n_sites),
        **settings,
    )
    return NetworkLassoResult(
        Z=basis @ reduced.Z.to(Z_tilde.dtype),
        state=AdmmState(W=reduced.state.W.to(Z_tilde.dtype), U=reduced.state.U.to(Z_tilde.dtype), rho=reduced.state.rho, basis=basis),
        iterations=reduced.iterations,
        primal_residual=reduced.primal_residual,
        dual_residual=reduced.dual_residual,
        converged=reduced.converged,
    )


def _admm(
    Z_tilde: torch.Tensor,
    Q: torch.Tensor,
    w: torch.Tensor,
    u: torch.Tensor,
    rho: float,
    *,
    lam: float,
    eta: float,
    p: float,
    max_iter: int,
    abs_tol: float,
    rel_tol: float,
    adapt_rho: bool,
) -> NetworkLassoResult:
    """The ADMM iteration of the module docstring from ``(W^T, U^T, rho)``; ``w, u`` are ``(M, d)``, ``Q`` is on Z_tilde's dtype and device.

    Over-relaxed (Boyd sec. 3.4.3, ``alpha = _OVER_RELAXATION``): the W- and
    U-steps use ``alpha Z_{k+1} Q + (1 - alpha) W_k`` in place of
    ``Z_{k+1} Q``; the fixed points, residuals and stopping rule are those of
    plain ADMM.

    Only ``Z Q`` enters the W- and U-steps, so the Z-step is carried out in
    edge space: with ``S = I_N / eta + rho Q Q^T``,

        Z_{k+1} Q = [Z_tilde S^{-1} Q] / eta + (W_k - U_k) [rho Q^T S^{-1} Q]^T,

    (written for the ``(d, .)`` shapes), one ``(M, M)`` product per iteration
    on top of an ``(M, d)`` offset computed once per ``rho``; ``Z`` itself is
    formed once, after the last iteration.
    """
    d, n_sites = Z_tilde.shape
    n_edges = Q.shape[1]
    centre = Z_tilde.T.contiguous() / eta  # (N, d): the proximal centre of every Z-step
    z_step = _EdgeSpaceZStep(centre, Q, eta=eta, rho=rho)
    primal_scale = math.sqrt(d * n_edges) * abs_tol  # Boyd's sqrt(p) * eps_abs
    dual_scale = math.sqrt(d * n_sites) * abs_tol  # Boyd's sqrt(n) * eps_abs
    converged = False
    thresholds = None  # p = inf: the last l1-ball thresholds, the next prox's first guess
    for iteration in range(1, max_iter + 1):
        difference = w - u  # W_k - U_k, the Z-step's only input
        zq = z_step.edges(difference)  # (M, d): Z_{k+1} Q, z_i - z_j per edge
        v = torch.lerp(w, zq, _OVER_RELAXATION).add_(u)  # alpha Z Q + (1 - alpha) W_k + U_k
        if p == math.inf:
            w_step = _inf_norm_w_step(v, zq, w, lam / rho, start=thresholds)
            thresholds = w_step.thresholds
        else:
            w_next = torch.nn.functional.softshrink(v, lam / rho) if p == 1 else prox_sum_of_norms(v, lam / rho, p, dim=1)
            v.sub_(w_next)
            w_step = _w_step_statistics(zq, w_next, w)
        w, u = w_step.w, v  # v - W_{k+1}
        primal, dual = w_step.primal, rho * _norm(Q @ w_step.step)
        if primal <= primal_scale + rel_tol * max(w_step.zq_norm, w_step.w_norm) and dual <= (
            dual_scale + rel_tol * rho * _norm(Q @ u)
        ):
            converged = True
            break
        if adapt_rho and iteration <= _RHO_ADAPT_ITERATIONS:
            factor = _rho_rescale_factor(primal, dual)
            if factor != 1.0:
                rho *= factor
                u = u / factor  # u is the multiplier divided by rho
                z_step = _EdgeSpaceZStep(centre, Q, eta=eta, rho=rho)
    return NetworkLassoResult(
        Z=z_step.sites(difference).T,
        state=AdmmState(W=w.T, U=u.T, rho=rho),
        iterations=iteration,
        primal_residual=primal,
        dual_residual=dual,
        converged=converged,
    )


class _EdgeSpaceZStep:
    """ADMM's Z-step ``Z = (Z_tilde / eta + rho (W - U) Q^T) S^{-1}``, ``S = I_N / eta + rho Q Q^T``, in site-major rows.

    ``S`` is ``N x N`` symmetric positive definite with eigenvalues in
    ``[1 / eta, 1 / eta + rho ||Q||_2^2]``; its Cholesky factor is computed in
    float64. :meth:`edges` returns ``Z Q`` directly (what the iteration needs)
    as ``offset + P (W - U)^T`` with ``offset = Q^T S^{-1} Z_tilde^T / eta``
    ``(M, d)`` and ``P = rho Q^T S^{-1} Q`` ``(M, M)``; :meth:`sites` returns
    ``Z`` itself by two triangular solves.
    """

    def __init__(self, centre: torch.Tensor, Q: torch.Tensor, *, eta: float, rho: float) -> None:
        Q64 = Q.double()
        system = torch.eye(Q.shape[0], dtype=torch.float64, device=Q.device) / eta + rho * (Q64 @ Q64.T)
        cholesky64 = torch.linalg.cholesky(system)
        self._centre, self._Q, self._rho = centre, Q, rho
        self._cholesky = cholesky64.to(Q.dtype)
        self._coupling = (rho * Q64.T @ torch.cholesky_solve(Q64, cholesky64)).to(Q.dtype)  # P, (M, M)
        self._offset = Q.T @ _cholesky_solve(centre, self._cholesky)  # (M, d)

    def edges(self, difference: torch.Tensor) -> torch.Tensor:
        """``Z Q`` as ``(M, d)`` rows, given ``difference = W^T - U^T`` ``(M, d)``."""
        return torch.addmm(self._offset, self._coupling, difference)

    def sites(self, difference: torch.Tensor) -> torch.Tensor:
        """``Z`` as ``(N, d)`` rows, given ``difference = W^T - U^T`` ``(M, d)``."""
        return _cholesky_solve(self._centre + self._rho * (self._Q @ difference), self._cholesky)


def _cholesky_solve(rhs: torch.Tensor, cholesky: torch.Tensor) -> torch.Tensor:
    """``X`` with ``L L^T X = rhs`` for ``rhs (N, d)`` and lower-triangular ``L (N, N)``: two triangular solves."""
    half = torch.linalg.solve_triangular(cholesky, rhs, upper=False)
    return torch.linalg.solve_triangular(cholesky.T, half, upper=True)


def _rho_rescale_factor(primal: float, dual: float) -> float:
    """Boyd's residual balancing: the factor to multiply ``rho`` by (2, 1/2 or 1).

    A large primal residual means the constraint ``Z Q = W`` is enforced too
    weakly: raise ``rho``. A large dual residual means ``W`` still moves too
    much between iterations: lower it.
    """
    if primal > _RHO_IMBALANCE * dual:
        return _RHO_FACTOR
    if dual > _RHO_IMBALANCE * primal:
        return 1 / _RHO_FACTOR
    return 1.0


def _norm(tensor: torch.Tensor) -> float:
    return torch.linalg.vector_norm(tensor).item()


def _canonical_norm(p: float | int | str) -> float:
    """1, 2 or math.inf from the accepted spellings of ``p``."""
    if isinstance(p, str) and p.strip().lower() == "inf":
        return math.inf
    if not isinstance(p, bool) and isinstance(p, (int, float)) and p in (1, 2, math.inf):
        return float(p)
    raise ValueError(f"p: expected 1, 2 or inf (the column norm of the penalty), found {p!r}")


def _check_problem(Z_tilde: torch.Tensor, Q: torch.Tensor, *, lam: float, eta: float) -> None:
    if not isinstance(Z_tilde, torch.Tensor) or Z_tilde.ndim != 2:
        raise ValueError(f"Z_tilde: expected a 2-D tensor (d parameters, N sites), found {_describe(Z_tilde)}")
    if Z_tilde.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"Z_tilde: expected dtype float32 or float64, found {Z_tilde.dtype}")
    if not isinstance(Q, torch.Tensor) or Q.ndim != 2 or Q.shape[0] != Z_tilde.shape[1]:
        raise ValueError(
            f"Q: expected a 2-D tensor (N={Z_tilde.shape[1]} sites, M edges) matching Z_tilde's columns, "
            f"found {_describe(Q)}"
        )
    if Q.is_complex() or not torch.isfinite(Q.double()).all():
        raise ValueError("Q: expected finite real entries")
    if not _is_real(lam) or not lam >= 0 or not math.isfinite(lam):
        raise ValueError(f"lam: expected a finite number >= 0, found {lam!r}")
    if not _is_real(eta) or not eta > 0 or not math.isfinite(eta):
        raise ValueError(f"eta: expected a finite number > 0, found {eta!r}")


def _check_solver_settings(*, rho: float | None, max_iter: int, abs_tol: float, rel_tol: float) -> None:
    if rho is not None and (not _is_real(rho) or not rho > 0 or not math.isfinite(rho)):
        raise ValueError(f"rho: expected a finite number > 0 or None, found {rho!r}")
    if isinstance(max_iter, bool) or not isinstance(max_iter, int) or max_iter < 1:
        raise ValueError(f"max_iter: expected an integer >= 1, found {max_iter!r}")
    for name, value in (("abs_tol", abs_tol), ("rel_tol", rel_tol)):
        if not _is_real(value) or not value >= 0 or not math.isfinite(value):
            raise ValueError(f"{name}: expected a finite number >= 0, found {value!r}")


def _exact_state_without_penalty(Z_tilde: torch.Tensor, Q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(W^T, U^T)``, each ``(M, d)``, that solve the problem when ``lam = 0``: ``W = Z_tilde Q``, ``U = 0``."""
    w = Q.T @ Z_tilde.T
    return w, torch.zeros_like(w)


def _check_warm_start(state: AdmmState, *, like: torch.Tensor, n_edges: int) -> None:
    """Raise ValueError naming the field if ``state`` does not fit a problem like ``like`` with ``n_edges`` edges."""
    basis = getattr(state, "basis", None)
    if basis is None:
        expected, layout = (like.shape[0], n_edges), "(d, M)"
    else:
        if not isinstance(basis, torch.Tensor) or basis.ndim != 2 or basis.shape[0] != like.shape[0]:
            raise ValueError(f"warm_start.basis: expected shape ({like.shape[0]}, k), found {_describe(basis)}")
        expected, layout = (basis.shape[1], n_edges), "(k, M) coordinates"
    for name in ("W", "U"):
        value = getattr(state, name, None)
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != expected:
            raise ValueError(f"warm_start.{name}: expected shape {expected} {layout}, found {_describe(value)}")
    if not _is_real(state.rho) or not state.rho > 0 or not math.isfinite(state.rho):
        raise ValueError(f"warm_start.rho: expected a finite number > 0, found {state.rho!r}")


def _is_real(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float))


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return type(value).__name__
