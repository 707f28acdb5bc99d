"""A run that learned nothing says so: exit status 2, one line, its results written (issue 24)."""

import json

import torch

from medfed.cli import main
from medfed.models.segmentation import UNetSegmenter


def _nan_loss(monkeypatch):
    """Every site's local training gives NaN weights, as a NaN volume at every site would."""
    real = UNetSegmenter.training_step
    monkeypatch.setattr(UNetSegmenter, "training_step", lambda self, batch, i: real(self, batch, i) * torch.nan)


def test_a_run_in_which_every_site_failed_every_round_ends_with_status_2_after_writing_its_results(
    tiny_run_config, tmp_path, monkeypatch, capsys
):
    _nan_loss(monkeypatch)
    status = main(["fit", "--config", str(tiny_run_config), "--quiet", "trainer.rounds=2", "federation.max_consecutive_failures=null"])
    error_lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("medfed: error")]
    assert status == 2 and len(error_lines) == 1
    (line,) = error_lines
    assert line.startswith("medfed: error: every site failed in every one of the 2 rounds (first: site0 in round 1")
    assert "nothing was learned" in line and "--resume" not in line
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert results["outcome"].startswith("failed: every site failed in every one of the 2 rounds")
    assert len(results["history"]) == 2 and {f["site"] for f in results["failures"]} == {"site0", "site1", "site2"}


def test_a_run_whose_sites_were_all_excluded_writes_its_rounds_and_ends_with_status_2(tiny_run_config, tmp_path, monkeypatch, capsys):
    _nan_loss(monkeypatch)
    status = main(["fit", "--config", str(tiny_run_config), "--quiet", "trainer.rounds=3", "federation.max_consecutive_failures=1"])
    error_lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("medfed: error")]
    assert status == 2 and len(error_lines) == 1
    assert error_lines[0].startswith("medfed: error: every site has been excluded") and "--resume" not in error_lines[0]
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert len(results["history"]) == 1 and set(results["excluded"]) == {"site0", "site1", "site2"}


def test_wandb_online_without_a_key_is_refused_before_any_data_is_read(tiny_run_config, tmp_path, monkeypatch, reading_forbidden, capsys):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    assert main(["fit", "--config", str(tiny_run_config), "--quiet", "logger.wandb=online"]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and error.startswith("medfed: error: config key 'logger.wandb' = 'online': no W&B API key here")
    assert not (tmp_path / "run").exists()
