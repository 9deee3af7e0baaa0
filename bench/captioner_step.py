"""Benchmark: training-step and incremental-step cost of the captioners at their paper configuration.

For each model: one cross-entropy training step (forward + backward + Adam) on ``--images`` images x 5 captions
of ``--len`` tokens with up to 50 regions (some padded), and ``--steps`` incremental ``step()`` calls (greedy
argmax, cached state) for the same images; prints seconds per training step, captions/s of teacher forcing,
milliseconds per decoding step and peak memory (CUDA only).

    python bench/captioner_step.py [--models m2 aoa ban] [--images 4] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import time

import torch

import models
from pipeline.core.vocab import BOS


def make_batch(images: int, regions: int, feat_dim: int, device: torch.device):
    g = torch.Generator().manual_seed(0)
    feats = torch.rand(images, regions, feat_dim, generator=g)
    valid = torch.randint(10, regions + 1, (images,), generator=g)
    mask = torch.arange(regions)[None] < valid[:, None]
    xy = torch.rand(images, regions, 2, generator=g) * 300
    boxes = torch.cat([xy, xy + 50], -1) * mask[..., None]
    sizes = torch.full((images, 2), 400.0)
    return [t.to(device) for t in (feats * mask[..., None], mask, boxes, sizes)]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_model(name: str, args: argparse.Namespace, device: torch.device) -> dict[str, float]:
    torch.manual_seed(0)
    model = models.build_captioner(name, args.vocab).to(device)
    feat_dim = int(getattr(model, "feat_dim", 2048))
    feats, mask, boxes, sizes = make_batch(args.images, 50, feat_dim, device)
    caps = torch.randint(4, args.vocab, (args.images * 5, args.len), device=device)
    caps[:, 0] = BOS
    owner = torch.arange(args.images, device=device).repeat_interleave(5)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    model.train()
    times = []
    for _ in range(args.reps + 1):  # the first repetition warms up
        sync(device)
        t0 = time.perf_counter()
        logp = model(feats, mask, boxes, sizes, caps[:, :-1], owner)
        loss = torch.nn.functional.nll_loss(logp.reshape(-1, args.vocab), caps[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sync(device)
        times.append(time.perf_counter() - t0)
    train_s = sum(times[1:]) / args.reps
    model.eval()
    with torch.no_grad():
        enc = models.index_state(model.encode(feats, mask, boxes, sizes), owner)
        state = model.init_state(enc)
        tokens = torch.full((owner.shape[0],), BOS, device=device)
        sync(device)
        t0 = time.perf_counter()
        for _ in range(args.steps):
            logp, state = model.step(tokens, enc, state)
            tokens = logp.argmax(-1)
        sync(device)
        step_ms = (time.perf_counter() - t0) / args.steps * 1000
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    params = sum(p.numel() for p in model.parameters()) / 1e6
    return {
        "params_m": params,
        "train_s": train_s,
        "caps_per_s": owner.shape[0] / train_s,
        "step_ms": step_ms,
        "peak_gib": peak,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["m2", "aoa", "ban"])
    parser.add_argument("--images", type=int, default=4, help="images per batch (x 5 captions)")
    parser.add_argument("--len", type=int, default=17, help="caption tokens incl. BOS")
    parser.add_argument("--steps", type=int, default=20, help="incremental decoding steps")
    parser.add_argument("--vocab", type=int, default=10000)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=0, help="CPU threads (0 = torch default)")
    args = parser.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    print(
        f"device {device}, {args.images} images x 5 captions, {args.len} tokens, vocab {args.vocab}, "
        f"torch threads {torch.get_num_threads()}"
    )
    print(
        f"{'model':>6} {'params(M)':>10} {'train s/step':>13} {'captions/s':>11} {'decode ms/step':>15} {'peak GiB':>9}"
    )
    for name in args.models:
        r = bench_model(name, args, device)
        print(
            f"{name:>6} {r['params_m']:>10.2f} {r['train_s']:>13.3f} {r['caps_per_s']:>11.1f} "
            f"{r['step_ms']:>15.2f} {r['peak_gib']:>9.2f}"
        )


if __name__ == "__main__":
    main()
