"""Codecs: byte-exact round trips, no sender state, compression ratios and stream validation."""

import struct

import numpy as np
import pytest
import torch

from medfed.compression import CODEC_NAMES, cer, make_codec
from medfed.compression.codecs import HEADER_SIZE, frame_checksum

CODEC_OPTIONS = {
    "dense": {},
    "stc": {"sparsity": 0.01},
    "cer": {"gamma": 0.5},
    "cer-quantised": {"gamma": 0.5, "quant_bits": 6},
    "cer+stc": {"gamma": 0.5, "sparsity": 0.01},
}


def _make(key: str):
    return make_codec(key.replace("-quantised", ""), **CODEC_OPTIONS[key])


def _noise(seed: int, d: int) -> torch.Tensor:
    """Heavy-tailed 'update': Student-t with 3 degrees of freedom."""
    return torch.from_numpy(np.random.default_rng(seed).standard_t(3, d).astype(np.float32))


def _noisy_steps(seed: int, d: int, mean_run: int, noise: float) -> torch.Tensor:
    """Piecewise-constant signal (N(0, 1) levels, geometric run lengths) plus Gaussian noise."""
    rng = np.random.default_rng(seed)
    lengths = rng.geometric(1 / mean_run, d)
    signal = np.repeat(rng.standard_normal(lengths.size), lengths)[:d]
    return torch.from_numpy((signal + noise * rng.standard_normal(d)).astype(np.float32))


def _ratio(data: bytes, d: int) -> float:
    return 4 * d / len(data)


def test_every_codec_is_covered():
    assert {key.replace("-quantised", "") for key in CODEC_OPTIONS} == set(CODEC_NAMES)


@pytest.mark.parametrize("key", list(CODEC_OPTIONS))
def test_decode_returns_exactly_what_the_sender_sent(key):
    sender, receiver = _make(key), _make(key)  # decoding needs only the bytes
    for round_ in range(3):
        data, sent = sender.encode_with_sent(_noise(round_, 3_000))
        decoded = receiver.decode(data)
        assert decoded.dtype == torch.float32 and decoded.shape == (3_000,)
        assert torch.equal(decoded.view(torch.int32), sent.view(torch.int32))


def test_what_each_codec_sends():
    x = _noise(0, 2_000)
    assert torch.equal(make_codec("dense").encode_with_sent(x).sent, x)
    assert torch.equal(make_codec("cer", gamma=0.5).encode_with_sent(x).sent, cer(x, 0.5))

    stc_sent = make_codec("stc", sparsity=0.01).encode_with_sent(x).sent
    kept = torch.topk(x.abs(), 20).indices
    assert set(torch.nonzero(stc_sent).flatten().tolist()) == set(kept.tolist())
    assert torch.allclose(stc_sent[kept], x[kept].sign() * x[kept].abs().mean())

    cer_stc_sent = make_codec("cer+stc", gamma=0.5, sparsity=0.01).encode_with_sent(x).sent
    u = cer(x, 0.5)
    assert torch.count_nonzero(cer_stc_sent) == 20
    assert torch.all(torch.sign(cer_stc_sent[cer_stc_sent != 0]) == torch.sign(u[cer_stc_sent != 0]))
    assert u.abs()[cer_stc_sent != 0].min() >= u.abs()[cer_stc_sent == 0].max()


@pytest.mark.parametrize("key", list(CODEC_OPTIONS))
def test_a_message_depends_only_on_its_input(key):
    # error feedback lives in the link (target - known value); a codec remembering its inputs would count it twice
    codec, x = _make(key), _noise(9, 1_000)
    first = codec.encode(x)
    for seed in range(3):
        codec.encode(_noise(seed, 1_000))
    assert codec.encode(x) == first == _make(key).encode(x)
    assert codec.encode(_noise(0, 1_001)) == _make(key).encode(_noise(0, 1_001))  # no d remembered either


def test_stc_compresses_more_than_100_times_at_p_1_over_400():
    d = 200_000
    data = make_codec("stc").encode(_noise(0, d))
    assert _ratio(data, d) > 100
    assert len(data) < len(make_codec("stc", sparsity=4 / 400).encode(_noise(0, d)))


def test_cer_then_stc_beats_stc_alone_on_a_noisy_piecewise_constant_update():
    d = 100_000
    x = _noisy_steps(0, d, mean_run=200, noise=0.5)
    stc_bytes = make_codec("stc").encode(x)
    cer_stc_bytes = make_codec("cer+stc", gamma=5.0).encode(x)
    assert len(cer_stc_bytes) < len(stc_bytes) / 5


def test_cer_ratio_grows_with_gamma_and_with_quantisation():
    d = 50_000
    x = _noisy_steps(1, d, mean_run=100, noise=0.3)
    sizes = [len(make_codec("cer", gamma=gamma).encode(x)) for gamma in (0.1, 1.0, 10.0)]
    assert sizes[0] > sizes[1] > sizes[2]
    assert len(make_codec("cer", gamma=1.0, quant_bits=4).encode(x)) < sizes[1] / 3
    assert len(make_codec("dense").encode(x)) == HEADER_SIZE + 4 * d


@pytest.mark.parametrize("key", list(CODEC_OPTIONS))
def test_truncated_or_corrupt_streams_raise(key):
    codec = _make(key)
    data = codec.encode(_noise(0, 500))
    for cut in range(0, len(data), max(1, len(data) // 40)):
        with pytest.raises(ValueError):
            codec.decode(data[:cut])
    corrupt = bytearray(data)
    corrupt[-1] ^= 0x10
    with pytest.raises(ValueError, match="CRC"):
        codec.decode(bytes(corrupt))
    with pytest.raises(ValueError, match="not a medfed codec stream"):
        codec.decode(np.random.default_rng(0).bytes(len(data)))
    # an intact header (CRC recomputed) over a payload with bytes after the message
    payload = data[HEADER_SIZE:] + b"\x00\x00"
    header = data[: HEADER_SIZE - 4] + struct.pack("<I", frame_checksum(data[: HEADER_SIZE - 4], payload))
    with pytest.raises(ValueError, match="trailing|expected"):
        codec.decode(header + payload)


def test_streams_of_another_codec_are_rejected():
    data = make_codec("stc").encode(_noise(0, 500))
    with pytest.raises(ValueError, match="written by codec 'stc'"):
        make_codec("cer+stc", gamma=1.0).decode(data)


@pytest.mark.parametrize(
    "name, options, message",
    [
        ("zip", {}, "unknown name 'zip'"),
        ("stc", {"p": 0.1}, r"unknown option\(s\) \['p'\]"),
        ("dense", {"gamma": 1.0}, r"unknown option\(s\) \['gamma'\]"),
        ("cer", {}, r"missing option\(s\) \['gamma'\]"),
        ("cer", {"gamma": -1.0}, "gamma"),
        ("cer", {"gamma": 1.0, "quant_bits": 0}, "quant_bits"),
        ("cer", {"gamma": 1.0, "quant_bits": 2.5}, "quant_bits"),
        ("stc", {"sparsity": 1.5}, "sparsity"),
        ("stc", {"sparsity": 0.0}, "sparsity"),
        ("cer+stc", {"gamma": "1"}, "gamma"),
    ],
)
def test_make_codec_rejects_bad_names_and_options(name, options, message):
    with pytest.raises(ValueError, match=message):
        make_codec(name, **options)


@pytest.mark.parametrize(
    "x, message",
    [
        (torch.zeros(3, 3), "flat"),
        (torch.zeros(3, dtype=torch.float64), "float32"),
        (torch.zeros(0), "non-empty"),
        (torch.tensor([1.0, float("inf")]), "infinite"),
        (np.zeros(3, dtype=np.float32), "torch.Tensor"),
    ],
)
def test_encode_rejects_bad_updates(x, message):
    with pytest.raises(ValueError, match=message):
        make_codec("stc").encode(x)
