"""Fused runs (medfed.federated.fused): runs of a grid in one process, their stacked groups trained as one step."""

import threading

import pytest
import torch

import medfed.federated.batched as batched
from medfed.federated.fused import FusedExecutor, FusedTraining
from medfed.models.dropout import dropout
from medfed.options.strategies import strategy_spec
from test_batched import _assert_alike
from toy_federation import one_torch_thread  # noqa: F401 (autouse fixture)
from toy_federation import LinearClassifier, LinearOptions, build_loop, seeded, two_group_federation

GRID = [(name, seed, lr) for name in ("fedavg", "fedprox") for seed in (0, 1) for lr in (0.02, 0.1)]
"""2 strategies x 2 seeds x 2 learning rates."""


class AdamClassifier(LinearClassifier):
    """Softmax regression with keyed dropout, trained by Adam at its options' learning rate."""

    def forward(self, x):
        return self.linear(dropout(x, 0.5, self.training))

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.options.lr, weight_decay=1e-3)


def _loop(name, seed, lr):
    """One run of the grid: its own data split (the seed's), initialisation and learning rate; four ragged sites."""
    federation = two_group_federation(n_sites=4, n_train=44, seed=seed)
    return build_loop(name, federation, seeded(AdamClassifier, 4, 2, LinearOptions(lr=lr), seed=seed), strategy_spec(name).smoke, seed=seed)


@pytest.fixture
def stacked(monkeypatch):
    """The rows of every stacked group trained (``train_group``'s calls): ``[(round, plan label, rows)]``."""
    calls = []
    original = batched.train_group

    def counting(rows, compiled=None):
        calls.append((rows[0].ctx.round, rows[0].plan.label, len(rows)))
        return original(rows, compiled)

    monkeypatch.setattr(batched, "train_group", counting)
    return calls


def _fused(loops, rounds=2):
    coordinator = FusedTraining()
    for loop in loops:
        loop.sites.executor = FusedExecutor(coordinator)
    errors = coordinator.run_all([lambda loop=loop: loop.fit(rounds) for loop in loops])
    return coordinator, errors


def _alone(cell, rounds=2):
    loop = _loop(*cell)
    loop.fit(rounds)
    return loop


def test_fused_runs_give_every_run_the_numbers_it_gets_alone(stacked):
    loops = [_loop(*cell) for cell in GRID]
    coordinator, errors = _fused(loops)
    assert errors == [None] * len(GRID)
    # each round: one stacked group of FedAvg's four runs and one of FedProx's, 4 runs x 4 sites each
    assert sorted(stacked) == [(1, "model", 16), (1, "model", 16), (2, "model", 16), (2, "model", 16)]
    for cell, fused in zip(GRID, loops):
        assert fused.sites.record() == {"name": "batched", "sequential_plans": {}, "fused": {"runs": len(GRID)}}
        _assert_alike(_alone(cell), fused)  # alone: the sequential executor, every site in turn


def test_a_run_that_fails_at_round_two_leaves_the_others_as_they_are_alone():
    loops = [_loop(*cell) for cell in GRID]
    failing = loops[5]
    original = failing._run_round

    def round_that_fails(round_index):
        if round_index == 2:
            raise RuntimeError("the run's own fault at round 2")
        return original(round_index)

    failing._run_round = round_that_fails
    coordinator, errors = _fused(loops, rounds=3)
    assert [str(error) if error else None for error in errors] == [None] * 5 + ["the run's own fault at round 2"] + [None] * 2
    assert len(failing.history) == 1
    for index, (cell, fused) in enumerate(zip(GRID, loops)):
        if index != 5:
            _assert_alike(_alone(cell, rounds=3), fused)


def test_groups_of_different_options_train_apart_in_one_process(stacked):
    cells = [("fedprox", 0, 0.05), ("fedprox", 1, 0.05)]
    loops = [_loop(*cells[0]), build_loop("fedprox", two_group_federation(n_sites=4, n_train=44, seed=1), seeded(AdamClassifier, 4, 2, LinearOptions(lr=0.05), seed=1), {"mu": 0.05}, seed=1)]
    coordinator, errors = _fused(loops)
    assert errors == [None, None]
    assert sorted(stacked) == [(1, "model", 4)] * 2 + [(2, "model", 4)] * 2  # mu enters the loss: each run's own group
    alone = build_loop("fedprox", two_group_federation(n_sites=4, n_train=44, seed=1), seeded(AdamClassifier, 4, 2, LinearOptions(lr=0.05), seed=1), {"mu": 0.05}, seed=1)
    alone.fit(2)
    _assert_alike(alone, loops[1])


def test_only_one_fused_run_runs_at_a_time():
    running, most = [], []
    lock = threading.Lock()
    loops = [_loop(*cell) for cell in GRID[:4]]
    coordinator = FusedTraining()

    def body(loop):
        def fit():
            for _ in range(3):
                with lock:
                    running.append(loop)
                    most.append(len(running))
                torch.zeros(1000).sum()  # a moment of work, the GIL released
                with lock:
                    running.remove(loop)
        return fit

    assert coordinator.run_all([body(loop) for loop in loops]) == [None] * 4
    assert max(most) == 1


def test_a_fused_run_alone_is_a_run_alone(stacked):
    loops = [_loop(*GRID[0])]
    coordinator, errors = _fused(loops, 1)
    assert errors == [None] and stacked == [(1, "model", 4)]
    _assert_alike(_alone(GRID[0], 1), loops[0])


def test_a_stacked_step_that_raises_trains_every_row_as_it_would_alone():
    from test_batched import RandomLoss  # its loss draws from the global generator: no stacked step can run it

    def loop(seed):
        return build_loop(RandomLoss, two_group_federation(n_sites=4, n_train=44, seed=seed), seeded(AdamClassifier, 4, 2, LinearOptions(lr=0.05), seed=seed), seed=seed)

    fused = [loop(0), loop(1)]
    coordinator, errors = _fused(fused)
    assert errors == [None, None]
    for seed, run in enumerate(fused):
        (reason,) = run.sites.record()["sequential_plans"].values()
        assert "stacked step raised" in reason  # the rows one at a time, each in its site's stream
        alone = loop(seed)
        alone.fit(2)
        for a, b in zip(alone.sites, run.sites):
            assert torch.equal(a.module.get_vector("all"), b.module.get_vector("all"))
