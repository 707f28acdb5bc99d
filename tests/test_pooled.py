"""The pooled reference: a centralised run on the union of the training sets, one model evaluated at every site."""

import copy
import json
import logging

import pytest
import torch
from torch.utils.data import ConcatDataset, DataLoader, RandomSampler

from medfed.cli import main
from medfed.config import FederationConfig
from medfed.data.pooling import POOL_SITE, PooledCrops, PooledSamples, pool_training_data, pooled_training_set
from medfed.tasks import brats
from toy_federation import one_torch_thread  # noqa: F401 (autouse fixture)
from toy_federation import BatchNormClassifier, LinearOptions, build_loop, seeded, two_group_federation

ROUNDS, EPOCHS, BATCH, SEED = 3, 2, 8, 5


def _pooled_loop(federation, model):
    return build_loop("pooled", federation, model, batch_size=BATCH, local_epochs=EPOCHS, seed=SEED)


def test_the_pooled_model_is_a_centralised_run_on_the_union_and_every_site_is_evaluated_with_it():
    # The equivalence: one model, its optimiser, trained ROUNDS x EPOCHS full passes over
    # ConcatDataset(site 0's, site 1's, ... training sets), batches drawn by a RandomSampler and a
    # DataLoader sharing one generator that starts in the state of the pool site's data-order generator.
    federation = two_group_federation(n_sites=3, n_train=20)
    prototype = seeded(BatchNormClassifier, 4, 2, LinearOptions(lr=0.2))
    loop = _pooled_loop(federation, prototype)
    generator = torch.Generator()
    generator.set_state(loop.sites[POOL_SITE].orders.generator.get_state())
    loop.fit(ROUNDS)

    centralised = copy.deepcopy(prototype)
    union = ConcatDataset([site.train for site in federation.sites])
    loader = DataLoader(union, batch_size=BATCH, sampler=RandomSampler(union, generator=generator), generator=generator)
    optimizer = centralised.configure_optimizers()
    centralised.train()
    for _ in range(ROUNDS * EPOCHS):
        for batch in loader:
            optimizer.zero_grad()
            centralised.training_step(batch, 0).backward()
            optimizer.step()

    for site in loop.sites:
        for part in ("all", "buffers"):
            assert torch.equal(site.module.get_vector(part), centralised.get_vector(part)), (site.name, part)
        centralised.eval()
        with torch.no_grad():
            x, y = site.data.test.tensors
            accuracy = (centralised(x).argmax(dim=1) == y).double().mean().item()
        assert loop.history[-1]["metrics"][site.name]["accuracy"] == pytest.approx(accuracy)
    assert [set(record["train_loss"]) for record in loop.history] == [{"site0"}] * ROUNDS  # only the pool trains ...
    for record in loop.history:  # ... and only it sends anything
        assert [record["bytes"][site.name]["up"] > 0 for site in loop.sites] == [True, False, False]
    assert len(loop.sites[POOL_SITE].data.train) == sum(len(site.train) for site in federation.sites)
    assert [len(site.data.train) for site in loop.sites[1:]] == [len(site.train) for site in federation.sites[1:]]


def test_a_round_whose_pool_site_fails_leaves_every_site_with_the_last_model(caplog):
    loop = _pooled_loop(two_group_federation(n_sites=3), seeded(BatchNormClassifier, 4, 2))
    loop.fit(1)
    after_round_1 = loop.server.global_model.clone()
    pool = loop.sites[POOL_SITE]
    train = pool.train

    def fails_in_round_2(*args, **kwargs):
        if loop.round == 2:
            raise RuntimeError("pool unreachable")
        return train(*args, **kwargs)

    pool.train = fails_in_round_2
    with caplog.at_level(logging.WARNING, logger="medfed"):
        loop.fit(3)
    assert [failure["site"] for failure in loop.history[1]["failures"]] == ["site0"]
    assert loop.history[1]["train_loss"] == {} and "pool unreachable" in caplog.text
    assert loop.history[1]["metrics"] == loop.history[0]["metrics"]  # evaluated with round 1's model
    assert not torch.equal(loop.server.global_model, after_round_1)  # round 3 trained again
    assert all(torch.equal(site.module.get_vector("all"), loop.server.global_model) for site in loop.sites)


def test_pooling_fixed_training_sets_concatenates_them_without_copying_into_the_pool_site():
    federation = two_group_federation(n_sites=3, n_train=10)
    sites = pool_training_data(federation.sites)
    union = sites[POOL_SITE].train
    assert isinstance(union, PooledSamples) and not hasattr(union, "sampler")
    assert sites[1:] == federation.sites[1:] and sites[POOL_SITE].test is federation.sites[POOL_SITE].test
    assert len(union) == 10 + 18 + 26
    x, y = union[10 + 18 + 3]  # site 2's fourth sample
    assert torch.equal(x, federation.sites[2].train[3][0]) and torch.equal(y, federation.sites[2].train[3][1])
    for column, parts in zip(union.tensors, zip(*(site.train.tensors for site in federation.sites))):
        assert torch.equal(column, torch.cat(parts))


def test_pooling_random_crops_draws_fresh_crops_over_every_sites_slots(tiny_brats_root):
    options = brats.Options(root=str(tiny_brats_root), generate=None, patch_size=32, tumour_patches_per_case=4,
                            background_patches_per_case=2, train_sampling="random_crops")
    sites = brats.build_federation(options, FederationConfig(n_sites=3), seed=0, progress=False).sites
    union = pooled_training_set([site.train for site in sites])
    assert isinstance(union, PooledCrops) and len(union) == sum(len(site.train) for site in sites)
    first, second = len(sites[0].train), len(sites[1].train)
    for slot, (part, local) in {0: (0, 0), first + 2: (1, 2), first + second: (2, 0), len(union) - 1: (2, len(sites[2].train) - 1)}.items():
        for got, expected in zip(union[(slot, 1234)], sites[part].train.crop(local, 1234)):
            assert torch.equal(got, expected)
        for got, expected in zip(union[slot], sites[part].train[local]):  # the reference patch
            assert torch.equal(got, expected)
    keys = list(union.sampler(torch.Generator().manual_seed(0)))
    assert sorted(slot for slot, _ in keys) == list(range(len(union)))  # every slot of every site once per pass
    assert len({seed for _, seed in keys}) == len(keys)
    with pytest.raises(ValueError, match="only some draw fresh samples"):
        pooled_training_set([sites[0].train, two_group_federation(n_sites=1).sites[0].train])


def test_a_pooled_cli_run_with_random_crops_says_it_is_the_centralised_reference(tiny_run_config, tmp_path, capsys):
    output = tmp_path / "pooled"
    args = ["fit", "--config", str(tiny_run_config), "strategy.name=pooled", "data.train_sampling=random_crops", "trainer.rounds=1"]
    assert main([*args, f"output_dir={output}"]) == 0
    printed = capsys.readouterr().out
    results = json.loads((output / "results.json").read_text())
    sizes = [site["n_train"] for site in results["federation"]["sites"]]  # each site's own split, as in any run
    assert results["pooled"]["n_train"] == sum(sizes) and results["pooled"]["pool_site"] == "site0"
    assert results["pooled"]["reference"].startswith("POOLED (centralised) reference, not a federated method")
    assert results["pooled"]["reference"] in printed
    assert [row["site"] for row in results["sites"]] == ["site0", "site1", "site2"]
    assert set(results["history"][0]["train_loss"]) == {"site0"}
