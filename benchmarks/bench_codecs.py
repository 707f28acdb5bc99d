"""Time CER and every codec on one update of U-Net size; print bytes and compression ratios.

The update is synthetic: d float32 entries of Student-t noise with 3 degrees
of freedom (heavy tails, like gradients) scaled by ``--scale``, or a saved
real update (``--update file.npy``, a flat float32 vector). torch runs on one
thread. CER is timed on one core (``cores=1``) and on two (``cores=2``, both
ends of the chain at once), side by side; the codecs use what ``cer`` picks by
default (two cores when the process has them). numba's compile time is
excluded by a warm-up call. Times are the minimum and median of ``--repeats``
runs.

    python benchmarks/bench_codecs.py [--d 1600000] [--gamma 0.01] [--repeats 5] [--update file.npy]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from medfed.compression import cer, make_codec


def _times_ms(run: Callable[[], object], repeats: int) -> tuple[float, float]:
    """(minimum, median) wall time of ``run()`` in milliseconds."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(1e3 * (time.perf_counter() - start))
    return min(times), statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d", type=int, default=1_600_000, help="entries in the update")
    parser.add_argument("--scale", type=float, default=1e-3, help="scale of the Student-t(3) entries")
    parser.add_argument("--gamma", type=float, default=1e-2, help="CER weight for the codecs")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--update", type=Path, help="a flat float32 .npy update to use instead of the synthetic one")
    args = parser.parse_args()

    torch.set_num_threads(1)
    if args.update:
        x = torch.from_numpy(np.load(args.update).astype(np.float32).ravel())
        description = f"{args.update} (d = {x.numel():,})"
    else:
        rng = np.random.default_rng(args.seed)
        x = torch.from_numpy((args.scale * rng.standard_t(3, args.d)).astype(np.float32))
        description = f"d = {args.d:,} float32, Student-t(3) x {args.scale:g}"
    codecs = [  # (label, name, options)
        ("dense", "dense", {}),
        ("stc (p=1/400)", "stc", {"sparsity": 1 / 400}),
        ("cer", "cer", {"gamma": args.gamma}),
        ("cer, 8-bit runs", "cer", {"gamma": args.gamma, "quant_bits": 8}),
        ("cer+stc (p=1/400)", "cer+stc", {"gamma": args.gamma, "sparsity": 1 / 400}),
    ]
    for _, name, options in codecs:  # compiles the numba kernels
        codec = make_codec(name, **options)
        codec.decode(codec.encode(x[:1000]))
    for cores in (1, 2):
        cer(x[:1000], args.gamma, cores=cores)

    print(f"update: {description}; {args.repeats} repeats")
    print("\nCER alone (min / median ms, runs in the output)")
    print(f"  {'weight':<10} {'one core':>17} {'two cores':>17} {'speed-up':>9} {'runs':>10}")
    for weight in (0.1 * args.gamma, args.gamma, 10 * args.gamma):
        one = _times_ms(lambda w=weight: cer(x, w, cores=1), args.repeats)
        two = _times_ms(lambda w=weight: cer(x, w, cores=2), args.repeats)
        runs = 1 + int(torch.count_nonzero(torch.diff(cer(x, weight))))
        print(
            f"  {weight:<10g} {one[0]:7.1f} / {one[1]:7.1f} {two[0]:7.1f} / {two[1]:7.1f}"
            f" {one[1] / two[1]:>8.2f}x {runs:>10,}"
        )

    print(f"\n{'codec':<20} {'bytes':>10} {'ratio':>9} {'rel. error':>10} {'encode ms':>17} {'decode ms':>17}")
    for label, name, options in codecs:
        data, sent = make_codec(name, **options).encode_with_sent(x)
        receiver = make_codec(name, **options)
        assert torch.equal(receiver.decode(data), sent)
        encode = _times_ms(lambda: make_codec(name, **options).encode(x), args.repeats)
        decode = _times_ms(lambda: receiver.decode(data), args.repeats)
        error = float(torch.linalg.vector_norm(sent - x) / torch.linalg.vector_norm(x))
        print(
            f"{label:<20} {len(data):>10,} {4 * x.numel() / len(data):>8.1f}x {error:>10.3f}"
            f" {encode[0]:>7.1f} / {encode[1]:>7.1f} {decode[0]:>7.1f} / {decode[1]:>7.1f}"
        )


if __name__ == "__main__":
    main()
