"""The simulated hostile site (evaluation only): each attack on a hand-made update, seeded, and never silently none."""

import pytest
import torch

from medfed.config import AttackConfig
from medfed.federated.attack import Attack

CODED = {"all": "all", "shared": "shared"}


def _attacked(kind, seed=0, round_index=1, factor=100.0):
    attack = Attack(AttackConfig(sites=[2], kind=kind, factor=factor), CODED, seed)
    start = torch.tensor([1.0, -1.0, 0.5])
    attack.receive(2, {"all": start, "num_samples": torch.tensor([9.0])})
    trained = {"all": start + torch.tensor([0.3, 0.4, 0.0]), "buffers": torch.tensor([7.0]), "num_samples": torch.tensor([9.0])}
    return start, trained, attack.reply(2, round_index, 0, trained)


def test_scale_and_sign_flip_change_only_the_model_vectors_update():
    start, trained, scaled = _attacked("scale")
    torch.testing.assert_close(scaled["all"], start + 100 * torch.tensor([0.3, 0.4, 0.0]))
    _, _, flipped = _attacked("sign_flip")
    torch.testing.assert_close(flipped["all"], start - torch.tensor([0.3, 0.4, 0.0]))
    assert torch.linalg.vector_norm(flipped["all"] - start) == pytest.approx(0.5)  # the honest norm
    for altered in (scaled, flipped):
        assert torch.equal(altered["buffers"], trained["buffers"]) and torch.equal(altered["num_samples"], trained["num_samples"])


def test_gaussian_noise_has_the_honest_norm_and_is_seeded_by_run_site_and_round():
    start, _, first = _attacked("gaussian", seed=4)
    _, _, again = _attacked("gaussian", seed=4)
    _, _, other_round = _attacked("gaussian", seed=4, round_index=2)
    assert torch.equal(first["all"], again["all"]) and not torch.equal(first["all"], other_round["all"])
    assert torch.linalg.vector_norm(first["all"] - start) == pytest.approx(0.5, rel=1e-6)


def test_an_honest_site_is_untouched_and_a_hostile_reply_without_a_reference_is_an_error():
    attack = Attack(AttackConfig(sites=[2], kind="scale"), CODED, 0)
    reply = {"all": torch.ones(3)}
    assert attack.reply(0, 1, 0, reply) is reply
    with pytest.raises(ValueError, match=r"^attack: site2's reply 'all' has no value received under that key"):
        attack.reply(2, 1, 0, reply)
