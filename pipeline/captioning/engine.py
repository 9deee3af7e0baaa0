"""Caption photos end to end, batch by batch: decode images, detect regions, run the captioner.

Photos go to regions by the path every command shares (:mod:`extractors.photos`: decoding in DataLoader
worker processes, ``caption.num_workers``, the thin-image check, the detector's per-image guard) while the
models run in the main process, both under ``caption.precision`` (applied here, so a caller of the engine
from Python gets the precision it asked for).

:class:`PhotoCaptioner` holds a loaded detector and captioner. ``caption_paths`` yields one
:class:`CaptionResult` per input file (bad images become results with an ``error``), so a caller can stream
them to a table, JSON lines or CSV. Features can be reused from (and added to) a feature store
(``--cache``), keyed like ``cli extract`` keys images.

Region relevance for the pictures (:func:`region_relevance`) is measured by occlusion, which works for
every captioner: a region's relevance for word t is how much the log-probability of that word (teacher
forced on the generated caption) drops when the region is removed from the input (mask off), clipped at 0
and normalised over regions. It answers "which regions did this word depend on", for any attention form.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from extractors.detector import Detector
from extractors.inputs import ImageItem
from extractors.photos import Need, Photo, PhotoDataset, detect_guarded, photo_batches
from extractors.selector import Selector
from models.captioners.base import Captioner
from models.decoding import DecodeOptions, generate
from models.decoding.captions import caption_words
from pipeline.captioning.output import result_row
from pipeline.core.console import get_logger
from pipeline.core.errors import Failure, PipelineError, exception_line
from pipeline.core.identity import FeatureIdentity
from pipeline.core.keys import key_to_text
from pipeline.core.precision import autocast, resolve_precision
from pipeline.core.regions import RegionRecord
from pipeline.core.vocab import BOS, Vocab
from pipeline.data.dataset import cap_boxes, pad_regions
from pipeline.store import FeatureStore, open_writer

log = get_logger("caption")


@dataclass
class CaptionResult:
    """The outcome for one photo: a caption (and n-best) or an error; regions for pictures."""

    key: str
    path: Path
    caption: str = ""
    score: float = float("nan")
    nbest: list[tuple[str, float]] = field(default_factory=list)
    error: str | None = None
    regions: dict[str, np.ndarray] | None = None
    tokens: list[str] = field(default_factory=list)
    relevance: np.ndarray | None = None  # (words, regions), rows sum to 1 (or 0 where nothing mattered)
    image: np.ndarray | None = None  # RGB uint8, kept only for pictures

    def to_json(self, with_nbest: bool) -> dict[str, Any]:
        """The output row (see :func:`pipeline.captioning.output.result_row`)."""
        return result_row(self, with_nbest)


def batch_tensors(records: Sequence[dict[str, Any]], device: torch.device) -> dict[str, torch.Tensor]:
    """Pad region records into the captioner's input tensors (as the training collate does)."""
    feats, boxes, mask = pad_regions(
        [r["features"] for r in records], [r["boxes"] for r in records], torch.float32, device
    )
    sizes = torch.tensor([[r["image_w"], r["image_h"]] for r in records], dtype=torch.float32)
    return {"feats": feats, "mask": mask, "boxes": boxes, "sizes": sizes.to(device)}


@torch.no_grad()
def region_relevance(model: Captioner, inputs: dict[str, torch.Tensor], row: int, tokens: torch.Tensor) -> np.ndarray:
    """Occlusion relevance (words, regions) of image ``row`` for its generated ``tokens`` (no BOS, EOS kept)."""
    mask = inputs["mask"][row : row + 1]
    n = int(mask.sum())
    caps = torch.cat([torch.tensor([BOS], device=tokens.device), tokens]).unsqueeze(0)
    rows = torch.arange(n + 1, device=mask.device)
    masks = mask.repeat(n + 1, 1)
    masks[rows[1:], rows[:-1]] = False  # variant r+1 removes region r; variant 0 keeps all
    enc = model.encode(
        inputs["feats"][row : row + 1].expand(n + 1, -1, -1),
        masks,
        inputs["boxes"][row : row + 1].expand(n + 1, -1, -1),
        inputs["sizes"][row : row + 1].expand(n + 1, -1),
    )
    logp = model.decode_teacher_forced(enc, caps[:, :-1].expand(n + 1, -1))
    target = caps[0, 1:]
    word_logp = logp.gather(2, target.view(1, -1, 1).expand(n + 1, -1, 1)).squeeze(2)  # (n+1, T)
    drop = (word_logp[0:1] - word_logp[1:]).clamp_min(0).T  # (T, n)
    total = drop.sum(1, keepdim=True)
    rel = torch.where(total > 0, drop / total.clamp_min(1e-12), torch.zeros_like(drop))
    return rel.float().cpu().numpy()  # float32 also under a bf16 autocast (caption --precision bf16)


class FeatureCache:
    """A feature store used as a cache: ``has``/``get`` read committed images, ``add``/``commit`` extend it.

    Same numbers, same captions: a photo detected now is captioned from the copy the cache holds (read back
    after the commit), as a rerun captions it, so the first run and a rerun give the same caption whatever the
    store's dtype. A new cache stores float32 (the detector's numbers as they are: the captions equal those of
    a run without ``--cache``); an existing store (e.g. a float16 one made by ``extract``) keeps its dtype."""

    def __init__(self, path: Path, identity: FeatureIdentity) -> None:
        # any store whose settings agree on what determines the features will do (e.g. one made by `extract`)
        self.writer = open_writer(path, identity, "float32", match="features")
        self.reader = FeatureStore(path)

    def has(self, key: str) -> bool:
        return self.writer.has(key)

    def get(self, key: str) -> dict[str, Any]:
        if key not in self.reader:
            self.reader.refresh()
        return self.reader.get(key)

    def add(self, key: str, record: RegionRecord) -> None:
        if record.pooled is not None and self.writer.pooled_dim == 0:  # a store of regions only stays one
            record = replace(record, pooled=None)
        self.writer.add(key, record)

    def commit(self) -> None:
        self.writer.commit()

    def close(self) -> None:
        self.writer.close()


class PhotoCaptioner:
    """A detector and a captioner ready to caption photos on one device."""

    def __init__(
        self,
        detector: Detector,
        rule: Selector,
        model: Captioner,
        vocab: Vocab,
        options: DecodeOptions,
        device: torch.device,
        max_boxes: int | None = None,
        max_pixels: int = 100_000_000,
        precision: str = "tf32",
        store_settings: FeatureIdentity | None = None,
    ) -> None:
        self.detector, self.rule, self.model, self.vocab = detector, rule, model.eval(), vocab
        self.options, self.device, self.max_boxes, self.max_pixels = options, device, max_boxes, max_pixels
        self.precision = resolve_precision(
            str(precision), device, "caption.precision", fp16=False
        )  # detector and captioner run under it
        self.store_settings = store_settings  # the feature identity a ``--cache`` store must agree with

    def caption_paths(self, items: Sequence[ImageItem], *args: Any, **kwargs: Any) -> Iterator[CaptionResult]:
        """Caption ``items`` in batches; yields results in input order. The other arguments (``batch_size``,
        ``cache``: an open store writer, ...) are those of :meth:`caption_batches`."""
        for batch in self.caption_batches(items, *args, **kwargs):
            yield from batch

    def caption_batches(
        self,
        items: Sequence[ImageItem],
        batch_size: int = 4,
        cache: Any = None,
        keep_images: bool = False,
        relevance: bool = False,
        workers: int = 0,
    ) -> Iterator[list[CaptionResult]]:
        """Caption ``items`` batch by batch (one list of results per batch, in input order).

        Photos are decoded (and their detector blobs built) by ``workers`` DataLoader processes
        (:mod:`extractors.photos`; 0: in this process), a few batches ahead of the models. Photos whose
        features are in ``cache`` skip detection; they are decoded only when ``keep_images`` (pictures, gallery).

        A per-image guard: an image whose decoding, detection or captioning raises becomes a result with an
        ``error`` (``reason: detail``) and the others of its batch are still captioned (a failed batch is
        retried image by image). Project errors (:class:`PipelineError`, e.g. a feature-size mismatch) stop the run.
        """
        items = list(items)
        cached = [it.problem is None and cache is not None and cache.has(it.key) for it in items]
        needs = [(Need.IMAGE if keep_images else Need.NOTHING) if c else Need.DETECT for c in cached]
        dataset = self.photo_dataset(items, needs, keep_images)
        for decoded in photo_batches(dataset, batch_size, workers):
            yield self.caption_decoded(decoded, cache, [cached[d.index] for d in decoded], keep_images, relevance)

    def photo_dataset(
        self, items: Sequence[ImageItem], needs: Sequence[Need] | None = None, keep_images: bool = False
    ) -> PhotoDataset:
        """The photos -> detector inputs step for this engine's detector recipe, pixel cap and thin-image check
        (:class:`extractors.photos.PhotoDataset`; ``dataset[i]`` decodes photo ``i``, failures as values)."""
        return PhotoDataset(
            items, self.rule.recipe, self.max_pixels, self.detector.spec.feature_stride, needs, keep_images
        )

    def caption_decoded(
        self,
        decoded: Sequence[Photo],
        cache: Any = None,
        cached: Sequence[bool] | None = None,
        keep_images: bool = False,
        relevance: bool = False,
    ) -> list[CaptionResult]:
        """Caption photos already decoded by :meth:`photo_dataset` (one batch; results in the given order).

        :meth:`caption_batches` runs every batch through here; ``cli serve`` decodes uploads in its request
        threads and calls this from its model thread, so both share detection, captioning and the per-image guard.
        ``cached[i]``: photo ``i``'s features are in ``cache`` (default: none)."""
        decoded = list(decoded)
        cached = [False] * len(decoded) if cached is None else list(cached)
        chunk = [d.item for d in decoded]
        results = [CaptionResult(it.key, it.path) for it in chunk]
        records: list[dict[str, Any] | None] = [None] * len(chunk)
        todo = []
        for i, d in enumerate(decoded):
            if cached[i]:
                try:
                    records[i] = cache.get(chunk[i].key)  # features extracted by an earlier run
                except OSError as exc:
                    results[i].error = f"unreadable: {exc}"
                    continue
            if d.failure is not None:  # found before reading, while decoding, building the blob, or too thin
                results[i].error = d.failure.line
            elif not cached[i]:
                todo.append(i)
        if todo:
            self._detect_batch(chunk, todo, decoded, results, records, cache)
        good = [i for i in range(len(chunk)) if records[i] is not None and results[i].error is None]
        if good:
            recs = {i: cap_boxes(dict(records[i]), self.max_boxes) for i in good}
            self._check_dim(next(iter(recs.values())))
            self._caption_guarded(recs, results, relevance)
            for i, rec in recs.items():
                if results[i].error is None:
                    results[i].regions = rec
                    if keep_images:
                        results[i].image = decoded[i].image.numpy()
        return results

    def _detect_batch(
        self,
        chunk: list[ImageItem],
        todo: list[int],
        decoded: list[Photo],
        results: list[CaptionResult],
        records: list[dict[str, Any] | None],
        cache: Any,
    ) -> None:
        """Detect the ``todo`` photos of a batch into ``records`` (and the cache, committed once per batch)."""
        position = {id(decoded[i]): i for i in todo}

        def fail(photo: Photo, failure: Failure) -> None:
            results[position[id(photo)]].error = failure.line
            log.warning("skipped %s: %s", key_to_text(str(photo.item.path)), failure.line)

        with torch.no_grad():
            found = detect_guarded(
                self.detector, [decoded[i] for i in todo], self.rule, self.precision, self.device, fail
            )
        for photo, out in found:
            i = position[id(photo)]
            if len(out.boxes) == 0:
                results[i].error = Failure("no_regions", "the detector returned no region").line
                continue
            records[i] = out.to_dict()
            if cache is not None:
                cache.add(chunk[i].key, out)
        if cache is not None:
            cache.commit()
            for i in todo:  # caption from the cache's copy, as a rerun will: the same numbers, the same caption
                if records[i] is not None:
                    records[i] = cache.get(chunk[i].key)

    def _check_dim(self, rec: dict[str, Any]) -> None:
        dim, expected = rec["features"].shape[1], getattr(self.model, "feat_dim", None)
        if expected is not None and dim != expected:
            raise PipelineError(
                f"the captioner expects {expected}-d region features, the detector gives {dim}-d: use the detector it "
                "was trained with"
            )

    def _caption_guarded(self, recs: dict[int, dict[str, Any]], results: list[CaptionResult], relevance: bool) -> None:
        """Caption ``recs`` together; if that raises, one by one (the failing image gets the error)."""
        try:
            with autocast(self.device, self.precision):
                self._caption(list(recs.values()), [results[i] for i in recs], relevance)
        except PipelineError:
            raise
        except Exception as exc:  # noqa: BLE001 - the per-image guard
            if len(recs) > 1:
                for i, rec in recs.items():
                    self._caption_guarded({i: rec}, results, relevance)
                return
            i = next(iter(recs))
            results[i].error = Failure("captioner_failed", exception_line(exc)).line
            log.warning("skipped %s: %s", key_to_text(str(results[i].path)), results[i].error)

    @torch.no_grad()
    def _caption(self, recs: list[dict[str, Any]], results: list[CaptionResult], relevance: bool) -> None:
        inputs = batch_tensors(recs, self.device)
        out = generate(self.model, inputs["feats"], inputs["mask"], inputs["boxes"], inputs["sizes"], self.options)
        for j, res in enumerate(results):
            hyps = []
            for h in range(out.tokens.shape[1]):
                words = caption_words(self.vocab, out.tokens[j, h, : int(out.lengths[j, h])].tolist(), self.options)
                hyps.append((" ".join(words), float(out.scores[j, h])))
            res.caption, res.score = hyps[0]
            res.nbest = hyps
            res.tokens = self.vocab.decode(out.tokens[j, 0].tolist())
            if relevance and res.tokens:
                n = int(out.lengths[j, 0])
                try:
                    res.relevance = region_relevance(self.model, inputs, j, out.tokens[j, 0, :n])[: len(res.tokens)]
                except Exception as exc:  # noqa: BLE001 - the caption stands without its picture's word relevance
                    log.warning("no word relevance for %s (%s)", key_to_text(str(res.path)), exception_line(exc))
