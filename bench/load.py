"""Load sensitivity: ``demo --quick`` alone vs beside competing CPU-bound processes, same command, same output.

Runs ``python cli.py demo --quick --out DIR/<condition>-<i>`` (each run from scratch) alternately alone and
next to ``--hogs`` busy-looping Python processes (``while True: pass``, started by this script and ended by
their pid), and prints the wall times, the load average around each run, the slowdown (loaded / alone, of the
medians) and whether the runs' metrics (``summary.json``) are identical: the thread policy does not depend on
the load, so they must be, and the slowdown is only reported when they are.

    python -m bench.load [--repeats 1] [--hogs 1] [--out /tmp/bench-load] [--keep] [--json FILE]
    python -m bench.load --env OMP_WAIT_POLICY=ACTIVE   # e.g. compare with spinning OpenMP threads

On a machine with C cores, one hog leaves C - 1 cores and a fair share of the contested one; the target is a
slowdown of at most ~2x (the fair share) on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
log = logging.getLogger("bench.load")


def run_demo(
    out: Path, env: dict[str, str], extra: list[str], demo_args: list[str]
) -> tuple[float, dict, tuple[float, float]]:
    """One ``demo --quick`` from scratch: (wall seconds, metrics, (load before, load after))."""
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, str(REPO / "cli.py"), *extra, "demo", "--quick", "--out", str(out), *demo_args]
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()[-500:]}")
    metrics = json.loads((out / "summary.json").read_text())["metrics"]
    return wall, metrics, (load0, os.getloadavg()[0])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=1, help="runs per condition (alternating)")
    ap.add_argument("--hogs", type=int, default=1, help="competing busy-loop processes in the loaded condition")
    ap.add_argument("--out", type=Path, default=Path("/tmp/bench-load"))
    ap.add_argument("--keep", action="store_true", help="keep the run folders")
    ap.add_argument("--env", action="append", default=[], help="KEY=VALUE for the demo's environment (repeatable)")
    ap.add_argument("--cli", default="", help="options before the command, e.g. '--threads 1'")
    ap.add_argument("--demo-args", default="", help="more demo options (a smaller run: '--num-images 40 --set ...')")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    env = dict(os.environ)
    env.update(dict(kv.split("=", 1) for kv in args.env))
    rows: list[dict] = []
    for i in range(args.repeats):
        for condition in ("alone", "loaded") if i % 2 == 0 else ("loaded", "alone"):
            hogs = []
            if condition == "loaded":
                hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.hogs)]
                time.sleep(2)
            try:
                wall, metrics, (l0, l1) = run_demo(
                    args.out / f"{condition}-{i}", env, args.cli.split(), shlex.split(args.demo_args)
                )
            finally:
                for h in hogs:
                    h.kill()
                    h.wait()
            rows.append(
                {
                    "condition": condition,
                    "repeat": i,
                    "seconds": wall,
                    "load_before": l0,
                    "load_after": l1,
                    "metrics": metrics,
                }
            )
            log.info("%-7s run %d: %7.1f s  load average %.2f -> %.2f", condition, i, wall, l0, l1)
    if not args.keep:
        shutil.rmtree(args.out, ignore_errors=True)
    same = all(r["metrics"] == rows[0]["metrics"] for r in rows)
    alone = statistics.median(r["seconds"] for r in rows if r["condition"] == "alone")
    loaded = statistics.median(r["seconds"] for r in rows if r["condition"] == "loaded")
    result = {
        "cores": len(os.sched_getaffinity(0)),
        "hogs": args.hogs,
        "env": args.env,
        "cli": args.cli,
        "rows": rows,
        "alone_median_s": alone,
        "loaded_median_s": loaded,
        "identical_metrics": same,
        "slowdown": loaded / alone if same else None,
    }
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    print(
        f"demo --quick on {result['cores']} cores: alone {alone:.1f} s, beside {args.hogs} busy process(es) "
        f"{loaded:.1f} s"
    )
    if not same:
        sys.stderr.write("error: the runs' metrics differ; no slowdown reported\n")
        return 1
    print(f"slowdown x{loaded / alone:.2f} (identical metrics in all {len(rows)} runs)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
