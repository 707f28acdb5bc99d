"""benchmarks/throughput.py counts the samples each column trains: checked on a tiny case against the batches the model saw."""

import importlib.util
import sys
from pathlib import Path

import pytest

from medfed.models.tabular import LogisticRegression
from toy_federation import one_torch_thread  # noqa: F401 (autouse fixture)

_spec = importlib.util.spec_from_file_location("throughput", Path(__file__).parents[1] / "benchmarks" / "throughput.py")
throughput = importlib.util.module_from_spec(_spec)
sys.modules["throughput"] = throughput  # its dataclasses look their module up
_spec.loader.exec_module(throughput)


@pytest.fixture
def seen(monkeypatch):
    """The size of every batch the clinical model trains on (its ``training_step`` wrapped)."""
    sizes = []
    original = LogisticRegression.training_step

    def counting(self, batch, batch_idx):
        sizes.append(len(batch[0]))
        return original(self, batch, batch_idx)

    monkeypatch.setattr(LogisticRegression, "training_step", counting)
    return sizes


def _setting(rounds=2, warmup=1):
    return throughput.Setting("clinical", "cpu", 20, 16, None, "32", False, rounds, warmup, min_seconds=0.0)


def test_a_federated_column_counts_the_samples_of_its_measured_rounds(seen):
    measured = throughput.federated(_setting(), 2, "sequential")
    assert seen == [16, 4] * 2 * 3  # 2 sites of 20 samples at batch 16, 1 warm-up + 2 measured rounds
    assert measured.samples == 2 * 20 * 2 and measured.seconds > 0  # the measured rounds' samples only


def test_the_central_column_trains_the_pooled_samples_at_batch_16_n(seen):
    measured = throughput.central(_setting(rounds=2, warmup=1), 3)
    assert seen == [48, 12] * 3  # 60 pooled samples at batch 48, 1 + 2 epochs
    assert measured.samples == 2 * 60


def test_the_table_sets_the_ratios_side_by_side():
    columns = {"sequential": throughput.Measurement(100, 1.0), "batched": throughput.Measurement(300, 1.0), "batched compiled": None,
               "central": throughput.Measurement(400, 2.0), "central compiled": throughput.Measurement(800, 2.0)}
    header, _, line = throughput.table([throughput.Row(_setting(), 5, columns)]).splitlines()
    assert header.startswith("| device | model | N | sequential | batched | batched compiled | central | central compiled | batched / sequential |")
    assert line == "| cpu | clinical | 5 | 100 | 300 | - | 200 | 400 | 3.00 | - | 1.50 | - | 2.00 |"


def test_the_compiled_central_column_trains_whole_batches_of_16_n(seen):
    measured = throughput.central_compiled(_setting(rounds=2, warmup=1), 3)
    assert seen == [48] * 3  # 60 pooled samples: one whole batch of 48 an epoch (one shape), 1 + 2 epochs
    assert measured.samples == 2 * 48 and measured.seconds > 0


def test_the_densenet_row_trains_nodule_patches(seen):
    setting = throughput.Setting("densenet", "cpu", 20, 16, None, "32", False, 1, 0, min_seconds=0.0)
    assert setting.prototype().__class__.__name__ == "NoduleClassifier"
    assert throughput.federated(setting, 2, "sequential").samples == 2 * 20


def test_a_row_measured_in_turn_keeps_each_columns_fastest_measurement(seen):
    said = []
    row = throughput.measure(_setting(rounds=1, warmup=0), 2, ("sequential", "central"), repeats=2, say=said.append)
    parts = [line.split() for line in said]  # "cpu clinical N=2 sequential: 1,234 samples/s"
    assert [p[3] for p in parts] == ["sequential:", "central:"] * 2  # in turn
    assert row.columns["batched"] is None
    assert row.columns["sequential"].samples == 2 * 20 and row.columns["central"].samples == 2 * 20  # one round (epoch) each
    for name in ("sequential", "central"):
        fastest = max(float(p[4].replace(",", "")) for p in parts if p[3] == f"{name}:")
        assert row.columns[name].rate == pytest.approx(fastest, abs=0.5)  # printed to the unit
