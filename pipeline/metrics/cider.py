"""Fast CIDEr-D (numpy only): the same scores as pycocoevalcap's ``Cider`` for SCST rewards and evaluation.

What pycocoevalcap 1.2 computes (``cider/cider_scorer.py``; despite the class name it *is* CIDEr-D,
Vedantam et al. 2015, Eq. 2-5 with the CIDEr-D changes):

* for every n-gram g of order k = 1..4 of a sentence, the TF-IDF weight
  ``w_g = tf_g * (log N - log max(1, df_g))`` where df_g is the number of *images* whose references
  contain g and N the number of images whose references define the document frequencies;
* per order k, the clipped cosine ``sum_g min(w_g(c), w_g(r)) * w_g(r) / (|w(c)|_k * |w(r)|_k)``
  (the division only when both norms are non-zero), times the Gaussian length penalty
  ``exp(-(l_c - l_r)^2 / (2 sigma^2))`` with sigma = 6;
* the score of a candidate c is ``10 * mean_k (sum_r sim_k(c, r)) / |refs|``.
* The "length" l of a sentence in that code is its number of **bigrams**, max(len - 1, 0) (the
  ``if n == 1`` branch counts order index 1); it equals the word-count difference except for
  sentences of 0 or 1 words. We reproduce it exactly.

Document-frequency modes (``df_mode``):

* ``"corpus"``: df and N from **all** references given to the constructor, computed once. For SCST
  rewards, give it the training references: this is the reward of ruotianluo's ``CiderD(df=
  'coco-train-idxs')`` and of M2 (train-set document frequencies, ``log N`` with N the number of
  training images). Scoring every image of the corpus once gives exactly pycocoevalcap's ``Cider``.
  (Naming note: ruotianluo's ``df_mode="corpus"`` means "from the references in the call", which is our
  ``"batch"``.)
* ``"batch"``: df and N from the references of the distinct images named in each :meth:`CiderD.scores`
  call: pycocoevalcap's ``Cider.compute_score`` on exactly those images.

No ``<eos>`` is appended to references or candidates (ruotianluo's index-based reward does append one);
rewards are on words, as the papers evaluate.

Speed: n-grams are packed into exact 64-bit keys (:mod:`pipeline.metrics.ngrams`), the reference side
(per-image n-gram table with the term frequencies of each reference, reference norms and lengths) is
built once, vectorised, and a call is a handful of sorts, binary searches and ``bincount`` over all
candidates at once (``python -m bench --only cider`` measures the speed-up against pycocoevalcap).
"""

from __future__ import annotations

import json
import zipfile
from collections.abc import Callable, Hashable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.core.errors import PipelineError
from pipeline.core.fileio import atomic_write
from pipeline.core.vocab import EOS, PAD
from pipeline.metrics.ngrams import flatten, key_order, max_token_id, ngram_keys, ranges

DF_MODES = ("corpus", "batch")
_CHUNK = 1 << 20  # reference rows per chunk when computing norms
_FORMAT = "butd-ciderd"


def _is_int_token(tok: Any) -> bool:
    return isinstance(tok, (int, np.integer)) and not isinstance(tok, bool)


class CiderD:
    """CIDEr-D scorer with cached reference statistics.

    Args:
        refs_by_image: image id -> list of references; a reference is a list of word tokens, a
            whitespace-separated string, or a sequence of integer token ids (id mode: then candidates
            must be ids too). Every image needs at least one reference.
        df_mode: ``"corpus"`` (document frequencies from all ``refs_by_image``) or ``"batch"`` (from the
            images of each call), see the module docstring.
        n: highest n-gram order (4 in CIDEr-D).
        sigma: standard deviation of the Gaussian length penalty (6 in CIDEr-D).
    """

    def __init__(
        self,
        refs_by_image: Mapping[Hashable, Sequence[Any]],
        df_mode: str = "corpus",
        n: int = 4,
        sigma: float = 6.0,
    ) -> None:
        if df_mode not in DF_MODES:
            raise ValueError(f"df_mode must be one of {DF_MODES}, got {df_mode!r}")
        if not refs_by_image:
            raise ValueError("CiderD needs references for at least one image")
        self.df_mode = df_mode
        self.n = n
        self.sigma = float(sigma)
        self.image_ids: list[Hashable] = list(refs_by_image)
        self._index = {image_id: i for i, image_id in enumerate(self.image_ids)}
        ref_lists = [refs_by_image[i] for i in self.image_ids]
        for image_id, refs in zip(self.image_ids, ref_lists):
            if len(refs) == 0:
                raise ValueError(f"image {image_id!r} has no reference captions")
        flat_refs = [r for refs in ref_lists for r in refs]
        self.id_mode = self._detect_id_mode(flat_refs)
        self.vocab: dict[str, int] = {}
        ref_ids = flat_refs if self.id_mode else [self._intern(r) for r in flat_refs]
        self._build(ref_ids, np.fromiter((len(r) for r in ref_lists), dtype=np.int64, count=len(ref_lists)))

    # ------------------------------------------------------------------ building the reference tables

    @staticmethod
    def _detect_id_mode(flat_refs: Sequence[Any]) -> bool:
        for ref in flat_refs:
            if isinstance(ref, str):
                return False
            if len(ref):
                return _is_int_token(ref[0])
        return False

    def _intern(self, ref: Any) -> list[int]:
        words = ref.split() if isinstance(ref, str) else ref
        vocab = self.vocab
        out = []
        for w in words:
            i = vocab.get(w)
            if i is None:
                i = vocab[w] = len(vocab)
            out.append(i)
        return out

    def _build(self, ref_ids: Sequence[Sequence[int]], refs_per_image: np.ndarray) -> None:
        n = self.n
        if not self.id_mode and len(self.vocab) > max_token_id(n) + 1:
            raise ValueError(f"CiderD supports at most {max_token_id(n) + 1} distinct words for {n}-grams")
        num_images = refs_per_image.shape[0]
        flat, lengths = flatten(ref_ids)
        keys, _, seq = ngram_keys(flat, lengths, n)
        del flat
        self.keys, gid = np.unique(keys, return_inverse=True)  # gid: dense id of each reference n-gram
        del keys
        num_grams = self.keys.shape[0]
        self.num_grams = num_grams
        self.gram_order = key_order(self.keys, n).astype(np.int8)

        ref_image = np.repeat(np.arange(num_images, dtype=np.int64), refs_per_image)
        ref_local = np.arange(ref_image.shape[0], dtype=np.int64) - np.repeat(
            np.cumsum(refs_per_image) - refs_per_image, refs_per_image
        )
        # term frequency of each n-gram in each reference
        ref_gram, tf = np.unique(seq * num_grams + gid.astype(np.int64), return_counts=True)
        del seq, gid
        ref_of, gid_of = np.divmod(ref_gram, num_grams)
        del ref_gram
        # one row per (image, n-gram of its references); columns = the image's references. Row keys are
        # image * num_grams + gid, sorted, so each image's rows are contiguous (row_start) and a
        # candidate's n-gram is found by binary search.
        self.row_key, row_of = np.unique(ref_image[ref_of] * num_grams + gid_of, return_inverse=True)
        del gid_of
        self.max_refs = int(refs_per_image.max())
        self.row_tf = np.zeros((self.row_key.shape[0], self.max_refs), dtype=np.uint16)
        self.row_tf[row_of, ref_local[ref_of]] = tf
        del row_of, ref_of, tf
        self.row_start = np.searchsorted(self.row_key, np.arange(num_images + 1, dtype=np.int64) * num_grams)
        # number of images whose references hold each n-gram
        self.image_df = np.bincount(self.row_key % num_grams, minlength=num_grams).astype(np.int32)

        self.refs_per_image = refs_per_image
        self.ref_length = np.zeros((num_images, self.max_refs), dtype=np.float64)
        self.ref_length[ref_image, ref_local] = np.maximum(lengths - 1, 0)  # pycocoevalcap's bigram count

        if self.df_mode == "corpus":
            self.log_n = float(np.log(float(num_images)))
            self.idf = self.log_n - np.log(np.maximum(1.0, self.image_df))
            self.ref_norm = self._ref_norms(0, self.row_key.shape[0], None, lambda g: self.idf[g], num_images)

    def _ref_norms(
        self,
        start: int,
        stop: int,
        rows: np.ndarray | None,
        idf_of: Callable[[np.ndarray], np.ndarray],
        num_local: int,
        local_of: Callable[[np.ndarray], np.ndarray] | None = None,
    ) -> np.ndarray:
        """L2 norms of the references' TF-IDF vectors per order: (images, n, max_refs).

        Rows ``rows`` (or ``start:stop`` when ``rows`` is None) are processed in chunks to bound memory;
        ``local_of`` maps image indices to 0..num_local-1 (identity when None).
        """
        n, m, g = self.n, self.max_refs, self.num_grams
        sq = np.zeros(num_local * n * m, dtype=np.float64)
        total = (stop - start) if rows is None else rows.shape[0]
        for lo in range(0, total, _CHUNK):
            hi = min(total, lo + _CHUNK)
            r = np.arange(start + lo, start + hi, dtype=np.int64) if rows is None else rows[lo:hi]
            image, gid = np.divmod(self.row_key[r], g)
            local = image if local_of is None else local_of(image)
            weights = self.row_tf[r] * idf_of(gid)[:, None]
            slot = (local * n + self.gram_order[gid])[:, None] * m + np.arange(m)
            sq += np.bincount(slot.ravel(), (weights * weights).ravel(), minlength=num_local * n * m)
        return np.sqrt(sq).reshape(num_local, n, m)

    # ------------------------------------------------------------------ candidates

    def _candidate_ids(
        self, candidates: Any, stop_ids: Sequence[int]
    ) -> list[Sequence[int]] | tuple[np.ndarray, np.ndarray]:
        """Token ids of the candidates: (flat ids, lengths), or a list of id sequences in id mode."""
        if hasattr(candidates, "cpu") and hasattr(candidates, "numpy"):  # a torch tensor, without importing torch
            candidates = candidates.detach().cpu().numpy()
        if isinstance(candidates, np.ndarray):
            if candidates.ndim != 2 or not np.issubdtype(candidates.dtype, np.integer):
                raise ValueError("array candidates must be a 2-D integer array (candidates x positions)")
            if not self.id_mode:
                raise ValueError("token-id candidates need a CiderD built from token-id references")
            stop = np.isin(candidates, np.asarray(list(stop_ids), dtype=candidates.dtype))
            has_stop = stop.any(axis=1)
            first_stop = stop.argmax(axis=1) if candidates.shape[1] else np.zeros(candidates.shape[0], dtype=np.int64)
            lengths = np.where(has_stop, first_stop, candidates.shape[1]).astype(np.int64)
            keep = np.arange(candidates.shape[1])[None, :] < lengths[:, None]
            return candidates[keep].astype(np.int64), lengths
        if self.id_mode:
            out = []
            for c in candidates:
                if isinstance(c, str) or (len(c) and not _is_int_token(c[0])):
                    raise ValueError("this CiderD was built from token ids; give candidates as token ids too")
                out.append(c)
            return out
        split = [c.split() if isinstance(c, str) else c for c in candidates]
        get = self.vocab.get
        flat_list = [get(w, -1) for c in split for w in c]
        lengths = np.fromiter((len(c) for c in split), dtype=np.int64, count=len(split))
        if -1 in flat_list:  # words unseen in the references get fresh ids for this call
            extra: dict[str, int] = {}
            base = len(self.vocab)
            words = [w for c in split for w in c]
            for k, i in enumerate(flat_list):
                if i < 0:
                    flat_list[k] = extra.setdefault(words[k], base + len(extra))
            if base + len(extra) > max_token_id(self.n) + 1:
                raise ValueError(f"too many distinct words for packed {self.n}-grams")
        return np.asarray(flat_list, dtype=np.int64), lengths

    def image_index(self, image_ids: Sequence[Hashable]) -> np.ndarray:
        """Internal indices of ``image_ids``; raises ValueError naming the first unknown id."""
        try:
            return np.fromiter((self._index[i] for i in image_ids), dtype=np.int64, count=len(image_ids))
        except KeyError as exc:
            raise ValueError(f"no references for image id {exc.args[0]!r}") from None

    def scores(
        self,
        candidates: Any,
        image_ids: Sequence[Hashable],
        stop_ids: Sequence[int] = (PAD, EOS),
    ) -> np.ndarray:
        """CIDEr-D of each candidate against the references of its image.

        Args:
            candidates: list of token lists (or whitespace-separated strings); in id mode, lists of ids or a
                2-D integer array / tensor whose rows are cut at the first id in ``stop_ids``.
            image_ids: the image of each candidate (repeats allowed: several samples per image).
            stop_ids: ids ending a row of an array input (default PAD and EOS of :mod:`pipeline.core.vocab`).

        Returns:
            float64 array of shape (len(candidates),).
        """
        if len(image_ids) != len(candidates):
            raise ValueError(f"{len(candidates)} candidates but {len(image_ids)} image ids")
        image = self.image_index(image_ids)
        encoded = self._candidate_ids(candidates, stop_ids)
        flat, lengths = encoded if isinstance(encoded, tuple) else flatten(encoded)
        return self._score(flat, lengths, image)

    def _score(self, flat: np.ndarray, lengths: np.ndarray, image: np.ndarray) -> np.ndarray:
        n, m = self.n, self.max_refs
        num_cand = lengths.shape[0]
        if num_cand == 0:
            return np.zeros(0, dtype=np.float64)
        keys, _, seq = ngram_keys(flat, lengths, n)
        # term frequencies of each candidate's distinct n-grams
        ukeys, local = np.unique(keys, return_inverse=True)
        cand_gram, tf = np.unique(seq * ukeys.shape[0] + local.astype(np.int64), return_counts=True)
        cand, ulocal = np.divmod(cand_gram, ukeys.shape[0])
        order = key_order(ukeys, n)[ulocal]
        if self.num_grams:
            pos = np.minimum(np.searchsorted(self.keys, ukeys), self.num_grams - 1)
            gid = np.where(self.keys[pos] == ukeys, pos, -1)[ulocal]  # -1: n-gram absent from all references
        else:
            gid = np.full(ulocal.shape[0], -1, dtype=np.int64)

        if self.df_mode == "corpus":
            idf_of = self._corpus_idf
            ref_norm = self.ref_norm[image]
        else:
            idf_of, norms, where = self._batch_statistics(image)
            ref_norm = norms[where]
        cand_idf = idf_of(gid)
        w_cand = tf * cand_idf
        cand_slot = cand * n + order
        cand_norm = np.sqrt(np.bincount(cand_slot, w_cand * w_cand, minlength=num_cand * n).astype(np.float64)).reshape(
            num_cand, n
        )

        # reference weights of the candidate's n-grams in each reference of its image
        # (searched among the rows of this call's images only: a few thousand keys, not the whole corpus)
        found = gid >= 0
        probe = image[cand[found]] * self.num_grams + gid[found]
        unique_images = np.unique(image)
        rows = ranges(self.row_start[unique_images], self.row_start[unique_images + 1])
        batch_keys = self.row_key[rows]  # sorted: images ascending, keys ascending within an image
        pos = np.minimum(np.searchsorted(batch_keys, probe), max(batch_keys.shape[0] - 1, 0))
        hit = batch_keys[pos] == probe if batch_keys.shape[0] else np.zeros(probe.shape[0], dtype=bool)
        sel = np.flatnonzero(found)[hit]
        w_ref = self.row_tf[rows[pos[hit]]] * cand_idf[sel][:, None]  # uint16 tf -> float64 weights
        num_e = np.minimum(w_cand[sel][:, None], w_ref) * w_ref
        slot = cand_slot[sel][:, None] * m + np.arange(m)
        num = (
            np.bincount(slot.ravel(), num_e.ravel(), minlength=num_cand * n * m)
            .astype(np.float64)
            .reshape(num_cand, n, m)
        )

        denom = cand_norm[:, :, None] * ref_norm
        val = np.divide(num, denom, out=num.copy(), where=denom != 0)
        delta = np.maximum(lengths - 1, 0)[:, None].astype(np.float64) - self.ref_length[image]
        val *= np.exp(-(delta * delta) / (2.0 * self.sigma**2))[:, None, :]
        return val.sum(axis=2).mean(axis=1) / self.refs_per_image[image] * 10.0

    def _corpus_idf(self, gid: np.ndarray) -> np.ndarray:
        out = np.full(gid.shape[0], self.log_n, dtype=np.float64)
        known = gid >= 0
        out[known] = self.idf[gid[known]]
        return out

    def _batch_statistics(self, image: np.ndarray) -> tuple[Any, np.ndarray, np.ndarray]:
        """Document frequencies and reference norms from the distinct images of one call."""
        unique, where = np.unique(image, return_inverse=True)
        rows = ranges(self.row_start[unique], self.row_start[unique + 1])
        grams, df = np.unique(self.row_key[rows] % self.num_grams, return_counts=True)
        log_n = float(np.log(float(unique.shape[0])))

        def idf_of(gid: np.ndarray) -> np.ndarray:
            if grams.shape[0] == 0:
                return np.full(gid.shape[0], log_n)
            p = np.minimum(np.searchsorted(grams, gid), grams.shape[0] - 1)
            count = np.where((gid >= 0) & (grams[p] == gid), df[p], 0)
            return log_n - np.log(np.maximum(1.0, count))

        norms = self._ref_norms(0, 0, rows, idf_of, unique.shape[0], lambda image: np.searchsorted(unique, image))
        return idf_of, norms, where

    # ------------------------------------------------------------------ caching the reference tables

    _ARRAYS = ("keys", "gram_order", "row_key", "row_tf", "row_start", "image_df", "refs_per_image", "ref_length")

    def save(self, path: str | Path) -> Path:
        """Write the reference tables to an ``.npz`` file (atomically; no pickle) for :meth:`load`.

        Building the tables for COCO-sized training references takes tens of seconds; a cached file loads
        in about a second. Image ids must be integers or strings.
        """
        if not all(isinstance(i, (int, str)) and not isinstance(i, bool) for i in self.image_ids):
            raise ValueError("only integer or string image ids can be saved")
        words = sorted(self.vocab, key=self.vocab.__getitem__)
        meta = {
            "format": _FORMAT,
            "version": 1,
            "df_mode": self.df_mode,
            "n": self.n,
            "sigma": self.sigma,
            "id_mode": self.id_mode,
            "image_ids": [int(i) if isinstance(i, (int, np.integer)) else i for i in self.image_ids],
            "vocab": words,
        }
        arrays = {name: getattr(self, name) for name in self._ARRAYS}
        if self.df_mode == "corpus":
            arrays["ref_norm"] = self.ref_norm
        return atomic_write(path, lambda fh: np.savez(fh, meta=np.array(json.dumps(meta)), **arrays))

    @classmethod
    def load(cls, path: str | Path) -> "CiderD":
        """A scorer from a file written by :meth:`save`; a missing, foreign or corrupt file raises PipelineError."""
        path = Path(path)
        if not path.is_file():
            raise PipelineError(f"CIDEr-D cache not found: {path}")
        try:
            with np.load(path, allow_pickle=False) as data:
                meta = json.loads(str(data["meta"]))
                if meta.get("format") != _FORMAT or meta.get("version") != 1:
                    raise ValueError("not a butd-caption CIDEr-D cache (version 1)")
                arrays = {name: data[name] for name in cls._ARRAYS}
                ref_norm = data["ref_norm"] if meta["df_mode"] == "corpus" else None
        except (OSError, ValueError, KeyError, TypeError, zipfile.BadZipFile) as exc:
            raise PipelineError(f"CIDEr-D cache {path} is unreadable: {exc}") from None
        self = cls.__new__(cls)
        self.df_mode, self.n, self.sigma, self.id_mode = (
            meta["df_mode"],
            int(meta["n"]),
            float(meta["sigma"]),
            bool(meta["id_mode"]),
        )
        self.image_ids = list(meta["image_ids"])
        self._index = {image_id: i for i, image_id in enumerate(self.image_ids)}
        self.vocab = {w: i for i, w in enumerate(meta["vocab"])}
        for name, value in arrays.items():
            setattr(self, name, value)
        self.num_grams = int(self.keys.shape[0])
        self.max_refs = int(self.row_tf.shape[1])
        num_images = len(self.image_ids)
        if (
            self.df_mode not in DF_MODES
            or self.refs_per_image.shape != (num_images,)
            or self.row_start.shape != (num_images + 1,)
            or self.row_tf.shape[0] != self.row_key.shape[0]
            or self.image_df.shape != (self.num_grams,)
            or (ref_norm is not None and ref_norm.shape != (num_images, self.n, self.max_refs))
        ):
            raise PipelineError(f"CIDEr-D cache {path} is inconsistent (array shapes do not match)")
        if ref_norm is not None:
            self.log_n = float(np.log(float(num_images)))
            self.idf = self.log_n - np.log(np.maximum(1.0, self.image_df))
            self.ref_norm = ref_norm
        return self
