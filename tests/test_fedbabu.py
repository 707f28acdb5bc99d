"""FedBABU: the head frozen at its initialisation, the bodies averaged, the head fine-tuned by the adapt step; adapt failures."""

import logging

import pytest
import torch

from medfed.errors import SiteFailure
from medfed.federated.strategies.fedbabu import head_names
from medfed.models.base import unwrap
from toy_federation import one_torch_thread  # noqa: F401 (autouse fixture)
from toy_federation import BatchNormClassifier, BodyHeadClassifier, LinearClassifier, build_loop, seeded, two_group_federation

HEAD = ("output.weight", "output.bias")  # BatchNormClassifier's last layer


def _loop(options=None, participation=1.0, **faults):
    federation = two_group_federation(n_sites=4, n_train=37)
    return build_loop("fedbabu", federation, seeded(BatchNormClassifier, 4, 2), options, participation=participation, batch_size=8, **faults)


def _vector(module, names):
    parameters = dict(unwrap(module).named_parameters())
    return torch.cat([parameters[name].detach().reshape(-1) for name in names])


def test_the_head_is_the_last_layer_and_every_slot_is_split_into_body_and_head():
    loop = _loop()
    assert head_names(loop.strategy.split) == HEAD
    for name in ("global", "personalised"):
        split = loop.sites[0].slot(name).module.parameter_split
        assert split.personal == HEAD and split.shared == ("hidden.weight", "hidden.bias", "norm.weight", "norm.bias")


def test_the_head_never_trains_the_bodies_are_averaged_and_each_site_fine_tunes_its_head_to_be_evaluated():
    prototype = seeded(BatchNormClassifier, 4, 2)
    loop = _loop()
    replies = {}
    for site in loop.sites:
        def recording(view, ctx, reply=site.strategy.reply, index=site.index):
            replies[index] = {key: value.clone() for key, value in reply(view, ctx).items()}
            return replies[index]

        site.strategy.reply = recording
    loop.fit(2)
    sizes = torch.tensor([float(site.n_train) for site in loop.sites], dtype=torch.float64)
    average = sum(sizes[i] * replies[i]["body"].double() for i in replies) / sizes.sum()
    torch.testing.assert_close(loop.server.global_model.double(), average)  # FedAvg of the bodies
    for site in loop.sites:
        trained, evaluated = site.slot("global").module, site.slot("personalised").module
        assert torch.equal(_vector(trained, HEAD), _vector(prototype, HEAD))  # frozen at its initialisation
        assert torch.equal(trained.get_vector("shared"), loop.server.global_model)  # delivered
        assert torch.equal(evaluated.get_vector("shared"), trained.get_vector("shared"))  # only the head fine-tuned
        assert not torch.equal(_vector(evaluated, HEAD), _vector(prototype, HEAD))
        assert site.module is evaluated
    record = loop.history[-1]
    assert set(record["adapt_loss"]) == set(loop.site_names) and all(set(v) == {"adapt"} for v in record["adapt_loss"].values())
    for name in loop.site_names:
        assert record["compute"][name]["adapt/finetune"] == 1.0  # one epoch of fine-tuning per evaluation


def test_fine_tuning_never_feeds_back_into_federated_training():
    short, long = _loop({"finetune_steps": 1}, participation=0.75), _loop({"finetune_steps": 7}, participation=0.75)
    short.fit(3)
    long.fit(3)
    assert [r["train_loss"] for r in short.history] == [r["train_loss"] for r in long.history]
    for a, b in zip(short.sites, long.sites):
        assert torch.equal(a.slot("global").module.get_vector("all"), b.slot("global").module.get_vector("all"))
        assert not torch.equal(a.module.get_vector("all"), b.module.get_vector("all"))
        assert torch.equal(a.orders.generator.get_state(), b.orders.generator.get_state())  # the training data order too


def test_fine_tuning_the_whole_model_moves_the_body_of_the_evaluated_model_only():
    loop = _loop({"finetune_part": "all"})
    loop.fit(1)
    for site in loop.sites:
        assert not torch.equal(site.module.get_vector("shared"), site.slot("global").module.get_vector("shared"))


def test_on_a_model_of_one_layer_it_is_fedavg_with_the_whole_model_fine_tuned():
    federation = two_group_federation(n_sites=3, n_train=37)
    fedbabu = build_loop("fedbabu", federation, seeded(LinearClassifier, 4, 2), participation=2 / 3, batch_size=8)
    fedavg = build_loop("fedavg", federation, seeded(LinearClassifier, 4, 2), participation=2 / 3, batch_size=8)
    fedbabu.fit(2)
    fedavg.fit(2)
    assert head_names(fedbabu.strategy.split) == ()
    assert [r["train_loss"] for r in fedbabu.history] == [r["train_loss"] for r in fedavg.history]
    for a, b in zip(fedbabu.sites, fedavg.sites):
        assert torch.equal(a.slot("global").module.get_vector("all"), b.module.get_vector("all"))  # FedAvg's model
        assert a.module.parameter_split.personal == ()  # all body: the whole model is fine-tuned to be evaluated
        assert not torch.equal(a.module.get_vector("all"), b.module.get_vector("all"))
    assert fedbabu.history[-1]["compute"]["site0"]["adapt/finetune"] == 1.0


def _failing_adapt(loop, index, rounds):
    """Site ``index``'s adapt step raises in ``rounds`` (at its first step, after the delivery loaded the model)."""
    half = loop.sites[index].strategy

    def loss(view, ctx, plan, batch, loss=half.loss):
        if ctx.phase == "adapt" and ctx.round in rounds:
            raise RuntimeError("scanner archive unreachable")
        return loss(view, ctx, plan, batch)

    half.loss = loss


def test_an_adapt_step_that_raises_drops_the_site_which_is_evaluated_with_the_delivered_model(caplog):
    loop = _loop()
    _failing_adapt(loop, 1, {2})
    with caplog.at_level(logging.WARNING, logger="medfed"):
        loop.fit(3)
    failure = {"round": 2, "site": "site1", "phase": "adapt", "reason": "RuntimeError: scanner archive unreachable"}
    assert [r["failures"] for r in loop.history] == [[], [failure], []]
    assert "round 2: site site1 failed its adapt step and is evaluated unadapted" in caplog.text
    assert "site1" not in loop.history[1]["adapt_loss"] and "adapt/finetune" not in loop.history[1]["compute"]["site1"]
    assert set(loop.history[2]["adapt_loss"]) == set(loop.site_names)  # round 3 adapts again

    again = _loop()
    _failing_adapt(again, 1, {2})
    again.fit(2)
    site = again.sites[1]
    for part in ("all", "buffers"):  # put back to what the delivery left: the global model
        assert torch.equal(site.module.get_vector(part), site.slot("global").module.get_vector(part))
    unadapted = site.evaluate()
    assert again.history[-1]["metrics"]["site1"] == unadapted
    assert "finetune" in site.orders.named  # made at round 1's fine-tuning, put back, not dropped


def test_an_adapt_step_failing_rounds_in_a_row_excludes_the_site_and_stop_ends_the_run():
    loop = _loop(max_consecutive_failures=2)
    _failing_adapt(loop, 2, {1, 2})
    loop.fit(3)
    assert [r["excluded"] for r in loop.history] == [[], ["site2"], []]
    assert "site2" not in loop.history[2]["participants"] and "site2" in loop.history[2]["metrics"]

    stopping = _loop(on_site_failure="stop")
    _failing_adapt(stopping, 0, {1})
    with pytest.raises(SiteFailure, match=r"^site site0 failed in round 1 \(adapt phase\): RuntimeError: scanner archive unreachable$"):
        stopping.fit(1)


def test_a_body_head_model_keeps_its_own_split_for_the_other_strategies():
    # FedBABU re-splits its own slots; the prototype's split (what the server knows) is the configured one
    model = seeded(BodyHeadClassifier, 4, 2)
    loop = build_loop("fedbabu", two_group_federation(n_sites=2), model)
    assert loop.strategy.split.personal == ("head.weight", "head.bias") == model.parameter_split.personal
    assert loop.strategy.body_mask.tolist() == [True] * (5 * 4 + 5) + [False] * (2 * 5 + 2)
