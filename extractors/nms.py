"""Exact per-class greedy NMS for every class at once (CPU), with the classes packed into bit words.

The Caffe feature extractor (Anderson et al. 2018, ``generate_tsv.py``) runs greedy NMS once per foreground
class over *all* proposals. Per class ``c``, greedy NMS keeps a proposal ``i`` iff no *kept* proposal ``j``
ranked before it (higher score; equal scores: lower index, the stable order torchvision's kernel uses)
overlaps it (``IoU >= t`` with ``+1`` areas, Caffe ``cpu_nms``; ``IoU > t`` without, torchvision ``nms``)::

    keep_c(i) = not OR_{j in N(i), j before i in c} keep_c(j)                                  (1)

(1) only involves the *overlap graph* N, which is shared by all classes and sparse in practice; only the
order differs per class. So:

1. one IoU matrix per image (torchvision's ``box_iou`` on the same ``+1``-shifted float32 boxes as the
   kernel, hence identical values and comparisons) gives the undirected edges ``(a, b)``, ``a < b``;
2. per edge, one comparison row ``s[a] >= s[b]`` over all K classes says which end comes first in every class
   (ties go to the lower index); it is packed into ``ceil(K/64)`` 64-bit words, edges in cache-sized chunks;
3. (1) is solved by fixed-point (Jacobi) iteration on the packed words, all classes at once: start from
   "everything kept", apply (1) to every proposal, stop when nothing changes. On a DAG the fixed point of (1)
   is unique (induction along the order) and is reached after at most (longest chain of "before" edges + 1)
   sweeps, so the result is exactly greedy NMS per class, not an approximation.

The speed-up over a loop of K torchvision calls comes from sharing the IoU work and from replacing K
sequential kernels by a few sweeps over ``E x K/64`` words (``bench`` measures it: ``python -m bench --only
nms``). :func:`per_class_keep` returns the kept mask per class; :func:`max_conf` the ``generate_tsv.py``
``max_conf`` (the per-proposal max score over the classes that kept it), which
``extractors.selector.max_conf_vectorized`` calls on CPU.

On a GPU, :func:`max_conf_device` solves the same fixed point (1) with torch operators on the device: the edges
of every image of a batch at once, the classes unpacked (a bool per edge and class), each sweep one gather, one
scatter-max and one comparison; a few sweeps instead of one sequential step per proposal rank.
"""

from __future__ import annotations

import numpy as np
import torch
from torchvision.ops import box_iou

_WORD = 64
_CHUNK = 256  # edges per comparison chunk: keeps the (chunk, K) temporaries in cache


def overlap_edges(boxes: torch.Tensor, thresh: float, legacy: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Undirected edges ``(a, b)``, ``a < b``, of the overlap graph: ``IoU >= thresh`` on ``+1`` areas (Caffe
    ``cpu_nms``) when ``legacy``, else ``IoU > thresh`` (torchvision ``nms``). ``boxes``: (R, 4) x1y1x2y2."""
    b = boxes.detach().to("cpu", torch.float32)
    if legacy:
        b = b + torch.tensor([0.0, 0.0, 1.0, 1.0])
        over = box_iou(b, b) >= torch.tensor(thresh, dtype=torch.float32)
    else:
        over = box_iou(b, b).double() > thresh
    a, c = np.nonzero(np.triu(over.numpy(), k=1))
    return a, c


def _first_bits(scores: np.ndarray, a: np.ndarray, c: np.ndarray, words: int) -> np.ndarray:
    """(E, words) uint64: bit k set iff proposal ``a[e]`` comes before ``c[e]`` in class k (``s >=``, a < c)."""
    e, k = a.shape[0], scores.shape[1]
    out = np.zeros((e, words * 8), np.uint8)
    chunk = min(_CHUNK, max(e, 1))
    sa = np.empty((chunk, k), scores.dtype)
    sc = np.empty((chunk, k), scores.dtype)
    first = np.empty((chunk, k), bool)
    for lo in range(0, e, chunk):
        hi = min(e, lo + chunk)
        n = hi - lo
        np.take(scores, a[lo:hi], axis=0, out=sa[:n])
        np.take(scores, c[lo:hi], axis=0, out=sc[:n])
        np.greater_equal(sa[:n], sc[:n], out=first[:n])
        out[lo:hi, : (k + 7) // 8] = np.packbits(first[:n], axis=1, bitorder="little")
    return out.view(np.uint64)


def _solve(num: int, a: np.ndarray, c: np.ndarray, first: np.ndarray) -> np.ndarray:
    """Fixed point of Eq. (1) on packed class words: (num, words) uint64, bit k of row i = kept in class k."""
    words = first.shape[1]
    idx = np.arange(num)
    # directed "before" edges, grouped by the proposal they may suppress; one zero self-edge per proposal keeps
    # every group non-empty for reduceat
    src = np.concatenate([a, c, idx])
    dst = np.concatenate([c, a, idx])
    bits = np.concatenate([first, ~first, np.zeros((num, words), np.uint64)])
    order = np.argsort(dst, kind="stable")
    src, bits = src[order], bits[order]
    starts = np.searchsorted(dst[order], idx)
    kept = np.full((num, words), np.iinfo(np.uint64).max, np.uint64)
    for _ in range(num + 1):
        new = ~np.bitwise_or.reduceat(kept[src] & bits, starts, axis=0)
        if np.array_equal(new, kept):
            return kept
        kept = new
    raise RuntimeError("per-class NMS did not converge (non-finite scores?)")  # unreachable for finite scores


def per_class_keep(boxes: torch.Tensor, scores: torch.Tensor, thresh: float = 0.3, legacy: bool = True) -> torch.Tensor:
    """Greedy NMS per class, every class at once: (R, 4) boxes, (R, K) finite scores -> (R, K) bool kept mask.

    Column k equals ``torchvision.ops.nms`` on ``scores[:, k]`` (``legacy``: Caffe ``+1`` areas and
    ``IoU >= thresh``); :func:`kept_in_rank_order` turns a column into the kernel's index list.
    """
    r, k = scores.shape
    if r == 0 or k == 0:
        return torch.zeros((r, k), dtype=torch.bool, device=scores.device)
    s = scores.detach().to("cpu", torch.float32).numpy()
    a, c = overlap_edges(boxes, thresh, legacy)
    words = (k + _WORD - 1) // _WORD
    kept = _solve(r, a, c, _first_bits(s, a, c, words))
    mask = np.unpackbits(kept.view(np.uint8), axis=1, count=k, bitorder="little").view(bool)
    return torch.from_numpy(mask).to(scores.device)


def kept_in_rank_order(mask: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """Indices of ``mask`` (R,) in decreasing ``scores`` (R,), ties by index: the order ``nms`` returns them."""
    idx = torch.nonzero(mask).flatten()
    return idx[torch.argsort(scores[idx], descending=True, stable=True)]


def max_conf(
    boxes: torch.Tensor, scores: torch.Tensor, thresh: float = 0.3, valid: torch.Tensor | None = None
) -> torch.Tensor:
    """``generate_tsv.py`` ``max_conf``: per proposal, the max of ``score_c`` over the classes c whose greedy
    NMS (``+1`` IoU >= ``thresh``) keeps it, else 0.

    ``boxes`` (B, R, 4) or (R, 4); ``scores`` (B, R, K) or (R, K) foreground scores (>= 0); ``valid`` (B, R)
    marks real proposals (padding neither suppresses nor is scored). Returns (B, R) or (R,) float32.
    """
    single = boxes.dim() == 2
    if single:
        boxes, scores = boxes[None], scores[None]
        valid = None if valid is None else valid[None]
    out = torch.zeros(scores.shape[:2], dtype=torch.float32)
    for i in range(scores.shape[0]):
        rows = torch.arange(scores.shape[1]) if valid is None else torch.nonzero(valid[i].cpu()).flatten()
        s = scores[i].detach().to("cpu", torch.float32)[rows]
        keep = per_class_keep(boxes[i].detach().cpu()[rows], s, thresh, legacy=True)
        if s.shape[1]:
            out[i, rows] = torch.where(keep, s, torch.zeros_like(s)).amax(dim=1).clamp_min(0.0)
    out = out.to(scores.device)
    return out[0] if single else out


def max_conf_device(
    boxes: torch.Tensor,
    scores: torch.Tensor,
    thresh: float = 0.3,
    valid: torch.Tensor | None = None,
    max_sweeps: int | None = None,
) -> torch.Tensor:
    """:func:`max_conf` with torch operators only (any device, the same result): (B, R, 4) boxes, (B, R, K)
    scores, (B, R) ``valid`` -> (B, R) float32.

    The IoU is torchvision's ``box_iou`` on the same ``+1``-shifted float32 boxes (elementwise float32 operators,
    correctly rounded on every device, so the same edges); an edge ``a < b`` orders ``a`` first in class k iff
    ``s[a, k] >= s[b, k]``; the sweeps of Eq. (1) run until nothing changes (one host read per sweep)."""
    b, r, k = scores.shape
    dev = scores.device
    if r == 0 or k == 0:
        return torch.zeros((b, r), dtype=torch.float32, device=dev)
    s = scores.detach().float().reshape(b * r, k)
    shifted = boxes.detach().float() + torch.tensor([0.0, 0.0, 1.0, 1.0], device=dev)
    iou = torch.stack([box_iou(shifted[i], shifted[i]) for i in range(b)])  # (B, R, R)
    over = torch.triu(iou >= torch.tensor(thresh, dtype=torch.float32, device=dev), diagonal=1)
    if valid is not None:
        over &= valid[:, :, None] & valid[:, None, :]
    img, a, c = over.nonzero(as_tuple=True)  # one host read: the number of edges
    a, c = img * r + a, img * r + c
    first = s[a] >= s[c]  # (E, K): a comes before c in class k
    src, dst = torch.cat([a, c]), torch.cat([c, a])
    before = torch.cat([first, ~first])  # (2E, K): src comes before dst
    kept = torch.ones((b * r, k), dtype=torch.bool, device=dev)
    dst_k = dst[:, None].expand(-1, k)
    for _ in range(max_sweeps or r + 1):
        hit = torch.zeros((b * r, k), dtype=torch.uint8, device=dev).scatter_reduce_(
            0, dst_k, (kept[src] & before).to(torch.uint8), "amax"
        )
        new = hit == 0
        if torch.equal(new, kept):  # the sweep's host read
            break
        kept = new
    else:
        raise RuntimeError("per-class NMS did not converge (non-finite scores?)")
    out = torch.where(kept, s, torch.zeros_like(s)).amax(dim=1).clamp_min(0.0).view(b, r)
    return out if valid is None else torch.where(valid, out, torch.zeros_like(out))
