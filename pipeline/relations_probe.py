"""Mirror probe of the relations comparison: how much left/right direction reaches the decoder of a trained row.

Every test image of the relations world holds two objects. The probe mirrors each scene horizontally
(``x -> W - x``: the boxes passed beside the features and, for a store with box features, the box part of the
oracle features, :mod:`pipeline.world.oracle_features`) and compares the model on the original and the mirrored
scene, with the inputs the evaluation gives it (:class:`pipeline.data.CaptionDataset` on the test split,
:func:`pipeline.data.collate_images`, the checkpoint's weights in eval mode):

* **output** (a): each test reference caption holding "to the left of" / "to the right of" is teacher-forced up to
  the relation word, and ``m = log P(left) - log P(right)`` is read there, signed so that ``m > 0`` names the
  caption's (true) word. On the mirrored scene the true word is the other one, so a model that reads direction
  gives ``m(orig) > 0 > m(mirror)``; ``change = m(orig) - m(mirror)`` (nats, mean over captions) is 0 for a model
  that cannot see direction. ``acc`` is the share of left/right choices the sign of ``m`` gets right, over the
  original and the mirrored scenes together (0.5: guessing between the two words).
* **encoder** (b): per encoder layer, the relative change ``||h(orig) - h(mirror)|| / ||h(orig)||`` of each real
  region's output (the residual stream after the layer; ``memory``: after the final LayerNorm, what the decoder
  reads), mean over regions. A mirror-symmetric input (Eq. 8 alone, ``ngsan``) gives exactly 0.
  For every layer, the attention weight each region puts on the *other* regions (1 - weight on itself), mean over
  regions and heads, on the original and mirrored scenes, and the mean over regions and heads of its absolute change
  (``|d att|``): how far the signed geometry moves the mixing of the two regions.

``python -m pipeline.relations_probe RUN_DIR [--rows ROW ...] [--json FILE]``: every ``RUN_DIR/train-<row>[-seedN]``
with a ``best.pt`` (the checkpoint the demo's eval stage decodes), the store named in its manifest and the prepared
data ``RUN_DIR/data``. The table (mean ± sd over the seeds of a row) goes to stdout.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from rich.table import Table

from models.captioners.base import Captioner
from models.loading import load_captioner
from pipeline.caption_data.prepared import PreparedCaptions
from pipeline.core.console import get_logger, setup_logging, stdout_console
from pipeline.core.errors import PipelineError, UsageError
from pipeline.core.fileio import read_json
from pipeline.data import CaptionDataset
from pipeline.data.dataset import collate_images
from pipeline.store import FeatureStore
from pipeline.world.oracle_features import oracle_dim
from pipeline.world.vocab import COLOUR_NAMES, SHAPES, SIZE_NAMES

log = get_logger("relations_probe")

BOX_OFFSET = len(SHAPES) + len(COLOUR_NAMES) + len(SIZE_NAMES)  # where the oracle's box features start
SEED_SUFFIX = re.compile(r"-seed\d+$")


# --- mirroring ---------------------------------------------------------------------------------------------------
def mirror_boxes(boxes: torch.Tensor, sizes: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Pixel boxes ``(B, N, 4)`` of the horizontally mirrored images: ``x1' = W - x2``, ``x2' = W - x1`` (padding
    rows stay 0)."""
    w = sizes[:, 0].to(boxes.dtype)[:, None]
    out = boxes.clone()
    out[..., 0] = w - boxes[..., 2]
    out[..., 2] = w - boxes[..., 0]
    return out * mask[..., None].to(boxes.dtype)


def mirror_box_features(feats: torch.Tensor, mask: torch.Tensor, offset: int = BOX_OFFSET) -> torch.Tensor:
    """Oracle features with the normalised box ``(x1/W, y1/H, x2/W, y2/H, sqrt(area))`` at ``offset`` mirrored:
    ``x1/W -> 1 - x2/W``, ``x2/W -> 1 - x1/W`` (the feature noise moves with its component, so the mirrored
    feature is as likely a draw as the original)."""
    out = feats.clone()
    out[..., offset] = 1.0 - feats[..., offset + 2]
    out[..., offset + 2] = 1.0 - feats[..., offset]
    return out * mask[..., None].to(feats.dtype)


def store_has_box_features(store: FeatureStore) -> bool:
    """True for an oracle store whose features hold the normalised box (:func:`oracle_dim`)."""
    ident = store.identity
    if ident.get("name") != "oracle" or not ident.get("box_features", True):
        return False
    return store.feature_dim == oracle_dim(int(ident.get("extra_dims", 0)), True)


def mirror_batch(batch: dict[str, Any], box_features: bool) -> dict[str, Any]:
    """The batch of the mirrored scenes (boxes, and the box part of the features when ``box_features``)."""
    out = dict(batch)
    out["boxes"] = mirror_boxes(batch["boxes"], batch["sizes"], batch["mask"])
    if box_features:
        out["feats"] = mirror_box_features(batch["feats"], batch["mask"])
    return out


# --- (a) the output: log P(left) - log P(right) at the relation word -------------------------------------------------
def direction_margins(
    model: Captioner, batch: dict[str, Any], left_id: int, right_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(m, sign)`` for every caption of ``batch`` that holds ``left_id`` or ``right_id``: ``m`` is
    ``log P(left) - log P(right)`` teacher-forced at that word, ``sign`` +1 where the caption says left, -1 right."""
    caps, image = batch["captions"], batch["caption_image"]
    hit = (caps == left_id) | (caps == right_id)
    rows = hit.any(1).nonzero()[:, 0]
    if not len(rows):
        return torch.zeros(0), torch.zeros(0)
    pos = hit[rows].float().argmax(1)  # first relation word of each caption (column in caps, after BOS)
    logp = model(
        batch["feats"].float(), batch["mask"], batch["boxes"], batch["sizes"], caps[rows], image[rows]
    )  # (C, T, V): position t predicts token t + 1
    at = logp[torch.arange(len(rows)), pos - 1]
    sign = torch.where(caps[rows, pos] == left_id, 1.0, -1.0)
    return (at[:, left_id] - at[:, right_id]).double(), sign.double()


def output_probe(
    model: Captioner, batch: dict[str, Any], mirrored: dict[str, Any], left_id: int, right_id: int
) -> dict[str, float]:
    """Margins on the original and mirrored scenes, signed by the caption's word (see the module docstring)."""
    m0, sign = direction_margins(model, batch, left_id, right_id)
    m1, _ = direction_margins(model, mirrored, left_id, right_id)
    s0, s1 = m0 * sign, m1 * sign
    n = len(s0)
    if not n:
        return {"captions": 0}
    return {
        "captions": n,
        "margin_orig": float(s0.mean()),
        "margin_mirror": float(s1.mean()),
        "change": float((s0 - s1).mean()),
        "acc": float(((s0 > 0).double().mean() + (s1 < 0).double().mean()) / 2),
    }


# --- (b) the encoder: per-layer states and attention --------------------------------------------------------------
@torch.no_grad()
def encoder_trace(model: Captioner, batch: dict[str, Any]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The encoder's residual stream after every layer then the memory (after the final LayerNorm), each ``(B, N, d)``,
    and every layer's self-attention logits ``(B, H, N, N)`` (content plus geometric bias, before the key mask and
    softmax), computed as :meth:`SelfAttentionCaptioner.encode` does
    (the layer outputs come from the layers themselves; the weights are recomputed from the same projections and
    checked to give the layer's attention output)."""
    feats, mask, boxes, sizes = batch["feats"].float(), batch["mask"].bool(), batch["boxes"], batch["sizes"]
    x, rel = model.encoder_input(feats, mask, boxes, sizes)
    states, logits = [], []
    for layer in model.encoder.layers:
        h = layer.norm1(x)
        bias = layer.geometry(h, rel) if layer.geometry is not None else None
        attn = layer.attn
        q = attn.project_query(h, mask)
        k, v = attn.project_kv(h, mask)
        scores = (q @ k.transpose(-2, -1)) * (q.shape[-1] ** -0.5)
        if bias is not None:
            scores = scores + bias
        probs = scores.masked_fill(~mask[:, None, None, :], float("-inf")).softmax(-1)
        b, nh, n, dk = v.shape
        mixed = attn.out_proj((probs @ v).transpose(1, 2).reshape(b, n, nh * dk))
        direct = attn(h, h, mask, bias)
        if not torch.allclose(mixed, direct, atol=1e-5, rtol=1e-4):
            raise RuntimeError("recomputed encoder attention differs from the layer's own")
        x = layer(x, mask, rel)
        states.append(x)
        logits.append(scores)
    states.append(model.encoder.norm(x))
    return states, logits


def relative_change(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean over real regions of ``||a - b|| / ||a||``."""
    num = (a - b).norm(dim=-1)
    den = a.norm(dim=-1).clamp_min(1e-12)
    return float((num / den)[mask].mean())


def attention_on_others(probs: torch.Tensor) -> torch.Tensor:
    """``(B, H, N)``: the weight each region puts on the other regions (1 - its weight on itself)."""
    return 1.0 - probs.diagonal(dim1=-2, dim2=-1)


def encoder_probe(model: Captioner, batch: dict[str, Any], mirrored: dict[str, Any]) -> dict[str, list[float]]:
    """Per-layer relative changes (the last entry: the memory), attention on the other regions, and how far
    mirroring moves the logit gap ``z_ij - z_ii`` between another region and the region itself (``logit_change``;
    ``logit_gap``: the mean ``|z_ij - z_ii|`` of the original scene), over real pairs ``i != j`` and heads."""
    mask = batch["mask"].bool()
    s0, z0 = encoder_trace(model, batch)
    s1, z1 = encoder_trace(model, mirrored)
    key_mask = ~mask[:, None, None, :]
    w0 = [z.masked_fill(key_mask, float("-inf")).softmax(-1) for z in z0]
    w1 = [z.masked_fill(key_mask, float("-inf")).softmax(-1) for z in z1]
    out: dict[str, list[float]] = {"rel_change": [relative_change(a, b, mask) for a, b in zip(s0, s1)]}
    sel = mask[:, None, :].expand(-1, w0[0].shape[1], -1)  # (B, H, N) real query regions
    out["att_other_orig"] = [float(attention_on_others(p)[sel].mean()) for p in w0]
    out["att_other_mirror"] = [float(attention_on_others(p)[sel].mean()) for p in w1]
    out["att_change"] = [
        float((attention_on_others(p) - attention_on_others(r)).abs()[sel].mean()) for p, r in zip(w0, w1)
    ]
    n = mask.shape[1]
    pairs = (mask[:, :, None] & mask[:, None, :] & ~torch.eye(n, dtype=torch.bool)[None])[:, None].expand_as(z0[0])

    def gap(z: torch.Tensor) -> torch.Tensor:
        return z - z.diagonal(dim1=-2, dim2=-1)[..., :, None]

    out["logit_gap"] = [float(gap(z).abs()[pairs].mean()) for z in z0]
    out["logit_change"] = [float((gap(a) - gap(b)).abs()[pairs].mean()) for a, b in zip(z0, z1)]
    return out


# --- runs ---------------------------------------------------------------------------------------------------------
def find_runs(run_dir: Path, rows: list[str] | None = None) -> dict[str, list[Path]]:
    """``{row: [train dirs of its seeds]}`` for every ``train-<row>[-seedN]/best.pt`` under ``run_dir``."""
    found: dict[str, list[Path]] = defaultdict(list)
    for ckpt in sorted(run_dir.glob("train-*/best.pt")):
        row = SEED_SUFFIX.sub("", ckpt.parent.name[len("train-") :])
        if rows is None or row in rows:
            found[row].append(ckpt.parent)
    return dict(found)


def probe_run(train_dir: Path, prepared: PreparedCaptions, split: str = "test") -> dict[str, Any]:
    """Both probes for one trained run, on ``split`` (one batch of all its images)."""
    manifest = read_json(train_dir / "manifest.json", what="stage manifest")
    store = FeatureStore(manifest["config"]["store"])
    model, _ = load_captioner(train_dir / "best.pt", "cpu", prepared.vocab)
    model.eval()
    dataset = CaptionDataset(store, prepared, split)
    batch = collate_images([dataset[i] for i in range(len(dataset))])
    box_features = store_has_box_features(store)
    mirrored = mirror_batch(batch, box_features)
    left_id, right_id = prepared.vocab.id("left"), prepared.vocab.id("right")
    with torch.no_grad():
        result: dict[str, Any] = {"run": train_dir.name, "images": len(dataset), "box_features": box_features}
        result.update(output_probe(model, batch, mirrored, left_id, right_id))
        if hasattr(model, "encoder") and hasattr(model, "att_embed"):
            result.update(encoder_probe(model, batch, mirrored))
    return result


def _mean_sd(values: list[float]) -> str:
    values = [v for v in values if not math.isnan(v)]
    if not values:
        return "-"
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.fmean(values):.3f}±{sd:.3f}"


def output_table(results: dict[str, list[dict[str, Any]]]) -> Table:
    """(a), mean ± sd over the seeds of each row."""
    table = Table(title="(a) log P(left) - log P(right) at the relation word, signed to the true word (nats)")
    for col in ("row", "seeds", "captions", "orig", "mirrored", "change", "acc L/R"):
        table.add_column(col)
    for row, rs in results.items():
        cells = [row, str(len(rs)), str(rs[0].get("captions", 0))]
        cells += [_mean_sd([r.get(k, math.nan) for r in rs]) for k in ("margin_orig", "margin_mirror", "change", "acc")]
        table.add_row(*cells)
    return table


def encoder_table(results: dict[str, list[dict[str, Any]]]) -> Table:
    """(b), mean ± sd over the seeds of each row, one line per encoder layer (``memory``: after the final norm)."""
    table = Table(title="(b) encoder under mirroring, per layer")
    for col in ("row", "layer", "||dh||/||h||", "att other orig", "att other mirr", "|d att|", "|z gap|", "|d z gap|"):
        table.add_column(col)
    for row, rs in results.items():
        rs = [r for r in rs if "rel_change" in r]
        if not rs:
            continue
        layers = len(rs[0]["rel_change"]) - 1
        for i in range(layers + 1):
            cells = [row, f"L{i + 1}" if i < layers else "memory", _mean_sd([r["rel_change"][i] for r in rs])]
            if i < layers:
                keys = ("att_other_orig", "att_other_mirror", "att_change", "logit_gap", "logit_change")
                cells += [_mean_sd([r[k][i] for r in rs]) for k in keys]
            table.add_row(*cells)
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipeline.relations_probe", description=__doc__.split("\n")[0])
    parser.add_argument("run_dir", type=Path, help="the demo's output folder (train-<row>*/best.pt, data/)")
    parser.add_argument("--rows", nargs="+", default=None, help="rows to probe (default: every trained row)")
    parser.add_argument("--split", default="test")
    parser.add_argument("--json", type=Path, default=None, help="also write every run's numbers to this file")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    args = parser.parse_args(argv)
    setup_logging()
    torch.set_num_threads(args.threads)
    runs = find_runs(args.run_dir, args.rows)
    if not runs:
        raise UsageError(f"no train-*/best.pt under {args.run_dir}" + (f" for rows {args.rows}" if args.rows else ""))
    prepared = PreparedCaptions.load(args.run_dir / "data")
    results: dict[str, list[dict[str, Any]]] = {}
    for row, dirs in runs.items():
        for d in dirs:
            log.info("probing %s", d.name)
            r = probe_run(d, prepared, args.split)
            log.info(
                "%s: change %.3f nats, acc %.3f, rel change per layer %s",
                d.name,
                r.get("change", math.nan),
                r.get("acc", math.nan),
                ", ".join(f"{v:.4f}" for v in r.get("rel_change", [])),
            )
            results.setdefault(row, []).append(r)
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1))
    console = stdout_console()
    console.print(output_table(results))
    console.print(encoder_table(results))
    return 0


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except PipelineError as exc:  # a user mistake (no runs, a missing store): one line, no traceback
        sys.stderr.write(f"error: {exc}\n")
        raise SystemExit(2) from None
