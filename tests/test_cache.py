"""Preprocessed-data cache: a hit reads no volume and gives the same tensors; any change to the inputs, a failed
build or a damaged entry is handled without a stale or partial file."""

import logging
import os
import shutil
import stat

import pytest
import torch

from medfed.config import FederationConfig, MissingChannelConfig
from medfed.data.brats import find_cases
from medfed.errors import DataError
from medfed.tasks import brats

FEDERATION = FederationConfig(n_sites=3, missing_channel=MissingChannelConfig(channel=1, sites=[2]))


def build(root, cache_dir, cache=True):
    options = brats.Options(
        root=str(root),
        generate=None,
        patch_size=32,
        tumour_patches_per_case=4,
        background_patches_per_case=2,
        cache=cache,
        cache_dir=str(cache_dir),
    )
    return brats.build_federation(options, FEDERATION, seed=0, progress=False)


def assert_same_tensors(a, b):
    assert a.summary()["sites"] == b.summary()["sites"]
    for site_a, site_b in zip(a.sites, b.sites, strict=True):
        for split_a, split_b in ((site_a.train, site_b.train), (site_a.test, site_b.test)):
            for tensor_a, tensor_b in zip(split_a.tensors, split_b.tensors, strict=True):
                assert tensor_a.dtype == tensor_b.dtype and torch.equal(tensor_a, tensor_b)


def count_reads(monkeypatch):
    reads = []
    real_load_case = brats.load_case
    monkeypatch.setattr(brats, "load_case", lambda case, resample=False: reads.append(case.case_id) or real_load_case(case, resample))
    return reads


def test_second_build_reads_no_volume_and_gives_the_same_tensors(tiny_brats_root, tmp_path, monkeypatch):
    cache_dir = tmp_path / "cache"
    first = build(tiny_brats_root, cache_dir)
    key = first.cache["key"]
    entry = cache_dir / f"brats-{key}.pt"
    assert first.cache == {"key": key, "file": str(entry), "hit": False} and len(key) == 64
    assert os.listdir(cache_dir) == [entry.name]  # no temporary file left behind
    assert stat.S_IMODE(entry.stat().st_mode) == 0o644

    def no_reading(case, resample=False):
        raise AssertionError(f"read {case.case_id} although the federation is cached")

    monkeypatch.setattr(brats, "load_case", no_reading)
    second = build(tiny_brats_root, cache_dir)
    assert second.cache == {"key": key, "file": str(entry), "hit": True}
    assert second.summary()["cache"] == second.cache
    assert (second.description, second.generated, second.input_shape) == (first.description, True, (4, 32, 32))
    assert_same_tensors(first, second)


def test_without_the_cache_nothing_is_written(tiny_brats_root, tmp_path):
    federation = build(tiny_brats_root, tmp_path / "cache", cache=False)
    assert federation.cache is None and federation.summary()["cache"] is None
    assert not (tmp_path / "cache").exists()


def test_touching_one_input_file_invalidates_the_entry(tiny_brats_root, tmp_path, monkeypatch):
    root = shutil.copytree(tiny_brats_root, tmp_path / "brats")
    first = build(root, tmp_path / "cache")
    touched = find_cases(root)[-1].image_files[0]
    info = touched.stat()
    os.utime(touched, ns=(info.st_atime_ns, info.st_mtime_ns + 1_000_000_000))
    reads = count_reads(monkeypatch)
    second = build(root, tmp_path / "cache")
    assert second.cache["hit"] is False and second.cache["key"] != first.cache["key"]
    assert len(reads) == 9  # every case read again
    assert_same_tensors(first, second)
    assert len(os.listdir(tmp_path / "cache")) == 2


def test_a_failed_build_leaves_no_cache_file(tiny_brats_root, tmp_path):
    root = shutil.copytree(tiny_brats_root, tmp_path / "brats")
    broken = find_cases(root)[-1].image_files[1]
    broken.write_bytes(b"\x1f\x8b\x08\x00" + bytes(range(200)))
    with pytest.raises(DataError, match="cannot be read as NIfTI") as info:
        build(root, tmp_path / "cache")
    assert str(broken) in str(info.value)
    assert not (tmp_path / "cache").exists()  # the entry (and its folder) is only written after a whole build


def test_a_garbled_entry_is_rebuilt_with_a_warning(tiny_brats_root, tmp_path, monkeypatch, caplog):
    first = build(tiny_brats_root, tmp_path / "cache")
    entry = first.cache["file"]
    with open(entry, "r+b") as handle:
        handle.seek(100)
        handle.write(b"garbage" * 20)
    reads = count_reads(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="medfed"):
        rebuilt = build(tiny_brats_root, tmp_path / "cache")
    (warning,) = caplog.messages
    assert warning == f"preprocessed-data cache entry {entry} fails its SHA-256 check (changed or damaged since it was written); rebuilding it"
    assert rebuilt.cache["hit"] is False and len(reads) == 9
    assert_same_tensors(first, rebuilt)
    assert build(tiny_brats_root, tmp_path / "cache").cache["hit"] is True  # rewritten whole


# --- entries that pass as entries but must not be trained on (issue 24) ---------------------------------


def test_one_flipped_bit_is_found_by_the_checksum_and_the_entry_rebuilt(tiny_brats_root, tmp_path, monkeypatch, caplog):
    first = build(tiny_brats_root, tmp_path / "cache")
    entry = first.cache["file"]
    x = first.sites[0].train.tensors[0]
    index = int(torch.nonzero((x.flatten().abs() >= 0.5) & (x.flatten().abs() < 1.0))[0])  # a patch value in [0.5, 1)
    data = bytearray(open(entry, "rb").read())
    offset = bytes(data).index(x.numpy().tobytes()[:64])  # the first site's training patches, stored raw in the zip
    data[offset + index * 4 + 3] ^= 0x40  # one bit of that float32's exponent
    open(entry, "wb").write(bytes(data))
    flipped = torch.load(entry, weights_only=True)["federation"]["sites"][0]["train"][0].flatten()[index]
    assert 1e37 < abs(flipped.item()) < 3.5e38  # what the bit did: a finite, huge patch value
    reads = count_reads(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="medfed"):
        rebuilt = build(tiny_brats_root, tmp_path / "cache")
    assert caplog.messages == [f"preprocessed-data cache entry {entry} fails its SHA-256 check (changed or damaged since it was written); rebuilding it"]
    assert rebuilt.cache["hit"] is False and len(reads) == 9
    assert_same_tensors(first, rebuilt)


def _rewritten(entry, change):
    """The entry loaded, changed by ``change(federation)`` and written again under its name with a valid checksum."""
    from medfed.checkpoint import load_with_digest, save_with_digest

    stored = load_with_digest(entry, "entry")
    change(stored["federation"])
    with open(entry, "wb") as stream:
        save_with_digest(stored, stream)


def _nan_patches_labelled_7(federation):
    x, y = federation["sites"][0]["train"][:2]
    federation["sites"][0]["train"][0] = torch.full_like(x, float("nan"))
    federation["sites"][0]["train"][1] = torch.full_like(y, 7)


def _labels_7(federation):
    federation["sites"][1]["test"][1] = torch.full_like(federation["sites"][1]["test"][1], 7)


def _wrong_shape(federation):
    federation["sites"][2]["train"][0] = federation["sites"][2]["train"][0][:, :, :16, :16].contiguous()


def _lost_labels(federation):
    federation["sites"][0]["test"][1] = federation["sites"][0]["test"][1][:1]


@pytest.mark.parametrize(
    "change, reason",
    [
        (_nan_patches_labelled_7, "site0's train samples: x holds"),
        (_labels_7, "site1's test samples: labels range over [7, 7], expected values in [0, 2)"),
        (_wrong_shape, "site2's train samples: x has shape"),
        (_lost_labels, "site0's test samples: tensors of different lengths"),
    ],
)
def test_an_entry_with_a_valid_checksum_but_invalid_samples_is_rebuilt_with_a_warning(
    tiny_brats_root, tmp_path, monkeypatch, caplog, change, reason
):
    first = build(tiny_brats_root, tmp_path / "cache")
    entry = first.cache["file"]
    _rewritten(entry, change)
    reads = count_reads(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="medfed"):
        rebuilt = build(tiny_brats_root, tmp_path / "cache")
    (warning,) = caplog.messages
    assert warning.startswith(f"preprocessed-data cache entry {entry}: {reason}") and warning.endswith("; rebuilding it")
    assert rebuilt.cache["hit"] is False and len(reads) == 9
    assert_same_tensors(first, rebuilt)
    assert build(tiny_brats_root, tmp_path / "cache").cache["hit"] is True


def test_an_entry_read_once_in_a_process_is_not_read_again_and_each_caller_gets_its_own_federation(tiny_brats_root, tmp_path, monkeypatch):
    import medfed.data.cache as cache

    first = build(tiny_brats_root, tmp_path / "cache")  # built and written
    loads = []
    original = cache.load_with_digest
    monkeypatch.setattr(cache, "load_with_digest", lambda *args: loads.append(args) or original(*args))
    second, third = build(tiny_brats_root, tmp_path / "cache"), build(tiny_brats_root, tmp_path / "cache")
    assert second.cache["hit"] and third.cache["hit"] and len(loads) == 1  # read and checked once (fused runs of one seed)
    assert_same_tensors(first, third)
    assert third is not second and third.sites[0] is not second.sites[0]  # the tensors shared, the federations each its own
    assert third.sites[0].train.tensors[0] is second.sites[0].train.tensors[0]
