"""benchmarks/step_profile.py runs against this medfed's simulator and counts the operators a federation step dispatches."""

import importlib.util
import sys
from pathlib import Path

from toy_federation import one_torch_thread  # noqa: F401 (autouse fixture)

_spec = importlib.util.spec_from_file_location("step_profile", Path(__file__).parents[1] / "benchmarks" / "step_profile.py")
step_profile = importlib.util.module_from_spec(_spec)
sys.modules["step_profile"] = step_profile
_spec.loader.exec_module(step_profile)
throughput = step_profile.throughput

TINY = throughput.Setting("unet", "cpu", 32, 8, (2, 2), "32", False, 1, 1, 0.0)


def test_sites_in_turn_dispatch_n_times_one_sites_operators_and_stacked_sites_fewer_per_site():
    one, two = (step_profile.profiled_round(TINY, n, "sequential", warmup=1) for n in (1, 2))
    assert one["operators"] > 100 and two["operators"] == 2 * one["operators"]
    assert one["kernels"] == 0 and one["train_s"] > 0  # no CUDA on the CPU
    stacked = [step_profile.profiled_round(TINY, n, "batched", warmup=1)["operators"] for n in (2, 3)]
    assert 0 < stacked[1] - stacked[0] < one["operators"]  # one more stacked site adds less than one site's step
