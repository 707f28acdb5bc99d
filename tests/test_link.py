"""The link: real bytes, one known value per key, and error feedback that converges and delivers a site's changes."""

import io

import numpy as np
import pytest
import torch

from medfed.compression.codecs import make_codec
from medfed.federated.link import Link

KEYS = {"all": "all", "core": "all"}
D = 40_000
MESSAGES = 60
GAMMA = 0.05
LOSSY = {
    "stc": {"sparsity": 1 / 400},
    "cer": {"gamma": GAMMA},
    "cer+stc": {"gamma": GAMMA, "sparsity": 1 / 400},
}
CODECS = {"dense": {}, **LOSSY}


def _link(up="dense", down="dense", initial=None, **options):
    """A link on KEYS with the same codec options both ways."""
    initial = initial if initial is not None else {"all": torch.zeros(4000)}
    return Link({"name": up, **options}, {"name": down, **options}, KEYS, initial, torch.device("cpu"))


def _same_codec_link(name: str, initial: torch.Tensor) -> Link:
    """A link coding model vectors with codec ``name`` (options from CODECS) both ways, starting from ``initial``."""
    spec = {"name": name, **CODECS[name]}
    return Link(spec, spec, KEYS, {"all": initial}, torch.device("cpu"))


def _model_change(seed: int, d: int = D) -> torch.Tensor:
    """A model-update-like (d,) vector: piecewise-constant N(0, 1) levels (mean run 50) plus N(0, 0.1^2) noise."""
    rng = np.random.default_rng(seed)
    levels = rng.standard_normal(d // 50)
    signal = np.repeat(levels, rng.multinomial(d, np.full(levels.size, 1 / levels.size)))
    return torch.from_numpy((signal + 0.1 * rng.standard_normal(d)).astype(np.float32))


def _relative_error(target: torch.Tensor, copy: torch.Tensor, start: torch.Tensor) -> float:
    """||target - copy|| / ||target - start||."""
    return float(torch.linalg.vector_norm(target - copy) / torch.linalg.vector_norm(target - start))


def test_dense_is_exact_and_counts_real_bytes():
    link = _link()
    payload = {"all": torch.randn(4000), "num_samples": torch.tensor([12.0]), "empty": torch.zeros(0)}
    received = link.send("up", payload)
    assert torch.equal(received["all"], payload["all"]) and torch.equal(received["num_samples"], payload["num_samples"])
    expected = len(make_codec("dense").encode(payload["all"])) + len(make_codec("dense").encode(payload["num_samples"]))
    assert link.bytes_sent == {"up": expected, "down": 0}
    assert link.dense_bytes["up"] == 4 * 4001


@pytest.mark.parametrize("direction", ["up", "down"])
@pytest.mark.parametrize("name", list(CODECS))
def test_the_receivers_copy_of_a_fixed_target_converges(name, direction):
    initial = torch.randn(D, generator=torch.Generator().manual_seed(0))
    target = initial + _model_change(1)
    link = _same_codec_link(name, initial)
    errors = [_relative_error(target, link.send(direction, {"all": target})["all"], initial) for _ in range(MESSAGES)]
    if name == "dense":
        assert errors == [0.0] * MESSAGES
        return
    # the unsent part A = target - copy only shrinks: each message moves the copy towards the target
    assert all(later <= earlier * (1 + 1e-6) for earlier, later in zip(errors[2:], errors[3:], strict=False)), errors
    assert errors[-1] < {"stc": 0.7, "cer": 0.1, "cer+stc": 0.7}[name], errors


def test_cer_never_leaves_more_than_two_gamma_unsent_per_entry():
    # CER's output u = prox(x) leaves x - u = Lambda^T z with |z| <= gamma: at most 2 gamma per entry.
    # Coding target - copy makes that bound hold after every message, however the target moves.
    initial = torch.zeros(D)
    link = _link("cer", "cer", initial={"all": initial}, gamma=GAMMA)
    target = initial.clone()
    for seed in range(10):
        target = target + 0.1 * _model_change(seed)
        received = link.send("up", {"all": target})["all"]
        assert float((target - received).abs().max()) <= 2 * GAMMA * (1 + 1e-4)


@pytest.mark.parametrize("name", list(CODECS))
def test_alternating_traffic_with_small_training_changes_stays_bounded(name):
    # As the loop runs: the server sends its model down, the site starts from what it received,
    # trains a little and replies up, on the same key, round after round.
    generator = torch.Generator().manual_seed(2)
    initial = torch.randn(D, generator=generator)
    server_model = initial + _model_change(3)
    link = _same_codec_link(name, initial)
    down_errors, up_errors = [], []
    for _ in range(30):
        site_model = link.send("down", {"all": server_model})["all"]
        down_errors.append(_relative_error(server_model, site_model, initial))
        site_model = site_model + 0.01 * torch.randn(D, generator=generator)  # a little local training
        at_server = link.send("up", {"all": site_model})["all"]
        up_errors.append(_relative_error(site_model, at_server, initial))
    assert max(down_errors) <= 1.0 and max(up_errors) <= 1.0, (down_errors, up_errors)
    assert down_errors[-1] < down_errors[0] or down_errors[0] == 0.0


def test_both_directions_share_the_known_value_of_a_key():
    generator = torch.Generator().manual_seed(0)
    initial = torch.randn(4000, generator=generator)
    link = _link("stc", "stc", initial={"all": initial}, sparsity=0.05)
    # the first message of a key is coded against the initial model: an unchanged one costs no entries
    assert torch.equal(link.send("down", {"all": initial.clone()})["all"], initial)
    trained = initial + 0.01 * torch.randn(4000, generator=generator)
    down = link.send("down", {"all": trained})["all"]
    assert 0 < int((down != initial).sum()) <= 200  # top 5% of 4000 entries
    # the site replies with what it received: the server holds it already, nothing is re-sent
    assert torch.equal(link.send("up", {"all": down.clone()})["all"], down)
    # prefixed keys ("core/3") are model vectors too, starting from the "all" vector
    assert torch.equal(link.send("down", {"core/3": initial.clone()})["core/3"], initial)


@pytest.mark.parametrize("name", list(LOSSY))
def test_a_fixed_server_target_converges_while_the_site_echoes_it(name):
    # The server keeps sending S; the site trains nothing and replies with what it received.
    # Its replies owe nothing and send nothing, and the down messages' deficit is not added
    # again (the old link's down residual counted it twice and ran away): the site's copy
    # converges to S as on a one-way stream.
    initial = torch.randn(D, generator=torch.Generator().manual_seed(4))
    server_model = initial + _model_change(5)
    link = _same_codec_link(name, initial)
    errors = []
    for _ in range(MESSAGES):
        received = link.send("down", {"all": server_model})["all"]
        assert torch.equal(link.send("up", {"all": received})["all"], received)
        errors.append(_relative_error(server_model, received, initial))
    assert all(later <= earlier * (1 + 1e-6) for earlier, later in zip(errors[2:], errors[3:], strict=False)), errors
    assert errors[-1] < {"stc": 0.7, "cer": 0.1, "cer+stc": 0.7}[name], errors


@pytest.mark.parametrize("name", list(LOSSY))
def test_fedavg_traffic_delivers_every_sites_training_changes(name):
    # FedAvg as the loop runs it: the server sends its global model to each site, each site
    # starts from what it received, adds its training change and replies; the server averages
    # the replies. Over the rounds the server must receive the sum of each site's changes
    # (Sattler's error feedback): sum_t (reply_t - received_t) -> sum_t change_t.
    # STC keeps 1/20 here: at 1/400 its residual needs hundreds of rounds to reach its steady size
    n_sites, rounds = 3, 40
    initial = torch.randn(D, generator=torch.Generator().manual_seed(7))
    options = {**LOSSY[name], "sparsity": 1 / 20} if "stc" in name else LOSSY[name]
    links = [_link(name, name, initial={"all": initial}, **options) for _ in range(n_sites)]
    global_model = initial.clone()
    trained = torch.zeros(n_sites, D)
    delivered = torch.zeros(n_sites, D)
    errors = []
    for round_ in range(rounds):
        replies = []
        for i, link in enumerate(links):
            received = link.send("down", {"all": global_model})["all"]
            change = 0.1 * (_model_change(1000 + i) + _model_change(100 * round_ + i))  # a drift and noise
            reply = link.send("up", {"all": received + change})["all"]
            trained[i] += change
            delivered[i] += reply - received
            replies.append(reply)
        global_model = torch.stack(replies).mean(dim=0)
        errors.append(float(torch.linalg.vector_norm(trained - delivered) / torch.linalg.vector_norm(trained)))
    # what is not delivered yet is the last residual, bounded while the sum of changes grows
    assert errors[-1] < 0.5 * errors[rounds // 4] and errors[-1] < 0.25, errors


def test_checkpoint_mid_stream_continues_bit_identically():
    def drive(link: Link, rounds: range) -> list[torch.Tensor]:
        received = []
        for round_ in rounds:
            payload = {"all": _model_change(round_, 4000), "num_samples": torch.tensor([float(round_)])}
            received += [link.send("down", payload)["all"], link.send("up", payload)["all"]]
        return received

    def new_link() -> Link:
        up, down = {"name": "cer+stc", "gamma": GAMMA, "sparsity": 0.01}, {"name": "stc", "sparsity": 0.01}
        return Link(up, down, KEYS, {"all": torch.zeros(4000)}, torch.device("cpu"))

    original = new_link()
    drive(original, range(3))
    buffer = io.BytesIO()
    torch.save(original.state_dict(), buffer)  # the way checkpoints store it
    buffer.seek(0)
    restored = new_link()
    restored.load_state_dict(torch.load(buffer))
    assert restored.bytes_sent == original.bytes_sent and restored.dense_bytes == original.dense_bytes
    continued, resumed = drive(original, range(3, 6)), drive(restored, range(3, 6))
    assert all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(continued, resumed, strict=True))
    assert restored.bytes_sent == original.bytes_sent
    # the state matters: a fresh link sends something else
    assert not torch.equal(drive(new_link(), range(3, 4))[0], continued[0])


def test_load_state_dict_rejects_a_state_of_another_layout():
    link = _link("stc", "stc")
    with pytest.raises(ValueError, match="link state"):
        link.load_state_dict({"copies": {}, "bytes_sent": {}, "dense_bytes": {}, "codec_seconds": 0.0})


def test_gradient_keys_start_from_zero():
    link = Link({"name": "stc", "sparsity": 0.05}, {"name": "dense"}, {"gradient": "zeros"}, {}, torch.device("cpu"))
    gradient = torch.zeros(4000)
    gradient[:10] = torch.arange(1.0, 11.0)
    received = link.send("up", {"gradient": gradient})["gradient"]
    # top 5% of 4000 = 200 entries kept: all 10 non-zeros, sent as one magnitude (their mean) with their signs
    assert torch.equal(received[:10], torch.full((10,), 5.5)) and received[10:].abs().sum() == 0


def test_bad_direction_is_rejected():
    with pytest.raises(ValueError, match="direction"):
        _link().send("sideways", {"all": torch.zeros(4000)})


def test_a_model_sized_tensor_under_an_undeclared_key_is_refused():
    initial = {"all": torch.zeros(D), "shared": torch.zeros(D - 300), "personal": torch.zeros(300), "buffers": torch.zeros(400)}
    link = Link({"name": "stc", "sparsity": 0.1}, {"name": "dense"}, {"all": "all"}, initial, torch.device("cpu"))
    for key, size, part in (("weights", D, "all"), ("head", 300, "personal")):
        with pytest.raises(ValueError, match=f"payload '{key}' \\(up\\) holds {size} values, the size of the model part '{part}'.*coded_keys"):
            link.send("up", {key: torch.ones(size)})
    assert link.bytes_sent == {"up": 0, "down": 0}  # refused before anything was sent
    received = link.send("up", {"all": torch.ones(D), "buffers": torch.ones(400), "num_samples": torch.tensor([3.0])})
    assert torch.equal(received["buffers"], torch.ones(400))  # buffers and small entries travel dense


@pytest.mark.parametrize("up,down", [("dense", "dense"), ("cer+stc", "cer+stc"), ("stc", "dense"), ("dense", "cer")])
def test_two_ends_send_the_same_bytes_and_decode_the_same_values_as_one_link(up, down):
    # A deployment keeps one Link at the server and one at the site (encode at the sender, decode at the
    # receiver, each with its own K, A, O); the simulator keeps one Link for both. Same bytes, same values.
    initial = torch.randn(D, generator=torch.Generator().manual_seed(0))
    specs = ({"name": up, **CODECS[up]}, {"name": down, **CODECS[down]})
    one, server, site = (Link(*specs, KEYS, {"all": initial}, torch.device("cpu")) for _ in range(3))
    ends = {"down": (server, site), "up": (site, server)}
    sent_bytes = {"up": 0, "down": 0}
    target = initial.clone()
    for message in range(12):
        direction = "down" if message % 3 != 2 else "up"  # two down messages in a row: the site's A waits in O
        target = target + 0.1 * _model_change(100 + message)
        payload = {"all": target, "num_samples": torch.tensor([5.0 + message]), "empty": torch.zeros(0), "core/1": target.flip(0).reshape(400, 100)}
        expected = one.send(direction, payload)
        sender, receiver = ends[direction]
        wire = sender.encode(direction, payload)
        sent_bytes[direction] += sum(len(data) for _, data in wire.values() if data is not None)
        got = receiver.decode(direction, wire)
        assert set(got) == set(expected)
        for key in expected:
            assert got[key].shape == expected[key].shape and torch.equal(got[key], expected[key]), (message, key)
    assert one.bytes_sent == sent_bytes == server.bytes_sent == site.bytes_sent
    for name in ("known", "residuals", "owed"):  # the state either end keeps is the one link's
        state = getattr(one, name)
        if name == "known":
            assert state.keys() == server.known.keys() == site.known.keys()
            assert all(torch.equal(state[k], server.known[k]) and torch.equal(state[k], site.known[k]) for k in state)
        else:
            assert state.keys() == getattr(site, name).keys() and not getattr(server, name)
            assert all(torch.equal(state[k], getattr(site, name)[k]) for k in state)
    if up != "dense" or down != "dense":
        assert one.known, "a lossy codec keeps known values"


def test_dense_entries_cross_a_simulated_link_on_the_device_without_bytes_and_are_counted_as_their_stream(monkeypatch):
    from medfed.compression.codecs import DenseCodec

    link, wire_end = _link(), _link()
    payload = {"all": torch.randn(4000), "num_samples": torch.tensor([12], dtype=torch.int64), "core/1": torch.randn(40, 100)}
    expected_bytes = sum(len(data) for _, data in wire_end.encode("up", payload).values())
    monkeypatch.setattr(DenseCodec, "_encode_payload", lambda self, x: pytest.fail("a dense entry was coded to bytes"))
    received = link.send("up", payload)
    assert link.bytes_sent["up"] == expected_bytes and link.dense_bytes["up"] == 4 * (4000 + 1 + 4000)
    for key, value in payload.items():
        assert received[key].dtype == torch.float32 and received[key].shape == value.shape
        assert torch.equal(received[key], value.to(torch.float32))
        assert received[key].data_ptr() != value.data_ptr()  # the receiver's own copy
    bad = {"all": torch.randn(4000), "num_samples": torch.tensor([float("nan")])}
    with pytest.raises(ValueError, match="payload 'num_samples' \\(down\\): contains NaN or infinite entries"):
        link.send("down", bad)
    assert link.bytes_sent["down"] == 0  # refused before anything was counted
