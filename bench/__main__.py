"""``python -m bench``: the project vs its baselines, one table (and JSON), every ratio output-checked.

python -m bench                               # CPU: cider, nms, store at the default sizes, 1 thread
python -m bench --only nms --repeats 5
python -m bench --size tiny                   # seconds: what the test suite runs
python -m bench --device cuda --json gpu.json # CUDA: extraction, XE/SCST epoch, beam-5 decode
python -m bench --only vinvl [--device cuda]  # X-152 vs R-101 regions, grid vs regions (s/img, ratio)
python -m bench --only clip [--device cuda]   # CLIP RN50x4 / ViT-B/16 grid at 448: batch vs per-image, vs R-101
python -m bench --only proxies --repeats 1 --warmup 0   # CPU: operators and host syncs per step (bench.proxies)
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

# before torch loads: OpenMP reads its wait policy once, at load; idle threads then sleep instead of spinning
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch

from bench import cider, clip, gpu, harness, nms, proxies, store, vinvl
from pipeline.core.fileio import atomic_write_text

CPU_BENCHES = ("cider", "nms", "store", "vinvl", "clip", "proxies")
CPU_DEFAULT = (
    "cider",
    "nms",
    "store",
)  # proxies, vinvl and clip (minutes at paper sizes / full widths) only when named
GPU_BENCHES = ("extract", "train", "decode", "vinvl", "clip")
GPU_DEFAULT = ("extract", "train", "decode")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line and exit 2, like the CLI
        sys.stderr.write(f"error: {message}\n")
        raise SystemExit(2)


def _parser() -> argparse.ArgumentParser:
    ap = _Parser(
        prog="python -m bench",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "--only",
        default=None,
        help=f"comma-separated benches (CPU: {', '.join(CPU_BENCHES)}; CUDA: {', '.join(GPU_BENCHES)})",
    )
    ap.add_argument(
        "--size", choices=("tiny", "default"), default="default", help="problem sizes (tiny: a few seconds)"
    )
    ap.add_argument("--repeats", type=int, default=5, help="timed rounds per row (>= 3 for a reported figure)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed rounds before timing")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads for both sides (default 1)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--models", default="ngsan,m2", help="captioners of the CUDA train/decode rows and of the proxies")
    ap.add_argument("--format", choices=("table", "json"), default="table", help="what goes to stdout")
    ap.add_argument("--json", type=Path, default=None, help="also write the JSON results to this file")
    ap.add_argument(
        "--store-dir", type=Path, default=None, help="folder for the store bench's files (default: a temporary one)"
    )
    return ap


def _select(only: str | None, device: str) -> list[str]:
    known = CPU_BENCHES if device == "cpu" else GPU_BENCHES
    if only is None:
        return list(CPU_DEFAULT if device == "cpu" else GPU_DEFAULT)
    names = [n.strip() for n in only.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"--only: unknown bench {unknown[0]!r} on {device} (choose from {', '.join(known)})")
    return names


def main(argv: Sequence[str] | None = None) -> int:
    """Run the selected benches; 0 ok, 1 a mismatch or runtime failure, 2 a usage error."""
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    try:
        names = _select(args.only, args.device)
        if args.repeats < 1 or args.warmup < 0 or args.threads < 1:
            raise ValueError("--repeats and --threads must be >= 1, --warmup >= 0")
    except ValueError as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 2

    if args.device == "cuda" and not torch.cuda.is_available():
        sys.stderr.write(
            f"error: --device cuda: CUDA is not available here (torch {torch.__version__}); run on CPU or on a GPU "
            "machine\n"
        )
        return 2
    torch.set_num_threads(args.threads)

    env = harness.environment(args.device, args.threads)
    rows: list[harness.Row] = []
    cleanups: list[Callable[[], None]] = []
    try:
        for name in names:
            for case in _cases(name, args, cleanups):
                logging.getLogger("bench").info(
                    "measuring %s: %s vs %s (%s)", case.name, case.project, case.baseline or "-", case.work
                )
                rows.append(harness.measure(case, args.repeats, args.warmup))
    except harness.Mismatch as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 1
    finally:
        for cleanup in cleanups:
            cleanup()
    text = harness.to_json(rows, env)
    if args.json is not None:
        atomic_write_text(args.json, text + "\n")
    print(text if args.format == "json" else harness.table(rows, env))
    return 0


def _cases(name: str, args: argparse.Namespace, cleanups: list[Callable[[], None]]) -> list:
    if name == "vinvl":
        return vinvl.cases(args.size, args.device)
    if name == "clip":
        return clip.cases(args.size, args.device)
    if name == "cider":
        return cider.cases(args.size)
    if name == "nms":
        return nms.cases(args.size)
    if name == "store":
        found, cleanup = store.cases(args.size, args.store_dir)
        cleanups.append(cleanup)
        return found
    if name == "proxies":
        return proxies.cases(args.size, args.models.split(","))

    return gpu.cases(name, args.size, args.models.split(","))


if __name__ == "__main__":
    raise SystemExit(main())
