"""The run's torch thread count: configured, the resumed checkpoint's, or the cores free under the current load."""

import pytest

import medfed.threads
from medfed.threads import choose_threads


def _machine(monkeypatch, cores, load):
    monkeypatch.setattr(medfed.threads.os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)

    def getloadavg():
        if load is None:
            raise OSError("no load average")
        return (load, load, load)

    monkeypatch.setattr(medfed.threads.os, "getloadavg", getloadavg)


@pytest.mark.parametrize(
    ("cores", "load", "threads"),
    [(2, 0.0, 2), (2, 0.25, 2), (2, 0.3, 1), (2, 1.9, 1), (2, 10.0, 1), (8, 0.1, 8), (8, 3.0, 5), (8, 7.9, 1), (2, None, 1)],
)
def test_an_unset_thread_count_takes_the_free_cores_and_one_when_in_doubt(monkeypatch, cores, load, threads):
    _machine(monkeypatch, cores, load)
    choice = choose_threads(None)
    assert choice.threads == threads
    assert f"{cores} core(s)" in choice.reason and ("load unknown" if load is None else f"load average {load:.2f}") in choice.reason


def test_a_configured_or_checkpointed_count_wins_over_the_load(monkeypatch):
    _machine(monkeypatch, 2, 10.0)
    assert choose_threads(2).threads == 2 and choose_threads(2).reason == "trainer.num_threads"
    assert choose_threads(None, checkpoint_threads=2).threads == 2
    assert choose_threads(3, checkpoint_threads=2).threads == 3
