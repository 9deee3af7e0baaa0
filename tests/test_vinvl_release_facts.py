"""Release facts of VinVL's test-time post-processing, pinned on synthetic tensors (no weights, no photos).

Each assertion restates one line of microsoft/scene_graph_benchmark (maskrcnn_benchmark ``PostProcessor``,
``BoxCoder.decode``, ``BoxList.clip_to_image``; ``AttributePostProcessor``) as read for review 22
(docs/recipes.md#vinvl). The end-to-end comparison lives in tests/test_vinvl.py; these keep each rule visible
on its own so that a change to one of them fails here with the rule's name.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch

from extractors import box_coding
from extractors.vinvl import select as vinvl_select


def _recipe(**kw):
    base = dict(
        conf_thresh=0.2,
        min_boxes=10,
        max_boxes=100,
        nms_thresh=0.3,
        roi_nms_thresh=0.5,
        nms_variant="torchvision",
        ignore_box_regression=True,
        nms_filter=1,
    )
    base.update(kw)
    return SimpleNamespace(**base)


def _disjoint_boxes(n: int) -> torch.Tensor:
    """n boxes that never overlap (every NMS keeps all of them)."""
    x = torch.arange(n, dtype=torch.float32) * 20.0
    return torch.stack([x, torch.zeros(n), x + 10.0, torch.full((n,), 10.0)], dim=1)


def _probs_with_best(best: torch.Tensor, labels: torch.Tensor, classes: int = 6) -> torch.Tensor:
    """Rows whose best foreground score is ``best`` at ``labels``; the rest of the mass on the background."""
    p = torch.zeros(best.numel(), classes)
    p[torch.arange(best.numel()), labels] = best
    p[:, 0] = 1.0 - best
    return p


def test_peter_threshold_is_inclusive_and_the_minimum_fills_with_the_best_below():
    # filter_results_peter: keep_boxes = nonzero(scores_pre >= score_thresh); fewer than MIN_DETECTIONS_PER_IMG
    # -> the top 10 by score (below the threshold too); sorted descending; the feature row is the proposal's.
    n = 14
    props = _disjoint_boxes(n)
    best = torch.tensor([0.2, 0.05, 0.9, 0.01, 0.3, 0.02, 0.03, 0.04, 0.06, 0.07, 0.08, 0.09, 0.011, 0.012])
    labels = torch.tensor([1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3, 4])
    probs = _probs_with_best(best, labels)
    boxes = vinvl_select.class_boxes(props, None, probs.shape[1], (100, 400), True)
    pick = vinvl_select.filter_peter(boxes, probs, _recipe(), same_boxes=True)
    order = torch.argsort(best, descending=True)
    assert pick.rows.tolist() == order[:10].tolist()  # 3 reach 0.2 (0.2 itself included) -> filled to 10
    assert torch.equal(pick.labels, labels[order[:10]])
    assert torch.allclose(pick.scores, best[order[:10]])
    # with min_boxes 2 exactly the three at or above 0.2 remain: the test is >=, not >
    few = vinvl_select.filter_peter(boxes, probs, _recipe(min_boxes=2), same_boxes=True)
    assert few.rows.tolist() == [2, 4, 0]
    # more than DETECTIONS_PER_IMG at or above the threshold -> the best max_boxes
    cap = vinvl_select.filter_peter(boxes, probs, _recipe(min_boxes=1, max_boxes=2), same_boxes=True)
    assert cap.rows.tolist() == [2, 4]


def test_standard_filter_is_strict_and_halves_the_threshold():
    # filter_results: inds = scores > score_thresh (strict); fewer than 10 -> score_thresh /= 2, rerun (10 tries)
    n = 12
    props = _disjoint_boxes(n)
    best = torch.tensor([0.2] + [0.1] * 8 + [0.3, 0.0501, 0.04])
    labels = torch.tensor([1] * n)
    probs = _probs_with_best(best, labels)
    boxes = vinvl_select.class_boxes(props, None, probs.shape[1], (100, 400), True)
    once = vinvl_select._filter_standard_once(boxes, probs, _recipe(nms_filter=0), 0.2)
    assert once.rows.tolist() == [9]  # 0.2 itself is not > 0.2
    pick = vinvl_select.filter_standard(boxes, probs, _recipe(nms_filter=0))
    # 0.2 -> 1 kept; 0.1 -> 2 (0.2, 0.3); 0.05 -> 11 (every score above 0.05, 0.0501 included; not 0.04)
    assert sorted(pick.rows.tolist()) == list(range(11))


def test_fast_filter_candidates_and_count():
    # filter_results_fast: candidates scores > 0.01 * score_thresh, one class-agnostic NMS, min(max(n, 10), 100)
    n = 7
    props = _disjoint_boxes(n)
    best = torch.tensor([0.5, 0.0021, 0.0019, 0.3, 0.01, 0.02, 0.03])
    probs = _probs_with_best(best, torch.tensor([1] * n))
    pick = vinvl_select.filter_fast(props, probs, _recipe(nms_filter=2))
    assert pick.rows.tolist() == [0, 3, 6, 5, 4, 1]  # 0.0019 is not > 0.002; the rest fill up to 10, sorted
    more = _disjoint_boxes(120)
    probs120 = _probs_with_best(torch.linspace(0.9, 0.21, 120), torch.tensor([2] * 120))
    assert vinvl_select.filter_fast(more, probs120, _recipe(nms_filter=2)).rows.tolist() == list(range(100))


def test_attribute_cap_counts_the_zeroed_entries_like_the_release():
    # AttributePostProcessor.filter_results: kthvalue over the whole flattened score matrix *after* zeroing, so
    # the zeros take the low ranks and MAX_NUM_ATTR_PER_IMG (100) removes nothing while most entries are zero.
    k, a = 120, 525
    logits = torch.full((k, a), -20.0)
    logits[:, 3] = 0.0  # one attribute per box with softmax ~1 (> 0.05): 120 survivors > 100
    idx, score = vinvl_select.attribute_top(logits, 0.05, 100)
    assert (score > 0.05).sum().item() == 120
    assert torch.equal(idx, torch.full((k,), 3))
    # column 0 ("no attribute") is never chosen
    logits2 = torch.full((2, a), -20.0)
    logits2[:, 0] = 5.0
    logits2[:, 9] = 4.0
    idx2, score2 = vinvl_select.attribute_top(logits2, 0.05, 100)
    assert idx2.tolist() == [9, 9] and bool((score2 > 0.05).all())


def test_box_coder_plus_one_decode_clamp_and_clip():
    # BoxCoder.decode: w = x2 - x1 + 1, ctr = x1 + 0.5 w, x2' = ctr' + 0.5 w' - 1, dw clamped at log(1000 / 16)
    box = torch.tensor([[10.0, 20.0, 29.0, 59.0]])  # w 20, h 40
    zero = box_coding.decode(torch.zeros(1, 4), box, (1.0, 1.0, 1.0, 1.0), legacy=True, x2_minus_one=True)
    assert torch.allclose(zero, box)
    big = box_coding.decode(
        torch.tensor([[0.0, 0.0, 10.0, 10.0]]), box, (1.0, 1.0, 1.0, 1.0), legacy=True, x2_minus_one=True
    )
    clamp = math.log(1000.0 / 16)
    assert abs(box_coding.DEFAULT_SCALE_CLAMP - clamp) < 1e-12
    w = 20 * math.exp(clamp)
    assert torch.allclose(big[0, [0, 2]], torch.tensor([20.0 - w / 2, 20.0 + w / 2 - 1]), rtol=1e-6)
    # weights (10, 10, 5, 5) divide the deltas
    reg = box_coding.decode(
        torch.tensor([[10.0, 0.0, 5.0 * math.log(2), 0.0]]), box, (10.0, 10.0, 5.0, 5.0), legacy=True, x2_minus_one=True
    )
    assert torch.allclose(reg, torch.tensor([[20.0, 20.0, 59.0, 59.0]]), atol=1e-4)  # ctr 20 + 1 * 20, w 20 * 2
    # clip_to_image: x to [0, W - 1], y to [0, H - 1]
    clipped = vinvl_select.clip_legacy(torch.tensor([[-5.0, -5.0, 700.0, 500.0]]), 400, 600)
    assert clipped.tolist() == [[0.0, 0.0, 599.0, 399.0]]
