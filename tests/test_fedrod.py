"""FedRoD: the balanced softmax by hand (classes, pixels, log-odds), the two heads and their gradients, what travels."""

import pytest
import torch
import torch.nn.functional as F
from monai.losses import DiceCELoss
from torch.utils.data import TensorDataset

from medfed.data.federation import Federation, SiteData
from medfed.federated.protocol import RoundContext
from medfed.federated.strategies.fedrod import FedRoD
from medfed.models.base import unwrap
from medfed.models.additive_head import generic_output
from medfed.models.segmentation import RegionLoss, UNetSegmenter
from medfed.models.tabular import LogisticRegression
from toy_federation import one_torch_thread  # noqa: F401 (autouse fixture)
from toy_federation import BatchNormClassifier, BodyHeadClassifier, build_loop, record_payloads, seeded, two_group_federation


def _imbalanced_federation(n_sites=2, positives=(6, 15), n=40):
    """Site s: n points in R^4, ``positives[s]`` of them labelled 1 (so log n_1 - log n_0 is far from 0)."""
    generator = torch.Generator().manual_seed(0)
    sites = []
    for s in range(n_sites):
        x = torch.randn(n, 4, generator=generator)
        y = (torch.arange(n) < positives[s]).long()
        sites.append(SiteData(f"site{s}", TensorDataset(x, y), TensorDataset(x, y)))
    return Federation("toy", sites, (4,), 2, "GENERATED imbalanced toy data", True)


def _half(model, gamma=1.0):
    """A FedRoD site half for ``model`` outside a federation (the model gets its personal head)."""
    FedRoD.prepare_slot("model", model)
    return FedRoD(FedRoD.Options(gamma=gamma), model.parameter_split, 1, 0).site_half(0)


@pytest.mark.parametrize("gamma", [1.0, 0.5])
def test_the_balanced_loss_is_the_cross_entropy_of_the_generic_logits_plus_gamma_log_class_counts(gamma):
    federation = _imbalanced_federation()
    loop = build_loop("fedrod", federation, seeded(BodyHeadClassifier, 4, 2), {"gamma": gamma})
    loop.setup()
    site = loop.sites[1]
    half, module = site.strategy, unwrap(site.module)
    half.receive(site.view, RoundContext(1, "fit"), {})  # the round's message (empty): the site's shift is computed
    (plan,) = half.plan(RoundContext(1, "fit"))
    x, y = federation.sites[1].train.tensors
    half.loss(site.view, RoundContext(1, "fit"), plan, (x, y))
    counts = torch.tensor([25.0, 15.0])  # counted by hand: 40 samples, 15 positive
    torch.testing.assert_close(half.shift, gamma * counts.log())
    logits = module.head(module.features(x))  # the generic predictor h_G(f(x))
    torch.testing.assert_close(half.balanced_loss(module, (x, y)), F.cross_entropy(logits + gamma * counts.log(), y))


def test_the_unet_balanced_loss_shifts_every_pixel_by_the_log_pixel_counts_of_the_site():
    options = UNetSegmenter.Options(channels=[4, 8], strides=[2], num_res_units=0)
    model = seeded(UNetSegmenter, 4, 2, options)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(3, 4, 8, 8, generator=generator)
    y = (torch.rand(3, 8, 8, generator=generator) < 0.15).long()
    half = _half(model)
    half.shift = model.log_prior(SiteData("site0", TensorDataset(x, y), TensorDataset(x, y)))
    counts = torch.stack([(y == 0).sum(), (y == 1).sum()]).float()  # pixels of each class over the training patches
    torch.testing.assert_close(half.shift, counts.log().reshape(2, 1, 1))
    with generic_output(model):
        logits = model(x)  # (3, 2, 8, 8)
    expected = DiceCELoss(to_onehot_y=True, softmax=True)(logits + counts.log()[None, :, None, None], y.unsqueeze(1))
    torch.testing.assert_close(half.balanced_loss(model, (x, y)), expected)


def test_a_log_odds_output_is_shifted_by_the_log_ratio_of_positives_to_negatives():
    # U-Net regions (one sigmoid per region) and the logistic regression: the two-logit BSM as a log-odds.
    options = UNetSegmenter.Options(channels=[4, 8], strides=[2], num_res_units=0)
    unet = seeded(UNetSegmenter, 4, 3, options, regions="brats")
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(2, 4, 8, 8, generator=generator)
    masks = (torch.rand(2, 3, 8, 8, generator=generator) < torch.tensor([0.4, 0.2, 0.1])[:, None, None]).to(torch.uint8)
    half = _half(unet)
    half.shift = unet.log_prior(SiteData("site0", TensorDataset(x, masks), TensorDataset(x, masks)))
    positives = masks.sum(dim=(0, 2, 3)).float()
    log_ratio = positives.log() - (128 - positives).log()  # 2 x 8 x 8 pixels per region
    torch.testing.assert_close(half.shift, log_ratio.reshape(3, 1, 1))
    with generic_output(unet):
        logits = unet(x)
    torch.testing.assert_close(half.balanced_loss(unet, (x, masks)), RegionLoss()(logits + log_ratio[None, :, None, None], masks.float()))

    regression = seeded(LogisticRegression, 4, 2)
    federation = _imbalanced_federation()
    x, y = federation.sites[0].train.tensors  # 6 positives of 40
    half = _half(regression)
    half.shift = regression.log_prior(federation.sites[0])
    shift = torch.tensor(6.0).log() - torch.tensor(34.0).log()
    torch.testing.assert_close(half.shift, shift)
    with generic_output(regression):
        log_odds = regression(x)
    torch.testing.assert_close(half.balanced_loss(regression, (x, y)), F.binary_cross_entropy_with_logits(log_odds + shift, y.float()))


def test_the_model_predicts_with_the_generic_logits_plus_the_personal_head_on_the_body_features():
    model = seeded(BodyHeadClassifier, 4, 2)
    FedRoD.prepare_slot("model", model)
    phi_weight, phi_bias = model.additive_head.phi
    torch.testing.assert_close(torch.cat([phi_weight.reshape(-1), phi_bias]), model.get_vector("personal"))  # phi starts as psi
    with torch.no_grad():
        phi_weight.normal_(generator=torch.Generator().manual_seed(3))
        phi_bias.fill_(0.3)
    x = torch.randn(7, 4, generator=torch.Generator().manual_seed(4))
    z = model.features(x)
    torch.testing.assert_close(model(x), model.head(z) + z @ phi_weight.T + phi_bias)
    with generic_output(model):
        torch.testing.assert_close(model(x), model.head(z))
    assert model.get_vector("all").numel() == 37 and model.get_vector("personal").numel() == 12  # phi is in no part


def test_body_and_generic_head_learn_from_the_balanced_loss_only_and_the_personal_head_from_the_empirical_loss_only():
    federation = _imbalanced_federation()
    loop = build_loop("fedrod", federation, seeded(BodyHeadClassifier, 4, 2))
    loop.setup()
    site = loop.sites[0]
    half, module = site.strategy, unwrap(site.module)
    half.receive(site.view, RoundContext(1, "fit"), {})  # the round's message (empty): the site's shift is computed
    (plan,) = half.plan(RoundContext(1, "fit"))
    with torch.no_grad():
        for phi in module.additive_head.phi:
            phi.mul_(-0.5)  # a personal head unlike the generic one
    x, y = federation.sites[0].train.tensors
    module.zero_grad()
    half.loss(site.view, RoundContext(1, "fit"), plan, (x, y)).backward()

    # The same step by hand, on fresh leaves.
    leaves = [p.detach().clone().requires_grad_(True) for p in (*module.body.parameters(), *module.head.parameters())]
    body_w, body_b, head_w, head_b = leaves
    phi_w, phi_b = (p.detach().clone().requires_grad_(True) for p in module.additive_head.phi)
    z = torch.tanh(x @ body_w.T + body_b)
    generic = z @ head_w.T + head_b
    balanced = F.cross_entropy(generic + torch.tensor([34.0, 6.0]).log(), y)
    empirical = F.cross_entropy(generic.detach() + z.detach() @ phi_w.T + phi_b, y)
    expected = torch.autograd.grad(balanced, (body_w, body_b, head_w, head_b)) + torch.autograd.grad(empirical, (phi_w, phi_b))
    actual = (module.body.weight, module.body.bias, module.head.weight, module.head.bias, *module.additive_head.phi)
    for parameter, gradient in zip(actual, expected, strict=True):
        torch.testing.assert_close(parameter.grad, gradient)


def test_a_step_moves_batchnorm_statistics_once_although_the_body_runs_three_times():
    federation = two_group_federation(n_sites=2)
    loop = build_loop("fedrod", federation, seeded(BatchNormClassifier, 4, 2))
    loop.setup()
    site = loop.sites[0]
    module = unwrap(site.module)
    module.train()
    x, y = (t[:16] for t in federation.sites[0].train.tensors)
    with torch.no_grad():
        hidden = module.hidden(x)
        mean = 0.9 * module.norm.running_mean + 0.1 * hidden.mean(0)
        var = 0.9 * module.norm.running_var + 0.1 * hidden.var(0)
    site.strategy.loss(site.view, RoundContext(1, "fit"), site.strategy.plan(RoundContext(1, "fit"))[0], (x, y)).backward()
    torch.testing.assert_close(module.norm.running_mean, mean)
    torch.testing.assert_close(module.norm.running_var, var)
    assert int(module.norm.num_batches_tracked) == 1


def test_only_the_body_and_the_generic_head_travel_and_the_server_averages_them():
    federation = two_group_federation(n_sites=4)
    loop = build_loop("fedrod", federation, seeded(BodyHeadClassifier, 4, 2))
    sent = record_payloads(loop)
    loop.fit(2)
    for _, direction, payload in sent:
        assert set(payload) <= ({"all", "buffers", "num_samples"} if direction == "up" else {"all", "buffers"})
        assert all(value.numel() in (0, 1, 37) for value in payload.values())  # body + generic head: 25 + 12; phi has 12
    replies = [payload for _, direction, payload in sent[-8:-4]]  # round 2: 4 messages, 4 replies, 4 deliveries
    assert all(set(payload) == {"all", "buffers", "num_samples"} for payload in replies)
    sizes = [float(len(site.train)) for site in federation.sites]
    mean = sum(n * payload["all"] for n, payload in zip(sizes, replies)) / sum(sizes)
    torch.testing.assert_close(loop.server.global_model, mean)
    phis = [torch.cat([p.detach().reshape(-1) for p in unwrap(site.module).additive_head.phi]) for site in loop.sites]
    initial = loop.initial["personal"]
    for site, phi in zip(loop.sites, phis):
        torch.testing.assert_close(site.module.get_vector("all"), mean)  # delivered: the generic model
        assert not torch.allclose(phi, initial)  # trained, at its site
        assert not any(torch.equal(phi, value) for _, _, payload in sent for value in payload.values())
    assert not torch.allclose(phis[0], phis[3])


def test_the_saved_evaluated_model_loads_into_a_model_prepared_like_the_slot():
    # `predict` builds a fresh model, prepares it as the strategy prepares its evaluated slot, and loads the checkpoint.
    loop = build_loop("fedrod", two_group_federation(n_sites=2), seeded(BodyHeadClassifier, 4, 2))
    loop.fit(1)
    saved = loop.sites[1].state_dict()["slots"]["model"]["module"]
    with pytest.raises(RuntimeError, match="additive_head"):
        seeded(BodyHeadClassifier, 4, 2, seed=5).load_state_dict(saved)
    fresh = seeded(BodyHeadClassifier, 4, 2, seed=5)
    FedRoD.prepare_slot("model", fresh)
    fresh.load_state_dict(saved)
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(6))
    torch.testing.assert_close(fresh(x), unwrap(loop.sites[1].module)(x))


def test_personal_heads_fit_what_the_generic_model_cannot():
    # Opposite label rules in the two groups: FedAvg's one model is near chance (about 0.5).
    loop = build_loop("fedrod", two_group_federation(n_sites=6), seeded(BodyHeadClassifier, 4, 2))
    loop.fit(10)
    assert loop.history[-1]["mean"]["accuracy"] > 0.85
