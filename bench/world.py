"""Benchmark: synthetic-world generation throughput (images/s) for 1 and 2 worker processes.

python bench/world.py [--num-images 2000]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from pipeline.core.config import load_config
from pipeline.world.generate import generate_world


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--num-images", type=int, default=2000)
    args = parser.parse_args()
    print(f"{'workers':>8} {'images':>7} {'seconds':>8} {'images/s':>9}")
    for workers in (1, 2):
        cfg = load_config(
            "world", overrides=[f"world.num_images={args.num_images}", f"world.num_workers={workers}"]
        ).world
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            generate_world(Path(tmp), cfg)
            dt = time.perf_counter() - t0
        print(f"{workers:>8} {args.num_images:>7} {dt:>8.2f} {args.num_images / dt:>9.1f}")


if __name__ == "__main__":
    main()
