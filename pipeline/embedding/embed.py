"""Sentence embeddings for a file of sentences (``cli embed``), with the attention weights per word.

Input: a text file with one sentence per line (blank lines skipped), or JSON lines with a ``"text"`` (or
``"caption"``) field. Sentences are lowercased and split on whitespace; words outside the encoder's
vocabulary become ``<unk>``. Output: ``.npy`` (float32 (S, D)) or ``.jsonl`` (``{"text", "embedding"}``).

The file is read here; batches of ``embed.batch_size`` sentences are tokenised and padded (to the batch's
longest sentence) in ``embed.num_workers`` DataLoader processes while the encoder runs, under the autocast of
``embed.precision`` (fp32 | bf16 | fp16 on CUDA; ``auto``: bf16 on a CUDA device that supports it, else fp32).
The output does not depend on the worker count.

One odd sentence never costs the others: a sentence with no word is refused up front, and if the encoder
raises on a batch, its sentences are encoded one by one; each sentence that fails keeps its row (NaN in
``.npy``, ``"embedding": null`` with an ``"error"`` in ``.jsonl``) and is listed with its line number and
reason in ``OUTPUT.failures.jsonl``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from pipeline.core import threads as thread_policy
from pipeline.core.console import get_logger, track
from pipeline.core.distributed import resolve_device
from pipeline.core.errors import PipelineError, UsageError, exception_line
from pipeline.core.fileio import atomic_write, atomic_write_text
from pipeline.core.loaders import loader_timeout
from pipeline.core.training import autocast, resolve_precision
from pipeline.core.vocab import EOS, SPECIALS, UNK, Vocab
from pipeline.embedding.checkpoint import load_encoder
from pipeline.embedding.heatmap import attention_heatmap
from pipeline.embedding.retrieval import encode_batches, words_to_inputs

OUTPUT_SUFFIXES = (".npy", ".jsonl")
log = get_logger("embed")


def read_sentences(path: Path) -> list[str]:
    """Sentences of a text or JSON-lines file (see the module docstring); errors name the file and line."""
    return [text for _, text in read_sentence_lines(path)]


def read_sentence_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, sentence) for every sentence of ``path`` (see :func:`read_sentences`)."""
    if not path.is_file():
        raise UsageError(f"input file not found: {path}")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError:
        raise UsageError(f"{path} is not UTF-8 text") from None
    out: list[tuple[int, str]] = []
    jsonl = path.suffix.lower() in (".jsonl", ".json")
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if jsonl:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                raise UsageError(f"{path}:{n}: not a JSON line ({exc.msg})") from None
            text = (
                rec.get("text", rec.get("caption")) if isinstance(rec, dict) else rec if isinstance(rec, str) else None
            )
            if not isinstance(text, str):
                raise UsageError(f"{path}:{n}: a JSON line needs a string 'text' (or 'caption') field")
            line = text
        out.append((n, line.strip()))
    if not out:
        raise UsageError(f"{path} holds no sentence")
    return out


def _jsonl_row(text: str, vector: np.ndarray, failure: tuple[str, str] | None) -> dict[str, Any]:
    if failure is not None:
        return {"text": text, "embedding": None, "error": f"{failure[0]}: {failure[1]}"}
    return {"text": text, "embedding": [round(float(x), 6) for x in vector]}


class SentenceBatches(Dataset):
    """Item ``b``: batch ``b`` of ``batch_size`` consecutive sentences as encoder inputs, ``(start, tokens (k, T_b),
    lengths (k,))``, padded to the batch's longest sentence (:func:`words_to_inputs`). Holds the sentences and the
    vocabulary only, so DataLoader workers (fork, forkserver or spawn) tokenise batches while the encoder runs."""

    def __init__(self, sentences: Sequence[str], vocab: Vocab, max_words: int, batch_size: int) -> None:
        if batch_size < 1:
            raise UsageError(f"embed.batch_size must be at least 1, not {batch_size}")
        self.sentences, self.vocab, self.max_words, self.batch_size = list(sentences), vocab, max_words, batch_size

    def __len__(self) -> int:
        return -(-len(self.sentences) // self.batch_size)

    def __getitem__(self, b: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        start = b * self.batch_size
        tokens, lengths = words_to_inputs(self.sentences[start : start + self.batch_size], self.vocab, self.max_words)
        return start, tokens, lengths


def _as_is(item: Any) -> Any:
    return item


def sentence_batches(
    sentences: Sequence[str], vocab: Vocab, max_words: int, batch_size: int, num_workers: int = 0
) -> DataLoader:
    """The batches of :class:`SentenceBatches` in order, tokenised in ``num_workers`` DataLoader processes (0: in
    this process; capped by the thread policy, :func:`pipeline.core.threads.loader_workers`)."""
    if num_workers < 0:
        raise UsageError(f"embed.num_workers must be >= 0, not {num_workers}")
    dataset = SentenceBatches(sentences, vocab, max_words, batch_size)
    workers = thread_policy.loader_workers(num_workers) if len(dataset) > 1 else 0
    # an own generator: the global RNG is left as it was (a DataLoader draws its base seed from it otherwise)
    return DataLoader(
        dataset,
        batch_size=None,
        num_workers=workers,
        collate_fn=_as_is,
        generator=torch.Generator().manual_seed(0),
        timeout=loader_timeout(workers),
    )


def guarded_encode(
    model: Any,
    batches: Iterable[tuple[int, torch.Tensor, torch.Tensor]],
    total: int,
    device: torch.device,
    output: str,
    failures: dict[int, tuple[str, str]],
    precision: str = "fp32",
) -> torch.Tensor:
    """:func:`encode_batches` over ``batches`` (``(start, tokens, lengths)``, ``total`` sentences in all) with a
    per-sentence guard: a batch that raises is encoded sentence by sentence and each sentence that still raises
    is recorded in ``failures`` (index -> reason, detail) with a zero row. ``precision``: the forward's autocast."""
    parts: list[tuple[int, torch.Tensor]] = []
    for s, tokens, lengths in batches:
        try:
            parts.append((s, encode_batches(model, tokens, lengths, device, output, len(tokens), precision)))
            continue
        except (RuntimeError, ValueError, IndexError) as exc:
            log.debug("batch at sentence %d failed (%s); encoding one by one", s, exc)
        for i in range(len(tokens)):
            try:
                parts.append(
                    (s + i, encode_batches(model, tokens[i : i + 1], lengths[i : i + 1], device, output, 1, precision))
                )
            except (RuntimeError, ValueError, IndexError) as exc:
                failures[s + i] = ("encoder_failed", exception_line(exc))
    if not parts:
        raise PipelineError(f"no sentence could be embedded (first failure: {next(iter(failures.values()))[1]})")
    out = torch.zeros((total, parts[0][1].shape[1]))
    for start, rows in parts:
        out[start : start + len(rows)] = rows
    return out


def sentence_tokens(sentence: str, vocab: Vocab, max_words: int) -> list[str]:
    """The tokens the encoder sees (unknown words shown as <unk>), then <eos>."""
    ids = [vocab.id(w) for w in sentence.lower().split()][:max_words]
    return [vocab.words[i] if i != UNK else SPECIALS[UNK] for i in ids] + [SPECIALS[EOS]]


def embed_file(
    checkpoint: Path, input_path: Path, output: Path, section: Any, visualize: Path | None = None
) -> dict[str, Any]:
    """Embed the sentences of ``input_path`` into ``output``; ``visualize``: also a PNG of the attention."""
    if output.suffix.lower() not in OUTPUT_SUFFIXES:
        raise UsageError(f"--output must end in .npy or .jsonl, not {output.name!r}")
    if section.output not in ("h", "image"):
        raise UsageError(f"embed.output must be h or image, not {section.output!r}")
    numbered = read_sentence_lines(input_path)
    sentences = [s for _, s in numbered]
    device = resolve_device(str(section.device))
    precision = resolve_precision(str(section.precision), device, "embed.precision")
    model, vocab, _ = load_encoder(checkpoint, device)
    max_words = int(section.max_words)
    batches = sentence_batches(sentences, vocab, max_words, int(section.batch_size), int(section.num_workers))
    failures: dict[int, tuple[str, str]] = {
        i: ("empty", "no word in the sentence") for i, s in enumerate(sentences) if not s.split()
    }
    vectors = guarded_encode(
        model,
        track(batches, "embedding", total=len(batches)),
        len(sentences),
        device,
        str(section.output),
        failures,
        precision,
    )
    if section.normalize:
        vectors = torch.nn.functional.normalize(vectors, dim=-1)
    arr = vectors.numpy().astype(np.float32)
    for i in failures:
        arr[i] = np.nan
    if output.suffix.lower() == ".npy":
        atomic_write(output, lambda fh: np.save(fh, arr, allow_pickle=False))
    else:
        atomic_write_text(
            output,
            "".join(
                json.dumps(_jsonl_row(s, v, failures.get(i))) + "\n" for i, (s, v) in enumerate(zip(sentences, arr))
            ),
        )
    failures_path = output.with_name(output.name + ".failures.jsonl")
    if failures:
        atomic_write_text(
            failures_path,
            "".join(
                json.dumps({"line": numbered[i][0], "text": sentences[i], "reason": r, "detail": d}) + "\n"
                for i, (r, d) in sorted(failures.items())
            ),
        )
        for i, (r, d) in sorted(failures.items()):
            log.warning("%s:%d: not embedded: %s (%s)", input_path, numbered[i][0], r, d)
    elif failures_path.exists():
        failures_path.unlink()  # from an earlier run of the same output
    result: dict[str, Any] = {
        "sentences": len(sentences),
        "dim": int(arr.shape[1]),
        "output": str(output),
        "failed": len(failures),
        "failures": str(failures_path) if failures else None,
    }
    if visualize is not None:
        if not model.self_attention:
            raise UsageError("--visualize needs an encoder with self-attention (this one was trained without)")
        tokens, lengths = words_to_inputs(sentences, vocab, max_words)
        with torch.no_grad(), autocast(device, precision):
            attn = model.encode(tokens.to(device), lengths)["attention"].float().cpu().numpy()
        words = [sentence_tokens(s, vocab, max_words) for s in sentences]
        mats = [attn[k, :, : len(w)] for k, w in enumerate(words)]
        rows = int(section.heatmap_rows) if section.heatmap_rows is not None else None
        result["heatmap"] = str(attention_heatmap(words, mats, visualize, rows))
    return result
