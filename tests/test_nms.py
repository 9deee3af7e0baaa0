"""extractors.nms: every class's greedy NMS at once equals one torchvision call per class, index for index."""

from __future__ import annotations

import pytest
import torch
from torchvision.ops import nms as tv_nms

from extractors import box_coding, nms, selector


def _loop_keeps(boxes: torch.Tensor, scores: torch.Tensor, thresh: float, legacy: bool) -> list[torch.Tensor]:
    if legacy:
        return [box_coding.nms_boxes(boxes, scores[:, c], thresh, legacy=True) for c in range(scores.shape[1])]
    return [tv_nms(boxes, scores[:, c], thresh) for c in range(scores.shape[1])]


def _assert_same_keeps(boxes: torch.Tensor, scores: torch.Tensor, thresh: float, legacy: bool = True) -> None:
    mask = nms.per_class_keep(boxes, scores, thresh, legacy)
    loop = _loop_keeps(boxes, scores, thresh, legacy)
    for c, ref in enumerate(loop):
        got = nms.kept_in_rank_order(mask[:, c], scores[:, c])
        assert torch.equal(got, ref), f"class {c}: {got.tolist()} != {ref.tolist()}"


def _random(g: torch.Generator, r: int, k: int, spread: float = 500.0) -> tuple[torch.Tensor, torch.Tensor]:
    xy = torch.rand(r, 2, generator=g) * spread
    boxes = torch.cat([xy, xy + 5 + torch.rand(r, 2, generator=g) * 200], 1)
    return boxes, torch.softmax(torch.randn(r, k + 1, generator=g) * 3, 1)[:, 1:].contiguous()


@pytest.mark.parametrize("legacy", [True, False])
@pytest.mark.parametrize(
    "r,k,t,spread",
    [(1, 3, 0.3, 500.0), (40, 70, 0.3, 500.0), (90, 65, 0.5, 150.0), (120, 9, 0.1, 300.0), (60, 64, 0.7, 50.0)],
)
def test_random_cases_equal_the_torchvision_loop(r, k, t, spread, legacy):
    g = torch.Generator().manual_seed(r * 7 + k)
    boxes, scores = _random(g, r, k, spread)
    _assert_same_keeps(boxes, scores, t, legacy)


def test_ties_duplicates_and_degenerate_boxes():
    """Equal scores (only 3 distinct values), identical boxes, zero-area boxes and a cluster where everything
    overlaps: ties must break by index exactly as the kernel's stable sort does."""
    g = torch.Generator().manual_seed(3)
    boxes, _ = _random(g, 80, 1, 120.0)
    boxes[10:20] = boxes[0]  # exact duplicates of box 0
    boxes[30:35, 2:] = boxes[30:35, :2]  # zero-size (a point: +1 areas make it 1x1)
    boxes[40:60] = torch.tensor([100.0, 100.0, 180.0, 160.0]) + torch.randn(20, 4, generator=g)  # one dense cluster
    scores = torch.randint(0, 3, (80, 50), generator=g).float() / 2  # heavy ties, zeros included
    for legacy in (True, False):
        _assert_same_keeps(boxes, scores, 0.3, legacy)
    _assert_same_keeps(boxes, torch.zeros(80, 4), 0.3)  # all scores equal: pure index order


def test_iou_exactly_at_the_threshold():
    """Caffe suppresses at IoU == thresh (+1 areas): 30 / 100 is exactly float32(0.3) here; torchvision keeps."""
    boxes = torch.tensor([[0.0, 0.0, 9.0, 9.0], [0.0, 0.0, 9.0, 2.0], [50.0, 50.0, 59.0, 59.0]])
    scores = torch.tensor([[0.9, 0.1], [0.8, 0.7], [0.5, 0.5]])
    mask = nms.per_class_keep(boxes, scores, 0.3, legacy=True)
    assert mask[:, 0].tolist() == [True, False, True]  # box 1 suppressed by box 0 in class 0
    assert mask[:, 1].tolist() == [False, True, True]  # box 0 suppressed by box 1 in class 1
    _assert_same_keeps(boxes, scores, 0.3, legacy=True)
    _assert_same_keeps(boxes + torch.tensor([0.0, 0.0, 1.0, 1.0]), scores, 0.3, legacy=False)


def test_real_size_300x1600_and_max_conf_batched_with_padding():
    g = torch.Generator().manual_seed(11)
    b1, s1 = _random(g, 300, 1600)
    b2, s2 = _random(g, 250, 1600)
    _assert_same_keeps(b1, s1, 0.3)
    boxes = torch.zeros(2, 300, 4)
    scores = torch.zeros(2, 300, 1600)
    boxes[0], scores[0], boxes[1, :250], scores[1, :250] = b1, s1, b2, s2
    valid = torch.zeros(2, 300, dtype=torch.bool)
    valid[0], valid[1, :250] = True, True
    got = nms.max_conf(boxes, scores, 0.3, valid)
    assert torch.equal(got[0], selector.max_conf_loop(b1, s1, 0.3))
    assert torch.equal(got[1, :250], selector.max_conf_loop(b2, s2, 0.3))
    assert (got[1, 250:] == 0).all()
    assert torch.equal(selector.max_conf_vectorized(boxes, scores, 0.3, valid), got)  # the CPU entry point uses it


def test_empty_inputs():
    assert nms.per_class_keep(torch.zeros(0, 4), torch.zeros(0, 5)).shape == (0, 5)
    assert nms.max_conf(torch.zeros(3, 4), torch.zeros(3, 0)).tolist() == [0.0, 0.0, 0.0]


def _random_case(seed: int, ties: bool, padded: bool):
    g = torch.Generator().manual_seed(seed)
    b, r, k = 3, 120, 70
    xy = torch.rand(b, r, 2, generator=g) * 200
    boxes = torch.cat([xy, xy + torch.rand(b, r, 2, generator=g) * 80 + 2], -1)
    scores = torch.rand(b, r, k, generator=g)
    if ties:
        scores = (scores * 4).round() / 4  # many equal scores: the lower index goes first
    valid = torch.rand(b, r, generator=g) > 0.2 if padded else None
    return boxes, scores, valid


@pytest.mark.parametrize("seed", range(4))
def test_device_fixed_point_equals_the_cpu_path(seed) -> None:
    """The torch-operator solver the GPU runs (here on CPU tensors) gives exactly the packed-word CPU result."""
    from extractors import nms

    boxes, scores, valid = _random_case(seed, ties=seed % 2 == 1, padded=seed >= 2)
    assert torch.equal(nms.max_conf_device(boxes, scores, 0.3, valid), nms.max_conf(boxes, scores, 0.3, valid))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("seed", range(4))
def test_cuda_per_class_nms_equals_the_cpu_path(seed) -> None:
    boxes, scores, valid = _random_case(seed, ties=seed % 2 == 1, padded=seed >= 2)
    cpu = selector.max_conf_vectorized(boxes, scores, 0.3, valid)
    gpu = selector.max_conf_vectorized(boxes.cuda(), scores.cuda(), 0.3, valid.cuda() if valid is not None else None)
    assert torch.equal(gpu.cpu(), cpu)
