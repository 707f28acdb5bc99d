import pytest
import torch

from medfed.errors import ConfigError
from medfed.models.classification import NoduleClassifier
from medfed.models.segmentation import UNetSegmenter
from medfed.models.split import split_parameters

SMALL = UNetSegmenter.Options(channels=[4, 8, 16], strides=[2, 2], num_res_units=1)


@pytest.fixture
def unet():
    torch.manual_seed(0)
    return UNetSegmenter(4, 2, SMALL)


def test_default_unet_split_is_encoder_shared_decoder_personal(unet):
    split = unet.parameter_split
    assert split.personal, "the decoder must be personal"
    # MONAI UNet: index 2 of each nested Sequential is the up (decoder) path
    assert all(".2." in name.removeprefix("unet.model") or name.startswith("unet.model.2.") for name in split.personal)
    assert any(name.startswith("unet.model.0.") for name in split.shared)  # first down block
    assert set(split.shared).isdisjoint(split.personal)
    total = sum(p.numel() for p in unet.parameters())
    assert split.size("shared") + split.size("personal") == split.size("all") == total
    # the decoder's final layer maps to the 2 output classes
    assert any(unet.get_parameter(n).shape[0] == 2 for n in split.personal if n.endswith("weight"))


def test_vectors_round_trip_and_touch_only_their_part(unet):
    shared, personal = unet.get_vector("shared"), unet.get_vector("personal")
    unet.set_vector("personal", torch.arange(personal.numel(), dtype=torch.float32))
    assert torch.equal(unet.get_vector("shared"), shared)
    assert torch.equal(unet.get_vector("personal"), torch.arange(personal.numel(), dtype=torch.float32))
    everything = unet.get_vector("all")
    assert everything.numel() == shared.numel() + personal.numel()
    with pytest.raises(ValueError, match="shape"):
        unet.set_vector("shared", torch.zeros(3))


def test_set_trainable_freezes_the_other_part(unet):
    unet.set_trainable("personal")
    trainable = {n for n, p in unet.named_parameters() if p.requires_grad}
    assert trainable == set(unet.parameter_split.personal)
    unet.set_trainable(None)
    assert not any(p.requires_grad for p in unet.parameters())


def test_patterns_from_config(unet):
    everything_personal = split_parameters(unet, [r".*"])
    assert everything_personal.size("shared") == 0
    with pytest.raises(ConfigError, match="both"):
        split_parameters(unet, [r"unet"], shared_patterns=[r"bias"])
    with pytest.raises(ConfigError, match="neither"):
        split_parameters(unet, [r"\.2\."], shared_patterns=[r"model\.0\."])
    with pytest.raises(ConfigError, match="invalid regular expression"):
        split_parameters(unet, [r"("])


def test_densenet_buffers_vector_holds_every_float_buffer_in_model_order():
    torch.manual_seed(0)
    model = NoduleClassifier(1, 2)
    split = model.parameter_split
    floats = [name for name, buffer in model.named_buffers() if buffer.is_floating_point()]
    assert split.names("buffers") == tuple(floats) and len(floats) == 56  # 28 BatchNorm layers: running mean, var
    assert all(name.endswith(("running_mean", "running_var")) for name in floats)
    assert split.size("buffers") == sum(model.get_buffer(name).numel() for name in floats)
    expected = torch.cat([model.get_buffer(name).reshape(-1) for name in floats])
    assert torch.equal(model.get_vector("buffers"), expected)
    values = torch.arange(expected.numel(), dtype=torch.float32)
    parameters = model.get_vector("all")
    model.set_vector("buffers", values)
    assert torch.equal(model.get_vector("buffers"), values)
    assert torch.equal(model.get_vector("all"), parameters)  # buffers only
    assert int(model.densenet.features.norm0.num_batches_tracked) == 0  # integer buffers are in no vector


def test_batchnorm_free_vectors_leave_out_every_batchnorm_value():
    torch.manual_seed(0)
    model = NoduleClassifier(1, 2)
    split = model.parameter_split
    batchnorm = {name for name in split.batchnorm if not name.endswith("num_batches_tracked")}
    assert len(batchnorm) == 4 * 28  # weight, bias, running mean and variance of each layer
    assert set(split.names("all_except_batchnorm")) == set(split.names("all")) - batchnorm
    assert split.names("buffers_except_batchnorm") == ()
    assert split.size("all_except_batchnorm") == split.size("all") - sum(
        model.get_parameter(n).numel() for n in batchnorm if "running" not in n
    )
    unet = UNetSegmenter(4, 2, SMALL)  # instance normalisation only: nothing left out
    assert unet.parameter_split.names("all_except_batchnorm") == unet.parameter_split.names("all")


def test_only_parameter_parts_can_be_trained(unet):
    with pytest.raises(ValueError, match="can be trained"):
        unet.set_trainable("buffers")
