"""Sentence embeddings for a file of sentences (``cli embed``), with the attention weights per word.

Input: a text file with one sentence per line (blank lines skipped), or JSON lines with a ``"text"`` (or
``"caption"``) field. Sentences are lowercased and split on whitespace; words outside the encoder's
vocabulary become ``<unk>``. Output: ``.npy`` (float32 (S, D)) or ``.jsonl`` (``{"text", "embedding"}``).

One odd sentence never costs the others: a sentence with no word is refused up front, and if the encoder
raises on a batch, its sentences are encoded one by one; each sentence that fails keeps its row (NaN in
``.npy``, ``"embedding": null`` with an ``"error"`` in ``.jsonl``) and is listed with its line number and
reason in ``OUTPUT.failures.jsonl``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pipeline.embedding.checkpoint import load_encoder
from pipeline.embedding.heatmap import attention_heatmap
from pipeline.embedding.retrieval import encode_batches, words_to_inputs
from pipeline.core.console import get_logger
from pipeline.core.errors import PipelineError, UsageError
from pipeline.core.fileio import atomic_write, atomic_write_text
from pipeline.core.distributed import resolve_device
from pipeline.core.vocab import EOS, SPECIALS, UNK, Vocab

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
            text = rec.get("text", rec.get("caption")) if isinstance(rec, dict) else rec if isinstance(rec, str) else None
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


def guarded_encode(model: Any, tokens: torch.Tensor, lengths: torch.Tensor, device: torch.device, output: str,
                   batch_size: int, failures: dict[int, tuple[str, str]]) -> torch.Tensor:
    """:func:`encode_batches` with a per-sentence guard: a batch that raises is encoded sentence by sentence and
    each sentence that still raises is recorded in ``failures`` (index -> reason, detail) with a zero row."""
    parts: list[tuple[int, torch.Tensor]] = []
    for s in range(0, len(tokens), batch_size):
        try:
            parts.append((s, encode_batches(model, tokens[s : s + batch_size], lengths[s : s + batch_size], device, output, batch_size)))
            continue
        except (RuntimeError, ValueError, IndexError) as exc:
            log.debug("batch at sentence %d failed (%s); encoding one by one", s, exc)
        for i in range(s, min(s + batch_size, len(tokens))):
            try:
                parts.append((i, encode_batches(model, tokens[i : i + 1], lengths[i : i + 1], device, output, 1)))
            except (RuntimeError, ValueError, IndexError) as exc:
                failures[i] = ("model_error", f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
    if not parts:
        raise PipelineError(f"no sentence could be embedded (first failure: {next(iter(failures.values()))[1]})")
    out = torch.zeros((len(tokens), parts[0][1].shape[1]))
    for start, rows in parts:
        out[start : start + len(rows)] = rows
    return out


def sentence_tokens(sentence: str, vocab: Vocab, max_words: int) -> list[str]:
    """The tokens the encoder sees (unknown words shown as <unk>), then <eos>."""
    ids = [vocab.id(w) for w in sentence.lower().split()][:max_words]
    return [vocab.words[i] if i != UNK else SPECIALS[UNK] for i in ids] + [SPECIALS[EOS]]


def embed_file(checkpoint: Path, input_path: Path, output: Path, section: Any, visualize: Path | None = None) -> dict[str, Any]:
    """Embed the sentences of ``input_path`` into ``output``; ``visualize``: also a PNG of the attention."""
    if output.suffix.lower() not in OUTPUT_SUFFIXES:
        raise UsageError(f"--output must end in .npy or .jsonl, not {output.name!r}")
    if section.output not in ("h", "image"):
        raise UsageError(f"embed.output must be h or image, not {section.output!r}")
    numbered = read_sentence_lines(input_path)
    sentences = [s for _, s in numbered]
    device = resolve_device(str(section.device))
    model, vocab, _ = load_encoder(checkpoint, device)
    max_words = int(section.max_words)
    tokens, lengths = words_to_inputs(sentences, vocab, max_words)
    failures: dict[int, tuple[str, str]] = {i: ("empty", "no word in the sentence") for i, s in enumerate(sentences) if not s.split()}
    vectors = guarded_encode(model, tokens, lengths, device, str(section.output), int(section.batch_size), failures)
    if section.normalize:
        vectors = torch.nn.functional.normalize(vectors, dim=-1)
    arr = vectors.numpy().astype(np.float32)
    for i in failures:
        arr[i] = np.nan
    if output.suffix.lower() == ".npy":
        atomic_write(output, lambda fh: np.save(fh, arr, allow_pickle=False))
    else:
        atomic_write_text(output, "".join(json.dumps(_jsonl_row(s, v, failures.get(i))) + "\n"
                                          for i, (s, v) in enumerate(zip(sentences, arr))))
    failures_path = output.with_name(output.name + ".failures.jsonl")
    if failures:
        atomic_write_text(failures_path, "".join(
            json.dumps({"line": numbered[i][0], "text": sentences[i], "reason": r, "detail": d}) + "\n"
            for i, (r, d) in sorted(failures.items())))
        for i, (r, d) in sorted(failures.items()):
            log.warning("%s:%d: not embedded: %s (%s)", input_path, numbered[i][0], r, d)
    elif failures_path.exists():
        failures_path.unlink()  # from an earlier run of the same output
    result: dict[str, Any] = {"sentences": len(sentences), "dim": int(arr.shape[1]), "output": str(output),
                              "failed": len(failures), "failures": str(failures_path) if failures else None}
    if visualize is not None:
        if not model.self_attention:
            raise UsageError("--visualize needs an encoder with self-attention (this one was trained without)")
        with torch.no_grad():
            attn = model.encode(tokens.to(device), lengths)["attention"].float().cpu().numpy()
        words = [sentence_tokens(s, vocab, max_words) for s in sentences]
        mats = [attn[k, :, : len(w)] for k, w in enumerate(words)]
        rows = int(section.heatmap_rows) if section.heatmap_rows is not None else None
        result["heatmap"] = str(attention_heatmap(words, mats, visualize, rows))
    return result
