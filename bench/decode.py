"""Decoding speed and memory of every registered captioner: captions/s and peak memory.

For each model (paper dimensions, random weights, vocabulary 9,487), device, batch size and decoder
(greedy = beam 1, beam 3, beam 5) it encodes a batch of random region features and decodes it, and prints
captions per second (median of ``--repeats`` timed runs after one warm-up; encoding included) and the peak
memory of the warm-up run: CUDA ``max_memory_allocated`` above what was allocated before it, or on CPU the
peak resident-set growth (after ``malloc_trim``) sampled from ``/proc/self/statm`` every 2 ms ("n/a" where
that file does not exist; CPU numbers are approximate: allocator caching can hide reused memory).

With random weights ``<eos>`` is almost never chosen, so every caption runs to ``--max-len``: the numbers
are the full-length (worst) case. Usage::

    python -m bench.decode                               # all models, CPU (+ CUDA if present), 1 and 50
    python -m bench.decode --models san,ngsan --batch-sizes 1,10 --repeats 1 --max-len 12
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import threading
import time
from contextlib import contextmanager
from typing import Iterator

import torch

import models
from models.decoding import DecodeOptions, beam_search, greedy

VOCAB = 9487


def rss_bytes() -> int | None:
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def release_free_memory() -> None:
    """Give freed heap memory back to the OS (glibc ``malloc_trim``) so that RSS growth can be measured."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


@contextmanager
def peak_memory(device: torch.device) -> Iterator[dict[str, float | None]]:
    """Yield a dict whose ``peak_mb`` is filled on exit (peak growth during the block, MiB)."""
    out: dict[str, float | None] = {"peak_mb": None}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        yield out
        torch.cuda.synchronize(device)
        out["peak_mb"] = (torch.cuda.max_memory_allocated(device) - base) / 2**20
        return
    base = rss_bytes()
    if base is None:
        yield out
        return
    peak = [base]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            now = rss_bytes() or 0
            peak[0] = max(peak[0], now)
            stop.wait(0.002)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield out
    finally:
        stop.set()
        thread.join()
        peak[0] = max(peak[0], rss_bytes() or 0)
        out["peak_mb"] = (peak[0] - base) / 2**20


def make_inputs(batch: int, regions: int, feat_dim: int, device: torch.device, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    feats = torch.rand(batch, regions, feat_dim, generator=g)
    xy = torch.rand(batch, regions, 2, generator=g) * 400
    boxes = torch.cat([xy, xy + 10 + torch.rand(batch, regions, 2, generator=g) * 200], -1)
    mask = torch.ones(batch, regions, dtype=torch.bool)
    sizes = torch.tensor([[640.0, 480.0]]).expand(batch, 2)
    return [t.to(device) for t in (feats, mask, boxes, sizes)]


def run_once(model: models.Captioner, inputs, beam: int, max_len: int) -> torch.Tensor:
    enc = model.encode(*inputs)
    if beam == 1:
        return greedy(model, enc, DecodeOptions(method="greedy", max_len=max_len)).tokens
    return beam_search(model, enc, DecodeOptions(beam_size=beam, max_len=max_len)).tokens


def bench(
    model: models.Captioner, device: torch.device, batch: int, beam: int, args: argparse.Namespace
) -> tuple[float, float | None, float]:
    inputs = make_inputs(batch, args.regions, int(getattr(model, "feat_dim", 2048)), device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    with torch.inference_mode():
        release_free_memory()
        with peak_memory(device) as mem:  # measured on the first (warm-up) run: its allocations are new
            run_once(model, inputs, beam, args.max_len)
        times = []
        for _ in range(args.repeats):
            sync()
            start = time.perf_counter()
            tokens = run_once(model, inputs, beam, args.max_len)
            sync()
            times.append(time.perf_counter() - start)
    mean_len = float((tokens[:, 0] != 0).sum(-1).float().mean())
    return batch / statistics.median(times), mem["peak_mb"], mean_len


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="all", help="comma-separated registry names, or 'all'")
    parser.add_argument("--devices", default="auto", help="cpu, cuda, or auto (cpu + cuda when available)")
    parser.add_argument("--batch-sizes", default="1,50")
    parser.add_argument("--beams", default="1,3,5", help="1 = greedy")
    parser.add_argument("--max-len", type=int, default=20)
    parser.add_argument("--regions", type=int, default=36)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--set", action="append", default=[], help="model override KEY=VALUE applied to every model (e.g. num_layers=2)"
    )
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    names = models.available_captioners() if args.models == "all" else args.models.split(",")
    devices = (
        ["cpu"] + (["cuda"] if torch.cuda.is_available() else []) if args.devices == "auto" else args.devices.split(",")
    )
    batches = [int(b) for b in args.batch_sizes.split(",")]
    beams = [int(b) for b in args.beams.split(",")]
    print(
        f"torch {torch.__version__}, cpu threads {torch.get_num_threads()}, V={VOCAB}, regions={args.regions}, "
        f"max_len={args.max_len}, repeats={args.repeats}, overrides={args.set or 'none'}"
    )
    header = (
        f"{'model':8} {'device':6} {'params':>8} {'batch':>5} {'decoder':>8} {'captions/s':>11} {'peak MiB':>9} "
        f"{'mean len':>8}"
    )
    print(header)
    print("-" * len(header))
    for name in names:
        cfg = models.model_config(name, args.set)
        for dev in devices:
            device = torch.device(dev)
            torch.manual_seed(0)
            model = models.build_captioner(name, VOCAB, **cfg.to_dict()).to(device).eval()
            params = sum(p.numel() for p in model.parameters()) / 1e6
            for batch in batches:
                for beam in beams:
                    rate, peak, mean_len = bench(model, device, batch, beam, args)
                    label = "greedy" if beam == 1 else f"beam {beam}"
                    mem = "n/a" if peak is None else f"{peak:9.1f}"
                    print(
                        f"{name:8} {dev:6} {params:7.1f}M {batch:5d} {label:>8} {rate:11.1f} {mem:>9} {mean_len:8.1f}",
                        flush=True,
                    )
            del model
            if device.type == "cuda":
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
