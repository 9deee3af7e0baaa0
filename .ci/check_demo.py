"""CI check of the reduced demo's summary: metrics above a floor, pictures written, or (--second) every stage
skipped on a re-run, or (--compare a,b,c) a comparison run over the same run directory: one metrics row per
name, the shared stages skipped, or (--relations a,b,c TABLE) the relations comparison (configs/demo_relations.yaml
--quick): one row per name with its relation rate and guessing rate, every seed's run recorded, and the printed
table (TABLE: the command's output) holding every name.
Usage: python .ci/check_demo.py RUN_DIR [--second | --compare NAMES | --relations NAMES TABLE]"""

from __future__ import annotations

import json
import sys
from pathlib import Path

# Floors for the --quick demo (240 images, 150 detector iterations, 4 XE + 1 SCST epochs of a small NG-SAN).
# A captioner that ignores the image scores far lower on these templated captions. The same code trains to
# different weights on different CPUs (float rounding): CIDEr-D 0.377 on one 2-core machine, 0.222 with BLEU-4
# 0.072 on another (docs/benchmarks.md, the quick demo), so the floors sit below both.
FLOORS = {"CIDEr": 0.15, "Bleu_4": 0.05, "ROUGE_L": 0.30}


def main() -> int:
    run = Path(sys.argv[1])
    args = sys.argv[2:]
    second = "--second" in args
    compare = args[args.index("--compare") + 1].split(",") if "--compare" in args else []
    relations = args[args.index("--relations") + 1].split(",") if "--relations" in args else []
    summary = json.loads((run / "summary.json").read_text())
    problems = []
    if relations:
        table = Path(args[args.index("--relations") + 2]).read_text(encoding="utf-8")
        if list(summary["metrics"]) != relations:
            problems.append(f"relations rows {list(summary['metrics'])}, expected {relations}")
        for name in relations:
            ground = summary["grounding"].get(name, {})
            if not isinstance(ground.get("relation_chance"), float) or not ground.get("relations"):
                problems.append(f"{name}: no relation claims or no guessing rate in {ground}")
            if not summary["runs"].get(name):
                problems.append(f"{name}: no per-seed runs recorded")
            if not any(line.split() and line.split()[0] == name for line in table.splitlines()):
                problems.append(f"{name}: no row in the printed table")
        if "guess" not in table:
            problems.append("the printed table has no guess column")
    if second:
        ran = [s["stage"] for s in summary["stages"] if not s["skipped"]]
        if ran:
            problems.append(f"a second run redid stages {ran}")
    if compare:
        if list(summary["metrics"]) != compare:
            problems.append(f"comparison rows {list(summary['metrics'])}, expected {compare}")
        shared = [
            s["stage"]
            for s in summary["stages"]
            if s["stage"] in ("world", "detector", "features", "data") and not s["skipped"]
        ]
        if shared:
            problems.append(f"the comparison redid shared stages {shared}")
        trained = {s["stage"] for s in summary["stages"] if s["stage"].startswith("train-")}
        if trained != {f"train-{name}" for name in compare}:
            problems.append(f"train stages {sorted(trained)} do not match {compare}")
    for model, metrics in summary["metrics"].items():
        for name, floor in FLOORS.items():
            value = metrics.get(name)
            if value is None or value < floor:
                problems.append(f"{model}: {name} = {value} is below the floor {floor}")
    pictures = [p for pics in summary["pictures"].values() for p in pics]
    if not relations and not pictures or not all(Path(p).is_file() and Path(p).stat().st_size > 1000 for p in pictures):
        problems.append(f"pictures missing: {pictures}")
    print(
        json.dumps(
            {
                "metrics": summary["metrics"],
                "grounding": summary.get("grounding"),
                "detector": summary["detector"],
                "pictures": len(pictures),
                "stages": {s["stage"]: (s["skipped"], s["seconds"]) for s in summary["stages"]},
            },
            indent=1,
        )
    )
    for p in problems:
        print(f"demo check failed: {p}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
