import torch

from medfed.compression.codecs import make_codec
from medfed.federated.link import Link

KEYS = {"all": "all", "core": "all"}


def _link(up="dense", down="dense", initial=None, **options):
    initial = initial if initial is not None else {"all": torch.zeros(4000)}
    return Link({"name": up, **options}, {"name": down, **options}, KEYS, initial, torch.device("cpu"))


def test_dense_is_exact_and_counts_real_bytes():
    link = _link()
    payload = {"all": torch.randn(4000), "num_samples": torch.tensor([12.0]), "empty": torch.zeros(0)}
    received = link.send("up", payload)
    assert torch.equal(received["all"], payload["all"]) and torch.equal(received["num_samples"], payload["num_samples"])
    expected = len(make_codec("dense").encode(payload["all"])) + len(make_codec("dense").encode(payload["num_samples"]))
    assert link.bytes_sent == {"up": expected, "down": 0}
    assert link.dense_bytes["up"] == 4 * 4001


def test_lossy_codec_codes_changes_against_what_both_ends_know():
    generator = torch.Generator().manual_seed(0)
    initial = torch.randn(4000, generator=generator)
    link = _link("stc", "stc", initial={"all": initial}, sparsity=0.05)
    # the first message is coded against the initial model: sending it unchanged costs almost nothing
    unchanged = link.send("down", {"all": initial.clone()})["all"]
    assert torch.equal(unchanged, initial)
    # an update: the receiver gets reference + decoded sparse change, and both ends remember it
    trained = initial + 0.01 * torch.randn(4000, generator=generator)
    received = link.send("up", {"all": trained})["all"]
    change = received - initial
    assert 0 < int((change != 0).sum()) <= 200  # top 5% of 4000 entries
    assert torch.equal(link.known["all"], received)
    # prefixed keys ("core/3") are model vectors too and start from the "all" vector
    assert torch.equal(link.send("down", {"core/3": initial.clone()})["core/3"], initial)


def test_state_round_trip_preserves_residuals_and_counters():
    link = _link("stc", "dense", sparsity=0.01)
    update = torch.randn(4000, generator=torch.Generator().manual_seed(1))
    link.send("up", {"all": update})
    copy = _link("stc", "dense", sparsity=0.01)
    copy.load_state_dict(link.state_dict())
    assert copy.bytes_sent == link.bytes_sent and torch.equal(copy.known["all"], link.known["all"])
    follow_up = update * 0.5
    assert torch.equal(link.send("up", {"all": follow_up})["all"], copy.send("up", {"all": follow_up})["all"])


def test_gradient_keys_start_from_zero():
    link = Link({"name": "stc", "sparsity": 0.05}, {"name": "dense"}, {"gradient": "zeros"}, {}, torch.device("cpu"))
    gradient = torch.zeros(4000)
    gradient[:10] = torch.arange(1.0, 11.0)
    received = link.send("up", {"gradient": gradient})["gradient"]
    # top 5% of 4000 = 200 entries kept: all 10 non-zeros, sent as one magnitude (their mean) with their signs
    assert torch.equal(received[:10], torch.full((10,), 5.5)) and received[10:].abs().sum() == 0
