"""Stacking R models' convolutions: vmapped (the stacked step's way) against one grouped convolution (HFTA's) and
against the models in turn; forward and backward of a U-Net-sized layer, side by side in one process.

The batched executor stacks the sites' models with ``torch.func.vmap``, which works for every model and strategy
loss unchanged. Horizontally fused modules (HFTA: one model of R x the channels, grouped convolutions) need each
model rewritten; they would be worth it only if a grouped convolution ran faster than the vmapped one. This
times both (and the R models one after another) for R x (B, C, P, P) inputs and (O, C, 3, 3) kernels.

Run from the repository root::

    PYTHONPATH=$PWD python benchmarks/stacked_conv.py [--device cuda] [--models 5] [--side 32]
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import torch


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--models", type=int, default=5, help="R, the stacked models")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--channels", type=int, nargs=2, default=[16, 32], metavar=("IN", "OUT"))
    parser.add_argument("--side", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    r, b, (c, o), p = args.models, args.batch, args.channels, args.side
    generator = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(r, b, c, p, p, generator=generator, device=device)
    w = torch.randn(r, o, c, 3, 3, generator=generator, device=device, requires_grad=True)

    def vmapped() -> None:
        y = torch.func.vmap(lambda xi, wi: torch.nn.functional.conv2d(xi, wi, padding=1))(x, w)
        y.square().mean().backward()

    def grouped() -> None:
        fused = x.permute(1, 0, 2, 3, 4).reshape(b, r * c, p, p)
        torch.nn.functional.conv2d(fused, w.reshape(r * o, c, 3, 3), padding=1, groups=r).square().mean().backward()

    def in_turn() -> None:
        for i in range(r):
            torch.nn.functional.conv2d(x[i], w[i], padding=1).square().mean().backward()

    def milliseconds(step) -> float:
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        tic = time.perf_counter()
        for _ in range(args.repeats):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return (time.perf_counter() - tic) / args.repeats * 1e3

    load = ", ".join(f"{v:.1f}" for v in os.getloadavg())
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{platform.machine()} CPU, {torch.get_num_threads()} thread(s)"
    print(f"# {name}, load average {load}; torch {torch.__version__}; R = {r}, input ({b}, {c}, {p}, {p}), kernel ({o}, {c}, 3, 3)")
    times = {label: min(milliseconds(step) for _ in range(3)) for label, step in (("vmapped", vmapped), ("grouped", grouped), ("in turn", in_turn))}
    print("| forward + backward | ms | vs vmapped |")
    print("|---|---:|---:|")
    for label, value in times.items():
        print(f"| {label} | {value:.2f} | {value / times['vmapped']:.2f} |")


if __name__ == "__main__":
    main()
