"""Per-class NMS: every class at once (extractors.nms) vs one torchvision ``nms`` call per class.

The workload of the Caffe bottom-up extractor's selection: R proposals x K foreground classes (300 x 1600),
greedy NMS at 0.3 with ``+1`` areas in every class. Two box layouts: uniform random boxes, and clustered boxes
(20 objects, 15 jittered proposals each: a dense overlap graph, closer to real RPN output). The check is exact:
for every class the kept indices, in the order ``nms`` returns them, must be ``torch.equal`` to the loop's.
A third row times the ``max_conf`` the extractor uses (``extractors.selector.max_conf_vectorized`` on CPU vs
``max_conf_loop``), also exact.

    python -m bench --only nms [--size default|tiny]
"""

from __future__ import annotations

import torch

from bench.harness import Case
from extractors import box_coding, nms, selector

SIZES = {"tiny": (40, 30), "default": (300, 1600)}


def uniform_boxes(r: int, g: torch.Generator) -> torch.Tensor:
    """``r`` boxes with corners uniform in 500 px and sides of 10-310 px."""
    xy = torch.rand(r, 2, generator=g) * 500
    return torch.cat([xy, xy + 10 + torch.rand(r, 2, generator=g) * 300], 1)


def clustered_boxes(r: int, g: torch.Generator, objects: int = 20) -> torch.Tensor:
    """``r`` proposals jittered around ``objects`` boxes (many overlaps, as RPN output around objects)."""
    centres = torch.rand(objects, 2, generator=g) * 400
    wh = 30 + torch.rand(objects, 2, generator=g) * 200
    idx = torch.randint(0, objects, (r,), generator=g)
    xy = centres[idx] + torch.randn(r, 2, generator=g) * 15
    return torch.cat([xy, xy + wh[idx] * (0.8 + 0.4 * torch.rand(r, 2, generator=g))], 1)


def class_scores(r: int, k: int, g: torch.Generator) -> torch.Tensor:
    """Softmax scores over ``k + 1`` classes, background dropped: (r, k)."""
    return torch.softmax(torch.randn(r, k + 1, generator=g) * 3, 1)[:, 1:].contiguous()


def loop_keeps(boxes: torch.Tensor, scores: torch.Tensor, thresh: float = 0.3) -> list[torch.Tensor]:
    """The baseline: one torchvision NMS call per class (Caffe ``+1`` areas, ``IoU >= thresh``)."""
    return [box_coding.nms_boxes(boxes, scores[:, c], thresh, legacy=True) for c in range(scores.shape[1])]


def differing_classes(mask: torch.Tensor, loop: list[torch.Tensor], scores: torch.Tensor) -> float:
    """How many classes' kept index lists differ (0 when exact)."""
    if mask.shape[1] != len(loop):
        return float("inf")
    return float(
        sum(not torch.equal(nms.kept_in_rank_order(mask[:, c], scores[:, c]), ref) for c, ref in enumerate(loop))
    )


def cases(size: str = "default") -> list[Case]:
    """Kept indices on uniform and clustered boxes, and the extractor's ``max_conf``."""
    r, k = SIZES[size]
    g = torch.Generator().manual_seed(0)
    out = []
    for layout, boxes in (("uniform", uniform_boxes(r, g)), ("clustered", clustered_boxes(r, g))):
        scores = class_scores(r, k, g)
        out.append(
            Case(
                f"nms {layout}",
                "extractors.nms.per_class_keep",
                "torchvision nms per class",
                f"{r} boxes x {k} classes",
                lambda b=boxes, s=scores: nms.per_class_keep(b, s, 0.3),
                lambda b=boxes, s=scores: loop_keeps(b, s),
                lambda m, loop, s=scores: differing_classes(m, loop, s),
                0.0,
                note="exact: kept indices per class torch.equal to the loop's" if layout == "uniform" else "",
            )
        )
    boxes, scores = uniform_boxes(r, g), class_scores(r, k, g)
    out.append(
        Case(
            "nms max_conf",
            "selector.max_conf_vectorized",
            "selector.max_conf_loop",
            f"{r} boxes x {k} classes",
            lambda: selector.max_conf_vectorized(boxes, scores, 0.3),
            lambda: selector.max_conf_loop(boxes, scores, 0.3),
            lambda a, b: 0.0 if torch.equal(a, b) else float((a - b).abs().max()),
            0.0,
        )
    )
    return out


if __name__ == "__main__":
    from bench.__main__ import main

    raise SystemExit(main(["--only", "nms"]))
