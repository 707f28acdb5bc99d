"""medfed.models.dropout: keyed masks, the same for a site alone and stacked under vmap; where medfed's models use them."""

import torch
from torch import nn

from medfed.models.classification import NoduleClassifier
from medfed.models.dropout import KeyedDropout, dropout, keyed, step_keys, uniform_from_key
from medfed.models.segmentation import UNetSegmenter
from medfed.options.models import DenseNetOptions, UNetOptions


def test_keyed_masks_are_the_same_alone_and_under_vmap():
    keys = step_keys([0, 1, 2, 3], 3, torch.device("cpu"))
    x = torch.ones(3, 8, 5)

    def masked(key, x):
        with keyed(key):
            return dropout(dropout(x, 0.5, True), 0.5, True)  # two calls in one step: two different masks

    alone = torch.stack([masked(keys[i], x[i]) for i in range(3)])
    stacked = torch.func.vmap(masked, randomness="error")(keys, x)  # no draw from any generator
    assert torch.equal(alone, stacked)
    survivors = (alone > 0).float().mean().item()  # about 1/4 survive two dropouts of 0.5, scaled by 4
    assert 0.1 < survivors < 0.4 and set(alone.unique().tolist()) <= {0.0, 4.0}
    assert not torch.equal(alone[0], alone[1])  # each key its own mask
    assert torch.equal(masked(keys[0], x[0]), alone[0])  # the same key, the same mask


def test_keys_are_seeded_and_consecutive():
    first = step_keys([7, 2, 1, 0, 0], 4, torch.device("cpu"))
    assert first.dtype == torch.int64 and torch.equal(first, step_keys([7, 2, 1, 0, 0], 4, torch.device("cpu")))
    assert torch.equal(first - first[0], torch.arange(4))
    assert not torch.equal(first, step_keys([7, 3, 1, 0, 0], 4, torch.device("cpu")))  # another site


def test_uniform_numbers_from_a_key():
    uniform = uniform_from_key(torch.tensor(12345), 0, torch.Size([200_000]), torch.device("cpu"))
    assert 0.0 <= uniform.min() and uniform.max() < 1.0
    counts = torch.histc(uniform, bins=10, min=0.0, max=1.0) / uniform.numel()
    assert (counts - 0.1).abs().max() < 0.005  # flat over [0, 1)
    assert abs(torch.corrcoef(torch.stack([uniform[:-1], uniform[1:]]))[0, 1].item()) < 0.01  # neighbours unrelated


def test_without_a_key_it_is_torchs_dropout():
    x = torch.ones(64)
    with torch.random.fork_rng():
        torch.manual_seed(3)
        ours = dropout(x, 0.3, True)
        torch.manual_seed(3)
        torchs = nn.functional.dropout(x, 0.3, True)
    assert torch.equal(ours, torchs)
    assert torch.equal(dropout(x, 0.3, False), x)


def test_channel_dropout_drops_whole_channels():
    x = torch.ones(4, 16, 3, 3)
    with keyed(torch.tensor(5)):
        y = KeyedDropout(0.5, channels=True)(x)
    per_channel = y.reshape(4, 16, 9)
    assert torch.all(per_channel.amin(dim=2) == per_channel.amax(dim=2))  # a channel is kept or dropped whole
    assert 0 < (per_channel[..., 0] == 0).sum() < 64


def test_medfeds_models_key_their_dropout_only_where_it_is_on():
    def kinds(model):
        return {type(m) for m in model.modules()}

    assert KeyedDropout not in kinds(UNetSegmenter(4, 2, UNetOptions(channels=[4, 8], strides=[2], dropout=0.0)))
    assert nn.Dropout not in kinds(UNetSegmenter(4, 2, UNetOptions(channels=[4, 8], strides=[2], dropout=0.2)))
    assert KeyedDropout in kinds(UNetSegmenter(4, 2, UNetOptions(channels=[4, 8], strides=[2], dropout=0.2)))
    densenet = NoduleClassifier(1, 2, DenseNetOptions(init_features=4, growth_rate=4, block_config=[1], dropout=0.2))
    keyed_layers = [m for m in densenet.modules() if isinstance(m, KeyedDropout)]
    assert keyed_layers and all(m.channels and m.p == 0.2 for m in keyed_layers)  # MONAI's DenseNet: Dropout2d
    assert nn.Dropout2d not in kinds(densenet)
