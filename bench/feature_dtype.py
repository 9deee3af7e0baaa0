"""What float16 features cost in captions: a trained captioner on float16 vs float32 features of the same images.

    python -m bench.feature_dtype RUN [--captioner ngsan] [--split test]

``RUN`` is a finished demo run (``cli demo``): its ``features`` stage config is rerun with
``extract.feature_dtype=float32`` into ``RUN/features-float32`` (the demo's own store is float16, the
``extract`` default), then ``evaluate`` captions the split from both stores with ``RUN/train-<captioner>/best.pt``
and this prints how many captions (and CIDEr-D) differ. docs/benchmarks.md#float16-features holds the result.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from extractors.stage import ExtractJob, extract_features
from pipeline.core.config import load_config

REPO = Path(__file__).resolve().parents[1]


def _cli(*args: str) -> None:
    subprocess.run([sys.executable, str(REPO / "cli.py"), *args, "--quiet"], check=True, cwd=REPO)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", type=Path)
    parser.add_argument("--captioner", default="ngsan")
    parser.add_argument("--split", default="test")
    args = parser.parse_args()
    run = args.run.resolve()

    manifest = json.loads((run / "features" / "manifest.json").read_text())
    detector = json.loads((run / "detector" / "manifest.json").read_text())
    base = load_config("extract").extract
    settings = {k: v for k, v in manifest["config"].items() if k in base}  # the demo's extract settings
    section = base.with_overrides({**settings, "feature_dtype": "float32"}, source="bench.feature_dtype")
    weights = run / "detector" / detector["outputs"]["weights"]
    done = extract_features(
        run, "features-float32", section, ExtractJob(str(weights), (str(run / "world" / "images"),))
    )
    store32 = done.directory / done.outputs["store"]
    store16 = run / "features" / manifest["outputs"]["store"]
    preds = {}
    for name, store in (("float16", store16), ("float32", store32)):
        out = run / f"eval-dtype-{name}"
        _cli(
            "evaluate",
            "--model",
            str(run / f"train-{args.captioner}" / "best.pt"),
            "--store",
            str(store),
            "--data",
            str(run / "data"),
            "--split",
            args.split,
            "--metrics",
            "cider",
            "--output",
            str(out / "metrics.json"),
        )
        preds[name] = {
            p["image_id"]: p["caption"] for p in json.loads((out / f"predictions_{args.split}.json").read_text())
        }
        metrics = json.loads((out / "metrics.json").read_text())["metrics"]
        print(f"{name}: {len(preds[name])} captions, CIDEr-D {metrics.get('CIDEr')}")
    changed = sum(preds["float16"][k] != preds["float32"].get(k) for k in preds["float16"])
    print(f"captions that differ between float16 and float32 features: {changed} of {len(preds['float16'])}")


if __name__ == "__main__":
    main()
