"""Acceptance run of the grounded sentence encoder on the synthetic world (oracle region features).

Builds a world of --images images, prepares its captions and writes oracle features, trains the encoder
(CAP2IMG with and without self-attention, CAP2ALL), then a SAN captioner (XE then SCST), and prints the
caption-to-image / image-to-caption Recall@K of the test split's ground-truth captions and the
self-retrieval R@K of the captioner's XE and SCST test captions. Run on a GPU: ``python bench/encoder_world.py
--out /tmp/encw --images 4000``. Prints one table (stdout).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from pipeline.core.config import load_config
from pipeline.embedding.retrieval import evaluate_retrieval_files
from pipeline.embedding.train import train_encoder
from pipeline.training.api import evaluate_checkpoint, train_captioner

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from train_helpers import make_world_run  # noqa: E402

ENCODERS = {
    "cap2img+att": "{objective: cap2img}",
    "cap2img-noatt": "{objective: cap2img, self_attention: false, hidden_size: 2048}",
    "cap2all+att": "{objective: cap2all}",
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--images", type=int, default=4000)
    ap.add_argument("--epochs", type=int, default=15)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--only", default=",".join(ENCODERS))
    ap.add_argument("--captioner", action="store_true", help="also train SAN (XE + SCST) and report self-retrieval")
    args = ap.parse_args()
    t0 = time.time()
    run = args.out / "run"
    if not (run / "data").exists():
        run = make_world_run(args.out, num_images=args.images)
    print(f"world + oracle store ready in {time.time() - t0:.0f}s", flush=True)
    store, data = run / "features/store", run / "data"
    rows = []
    for name in args.only.split(","):
        t = time.time()
        cfg = load_config(
            "embed",
            None,
            [
                f"sentence_encoder.model_overrides={ENCODERS[name]}",
                f"sentence_encoder.epochs={args.epochs}",
                f"sentence_encoder.device={args.device}",
                f"sentence_encoder.store={store}",
                f"sentence_encoder.data={data}",
            ],
        )
        sub = args.out / f"enc-{name}"
        res = train_encoder(sub, cfg)
        rep = evaluate_retrieval_files(sub / "encoder/best.pt", store, data, "test", args.device)
        rows.append((name, rep["ground_truth"], time.time() - t))
        print(
            name,
            json.dumps(rep["ground_truth"]),
            f"best val {res.summary['best']}",
            f"{time.time() - t:.0f}s",
            flush=True,
        )
    if args.captioner:
        tiny = (
            "train.model_overrides={d_model: 256, num_heads: 8, d_ff: 1024, num_layers: 2, dropout: 0.1, "
            "embed_dropout: 0.1}"
        )
        cfg = load_config(
            "train",
            None,
            [
                "train.model=san",
                f"train.store={store}",
                f"train.data={data}",
                f"train.device={args.device}",
                tiny,
                "train.xe={epochs: 12, batch_size: 32, lr: 5.0e-4, warmup_iters: 500, decay_start_epoch: 100}",
                "train.scst={epochs: 6, batch_size: 32, lr: 5.0e-5, num_samples: 5}",
            ],
        )
        r = train_captioner(args.out / "cap", cfg)
        enc = args.out / "enc-cap2img+att/encoder/best.pt"
        for stage, ck in (("xe", "xe.pt"), ("scst", "last.pt")):
            ev = evaluate_checkpoint(
                r.directory / ck,
                store,
                data,
                "test",
                out_dir=r.directory / f"eval-{stage}",
                fast_only=True,
                device=args.device,
            )
            rep = evaluate_retrieval_files(enc, store, data, "test", args.device, predictions=ev["predictions"])
            rows.append((f"SAN {stage} captions (CIDEr-D {ev['metrics']['CIDEr']:.3f})", rep["generated"], 0.0))
            print(stage, ev["metrics"], json.dumps(rep["generated"]), flush=True)
    print(
        f"\n{'captions / encoder':44s} {'c2i R@1':>8s} {'R@5':>6s} {'R@10':>6s} {'i2c R@1':>8s} {'R@5':>6s} "
        f"{'R@10':>6s} {'chance':>7s}"
    )
    for name, m, _ in rows:
        print(
            f"{name:44s} {m['c2i_R@1']:8.2f} {m['c2i_R@5']:6.2f} {m['c2i_R@10']:6.2f} {m['i2c_R@1']:8.2f} "
            f"{m['i2c_R@5']:6.2f} "
            f"{m['i2c_R@10']:6.2f} {m['c2i_chance_R@1']:7.2f}"
        )


if __name__ == "__main__":
    main()
