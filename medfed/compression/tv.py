"""CER, pFedNet's communication-efficient regulariser, solved exactly in O(d).

For a site's flattened update ``delta`` (shape (d,)) the site sends

    u = argmin_u  1/2 ||u - delta||^2 + w * ||Lambda u||_1
      = argmin_u  1/2 ||u - delta||^2
                  + w * (sum_{i < d-1} |u_i - u_{i+1}| + |u_{d-1}|)

with Lambda the d x d first-difference matrix whose last row is [0 ... 0 1]
(pFedNet, section IV; ``w`` is the paper's eta * gamma). The last term makes
this 1-D total-variation denoising of a chain of d + 1 nodes whose extra node
d is pinned to 0 (an "infinite-weight" data term), which is how it is solved
here.

Solver: the dynamic programme of Johnson (2013, "A dynamic programming
algorithm for the fused lasso and L0-segmentation"), as implemented in
glmgen's ``tf_dp``. A forward pass along the chain keeps the derivative of
the message a node passes on (the cost of everything behind it, as a function
of the next node's value): a piecewise-linear increasing function, clipped
to [-w, w], stored as a deque of knots. At node k it records the two points
tm_k <= tp_k where F_k' = -w and F_k' = +w, F_k being the cost behind and at
node k. The backward pass sets u_k = clip(u_next, tm_k, tp_k). Every knot is
pushed and popped at most once, so the cost is O(d) in the worst case.
(Condat's direct algorithm with the same pinned end was measured about twice
as fast on noise but quadratic on trends: 100 s instead of 50 ms on a ramp of
1.6M entries.)

Two cores: the chain is solved from both ends at once. One thread runs the
forward pass from the free end (node 0) upwards, another from the pinned node
downwards, in blocks claimed from a shared counter until one node m is left;
u_m minimises the two messages into it plus its own data term, and the two
backward passes run outwards from u_m, again at the same time. The threads
meet wherever their speeds take them, so a core that is busy elsewhere (for
instance with PyTorch's OpenMP workers, which spin for milliseconds after
every parallel operation) costs its share of the work, not the whole half.

Memory: float64 work values, about 70 d bytes resident (measured ~94 MB for
d = 1.3M), kept between calls by the two-core solver; no d x d matrix is
ever formed.

Useful facts (tests check them): u is piecewise constant; w = 0 gives delta;
u = 0 iff w >= max_k |delta_0 + ... + delta_k| (the dual variable is the
running sum of delta - u, bounded by w; at exactly that w rounding may leave
entries of ~1e-16 relative size); just below that threshold u is one constant
on 0..k* (k* the arg max) and 0 after it.
"""

from __future__ import annotations

import functools
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numba
import numpy as np
import torch

__all__ = ["cer", "zero_solution_threshold"]

PARALLEL_MIN_SIZE = 1 << 16
"""Vectors at least this long are solved from both ends at once when the process may use two cores."""

BLOCK_NODES = 1 << 15
"""Nodes a thread of the two-core solver claims at a time (about 0.5 ms of work)."""


# ---------------------------------------------------------------- kernels
#
# A message deque is rows knots[left..right] of (position, slope change,
# intercept change), sorted by position: the message's derivative is -w below
# every knot, and crossing a knot upwards adds its changes to the slope and
# intercept of the current line. A knot with no slope change is a jump.


@numba.njit(cache=True)
def _start_deque(lam, pinned, knots, centre):
    """Write the message into a chain's first node at rows around ``centre``; return (left, right).

    A free end receives no message (derivative 0 everywhere: a knot at -inf
    lifting -w to 0 and one at +inf lifting it to +w); the pinned node
    sends lam * |b - 0| (derivative -w below 0, +w above: a jump at 0).
    """
    if pinned:
        knots[centre, 0] = 0.0
        knots[centre, 1] = 0.0
        knots[centre, 2] = 2.0 * lam
        return centre, centre
    knots[centre - 1, 0] = -np.inf
    knots[centre - 1, 1] = 0.0
    knots[centre - 1, 2] = lam
    knots[centre, 0] = np.inf
    knots[centre, 1] = 0.0
    knots[centre, 2] = lam
    return centre - 1, centre


@numba.njit(cache=True, nogil=True)
def _forward_pass(y, lam, knots, bounds, start, stop, left, right):
    """Run the forward pass over nodes start..stop-1 of the chain ``y``; return the new (left, right).

    Args:
        y: (n,) float32 or float64 node values in pass order (any stride).
        lam: the penalty weight w > 0.
        knots: (rows, 3) float64; the deque knots[left..right] holds the
            message into node ``start``. A pass of n nodes from ``_start_deque``
            at centre c uses rows c - n - 1 .. c + n.
        bounds: (n, 2) float64, bounds[k] = (tm_k, tp_k) written for k in start..stop-1.
        start, stop: the nodes to process, 0 <= start <= stop <= n.
        left, right: the deque's current ends.
    """
    for k in range(start, stop):
        yk = np.float64(y[k])
        # F_k' = message' + (u - y_k): below every knot it is -lam + u - y_k,
        # above every knot lam + u - y_k (kept negated).
        a_lo = 1.0
        b_lo = -lam - yk
        a_hi = -1.0
        b_hi = yk - lam
        # Walk up from the lowest knot until F_k' exceeds -lam. A crossed
        # jump may carry F_k' over -lam: then tm is at that jump.
        lowest_crossed = -np.inf
        lo = left
        while lo <= right:
            if a_lo * knots[lo, 0] + b_lo > -lam:
                break
            a_lo += knots[lo, 1]
            b_lo += knots[lo, 2]
            lowest_crossed = knots[lo, 0]
            lo += 1
        tm = max((-lam - b_lo) / a_lo, lowest_crossed)
        # Walk down from the highest knot until F_k' drops below +lam; likewise
        # tp may sit at a jump. (No jump spans both: the message's jumps add
        # up to at most 2 lam, so F_k' cannot leap from below -lam to above +lam.)
        highest_crossed = np.inf
        hi = right
        while hi >= lo:
            if -a_hi * knots[hi, 0] - b_hi < lam:
                break
            a_hi += knots[hi, 1]
            b_hi += knots[hi, 2]
            highest_crossed = knots[hi, 0]
            hi -= 1
        tp = min((lam + b_hi) / (-a_hi), highest_crossed)
        bounds[k, 0] = tm
        bounds[k, 1] = tp
        # The next message's derivative is F_k' clipped to [-lam, lam]: the
        # knots walked over are dropped, two new ones bound the linear part.
        left = lo - 1
        right = hi + 1
        knots[left, 0] = tm
        knots[left, 1] = a_lo
        knots[left, 2] = b_lo + lam
        knots[right, 0] = tp
        knots[right, 1] = a_hi
        knots[right, 2] = b_hi + lam
    return left, right


@numba.njit(cache=True)
def _meet(y_m, lam, from_below, below_span, from_above, above_span):
    """u_m = argmin_b M_below(b) + M_above(b) + 1/2 (b - y_m)^2 for the two messages into node m.

    The derivative of the sum, -2 lam + b - y_m below every knot, is
    increasing. A walk up the two sorted deques ``from_below[below_span[0]
    ..below_span[1]]`` and ``from_above[...]``, merged, finds the piece
    between two knots where it crosses 0; the root is then solved on that
    piece with each message's line summed from its more accurate end
    (``_line_on_piece``).
    """
    a = 1.0
    b = -2.0 * lam - y_m
    lowest = -np.inf  # the piece is [lowest, highest]
    highest = np.inf
    i, i_end = below_span
    j, j_end = above_span
    while i <= i_end or j <= j_end:
        take_below = j > j_end or (i <= i_end and from_below[i, 0] <= from_above[j, 0])
        knot = from_below[i] if take_below else from_above[j]
        if a * knot[0] + b > 0.0:
            highest = knot[0]
            break
        a += knot[1]
        b += knot[2]
        lowest = knot[0]
        if take_below:
            i += 1
        else:
            j += 1
    a_below, b_below = _line_on_piece(from_below, below_span[0], i, i_end, lam)
    a_above, b_above = _line_on_piece(from_above, above_span[0], j, j_end, lam)
    root = -(b_below + b_above - y_m) / (1.0 + a_below + a_above)
    return min(max(root, lowest), highest)


@numba.njit(cache=True)
def _line_on_piece(knots, first, split, last, lam):
    """(slope, intercept) of a message's derivative between knots[split - 1] and knots[split].

    It is -lam plus the changes of knots first..split-1, or equally +lam
    minus those of knots split..last. A knot far from the piece can carry
    large coefficients that cancel with a neighbour's (a long fused segment
    whose slope is its node count, accumulated over as many nodes), so the
    two sums can differ by far more than rounding of the result: the sum
    whose terms have the smaller rounding-error estimate (``_knot_error``)
    is returned.
    """
    slope_lo, intercept_lo, error_lo = 0.0, -lam, 0.0
    for k in range(first, split):
        slope_lo += knots[k, 1]
        intercept_lo += knots[k, 2]
        error_lo += _knot_error(knots[k])
    slope_hi, intercept_hi, error_hi = 0.0, lam, 0.0
    for k in range(last, split - 1, -1):
        slope_hi -= knots[k, 1]
        intercept_hi -= knots[k, 2]
        error_hi += _knot_error(knots[k])
    if error_lo <= error_hi:
        return slope_lo, intercept_lo
    return slope_hi, intercept_hi


@numba.njit(cache=True)
def _knot_error(knot):
    """Estimated rounding error of a knot's (position, slope change, intercept change), in units of eps.

    The terms' size |slope| |x| + |intercept|, times |slope|: a knot's slope
    change counts the nodes its coefficients were accumulated over. An
    estimate to choose a summation order with, not a rigorous bound.
    """
    slope = abs(knot[1])
    size = abs(knot[2]) + (slope * abs(knot[0]) if slope > 0.0 else 0.0)  # jumps may sit at +-inf
    return max(1.0, slope) * size


@numba.njit(cache=True, nogil=True)
def _backtrack(bounds, value, out):
    """Backward pass: out[k] = clip(out[k + 1], tm_k, tp_k) for k = n-1 .. 0, with out[n] := ``value``."""
    for k in range(bounds.shape[0] - 1, -1, -1):
        value = min(max(value, bounds[k, 0]), bounds[k, 1])
        out[k] = value


# ---------------------------------------------------------------- solvers


def _solve_serially(y: np.ndarray, lam: float, out: np.ndarray) -> None:
    """Write argmin_u 1/2||u - y||^2 + lam ||Lambda u||_1 into ``out`` ((d,) like y; lam > 0), on one core.

    One forward pass from the free end y[0], then the backward pass from the
    pinned node d.
    """
    d = y.size
    knots, bounds = np.empty((2 * d + 2, 3)), np.empty((d, 2))
    left, right = _start_deque(lam, False, knots, d + 1)
    _forward_pass(y, lam, knots, bounds, 0, d, left, right)
    _backtrack(bounds, 0.0, out)


class _TwoCoreSolver:
    """The same minimiser from both ends of the chain at once (see the module docstring).

    The calling thread runs the pass from the free end, one worker thread the
    pass from the pinned end (the numba kernels release the GIL). Each claims
    ``block_nodes`` nodes at a time under a lock until only node m is left.

    The workspace is kept between calls and only grows: fresh arrays would
    be page-faulted in by both threads at once on every call, and concurrent
    page faults in one process serialise in the kernel (measured: no speed-up
    at all on some calls). Each pass gets knot rows for the whole chain,
    which are reserved but only use memory where a pass has written. A lock
    makes concurrent callers take turns.
    """

    def __init__(self, block_nodes: int = BLOCK_NODES) -> None:
        self.block_nodes = block_nodes
        self._lock = threading.Lock()
        self._claim_lock = threading.Lock()
        self._beside = ThreadPoolExecutor(max_workers=1, thread_name_prefix="medfed-cer")
        self._capacity = 0  # chain length the workspace holds
        self._knots: tuple[np.ndarray, np.ndarray] = ()  # per pass, (2 capacity + 2, 3)
        self._bounds = np.zeros((0, 2))  # (capacity, 2), indexed by node
        self._done = [0, 0]  # nodes claimed by the pass from each end

    def __call__(self, y: np.ndarray, lam: float, out: np.ndarray) -> None:
        """Write the minimiser for ``y`` ((d,), d >= 1) and weight ``lam`` > 0 into ``out``."""
        with self._lock:
            d = y.size
            self._reserve(d)
            bounds = self._bounds[:d]
            self._done = [0, 0]
            # Pass 0 runs over y from node 0, pass 1 over y reversed from node d-1.
            passes = [(y, bounds, False), (y[::-1], bounds[::-1], True)]
            from_above = self._beside.submit(self._forward, 1, *passes[1], lam)
            below_span = self._forward(0, *passes[0], lam)
            above_span = from_above.result()
            m = self._done[0]
            u_m = _meet(np.float64(y[m]), lam, self._knots[0], below_span, self._knots[1], above_span)
            out[m] = u_m
            above = self._beside.submit(_backtrack, bounds[::-1][: self._done[1]], u_m, out[::-1][: self._done[1]])
            _backtrack(bounds[:m], u_m, out[:m])
            above.result()

    def _forward(self, side: int, y: np.ndarray, bounds: np.ndarray, pinned: bool, lam: float) -> tuple[int, int]:
        """Run pass ``side`` block by block until the two passes leave one node between them."""
        knots = self._knots[side]
        left, right = _start_deque(lam, pinned, knots, self._capacity + 1)
        while True:
            with self._claim_lock:
                start = self._done[side]
                stop = start + min(self.block_nodes, y.size - 1 - sum(self._done))
                self._done[side] = stop
            if stop == start:
                return left, right
            left, right = _forward_pass(y, lam, knots, bounds, start, stop, left, right)

    def _reserve(self, d: int) -> None:
        """Grow the workspace to chains of ``d`` nodes (zeroed lazily by the OS, page by page)."""
        if d <= self._capacity:
            return
        self._knots = (np.zeros((2 * d + 2, 3)), np.zeros((2 * d + 2, 3)))
        self._bounds = np.zeros((d, 2))
        self._capacity = d


@functools.cache
def _two_core_solver() -> _TwoCoreSolver:
    """The process's two-core solver (built on first use; a forked child builds its own)."""
    return _TwoCoreSolver()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_two_core_solver.cache_clear)


def _cpu_count() -> int:
    """CPU cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _as_flat_numpy(delta: torch.Tensor | np.ndarray, name: str) -> np.ndarray:
    """Check that ``delta`` is a finite 1-D float32/float64 vector; return a NumPy view of it."""
    array = delta.detach().cpu().numpy() if isinstance(delta, torch.Tensor) else delta
    if not isinstance(array, np.ndarray):
        raise ValueError(f"{name}: expected a torch.Tensor or numpy.ndarray, got {type(delta).__name__}")
    if array.ndim != 1:
        raise ValueError(f"{name}: expected a flattened 1-D vector, got shape {tuple(array.shape)}")
    if array.dtype not in (np.float32, np.float64):
        raise ValueError(f"{name}: expected dtype float32 or float64, got {array.dtype}")
    if not np.isfinite(array).all():
        raise ValueError(f"{name}: contains NaN or infinite entries")
    return array


def cer(delta: torch.Tensor | np.ndarray, weight: float, cores: int | None = None) -> torch.Tensor | np.ndarray:
    """Exact CER: argmin_u 1/2||u - delta||^2 + weight * ||Lambda u||_1.

    Args:
        delta: (d,) float32 or float64 update, torch (any device) or NumPy.
        weight: w = eta * gamma in the paper's notation, in the units of delta;
            w >= 0. w = 0 returns a copy of delta.
        cores: 1 for the one-pass solver, 2 to solve from both ends at once;
            None picks 2 when d >= PARALLEL_MIN_SIZE and the process may run
            on two cores. The minimiser is the same (up to rounding).

    Returns:
        u: (d,) piecewise-constant vector of delta's type, dtype and device.

    Raises:
        ValueError: weight is negative or not finite, or delta is not a finite
            1-D float32/float64 vector.
    """
    weight = float(weight)
    if not np.isfinite(weight) or weight < 0:
        raise ValueError(f"weight: expected a finite number >= 0, got {weight}")
    if cores not in (None, 1, 2):
        raise ValueError(f"cores: expected None, 1 or 2, got {cores!r}")
    array = _as_flat_numpy(delta, "delta")
    if cores is None:
        cores = 2 if array.size >= PARALLEL_MIN_SIZE and _cpu_count() > 1 else 1
    out = np.empty_like(array)
    if weight == 0.0 or array.size == 0:
        out[...] = array
    else:
        solve = _two_core_solver() if cores == 2 else _solve_serially
        solve(array, weight, out)
    if isinstance(delta, torch.Tensor):
        return torch.from_numpy(out).to(delta.device)
    return out


def zero_solution_threshold(delta: torch.Tensor | np.ndarray) -> float:
    """Smallest weight for which ``cer(delta, weight)`` is the zero vector.

    Equals max_k |delta_0 + ... + delta_k| (running sums in float64).
    """
    array = _as_flat_numpy(delta, "delta")
    if array.size == 0:
        return 0.0
    return float(np.abs(np.cumsum(array, dtype=np.float64)).max())
