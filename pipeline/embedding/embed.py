"""Sentence embeddings for a file of sentences (``cli embed``), with the attention weights per word.

Input: a text file with one sentence per line (blank lines skipped), or JSON lines with a ``"text"`` (or
``"caption"``) field. Sentences are lowercased and split on whitespace; words outside the encoder's
vocabulary become ``<unk>``. Output: ``.npy`` (float32 (S, D)) or ``.jsonl`` (``{"text", "embedding"}``).
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
from pipeline.core.errors import UsageError
from pipeline.core.fileio import atomic_write, atomic_write_text
from pipeline.core.distributed import resolve_device
from pipeline.core.vocab import EOS, SPECIALS, UNK, Vocab

OUTPUT_SUFFIXES = (".npy", ".jsonl")


def read_sentences(path: Path) -> list[str]:
    """Sentences of a text or JSON-lines file (see the module docstring); errors name the file and line."""
    if not path.is_file():
        raise UsageError(f"input file not found: {path}")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError:
        raise UsageError(f"{path} is not UTF-8 text") from None
    out: list[str] = []
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
        out.append(line.strip())
    if not out:
        raise UsageError(f"{path} holds no sentence")
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
    sentences = read_sentences(input_path)
    device = resolve_device(str(section.device))
    model, vocab, _ = load_encoder(checkpoint, device)
    max_words = int(section.max_words)
    tokens, lengths = words_to_inputs(sentences, vocab, max_words)
    vectors = encode_batches(model, tokens, lengths, device, str(section.output), int(section.batch_size))
    if section.normalize:
        vectors = torch.nn.functional.normalize(vectors, dim=-1)
    arr = vectors.numpy().astype(np.float32)
    if output.suffix.lower() == ".npy":
        atomic_write(output, lambda fh: np.save(fh, arr, allow_pickle=False))
    else:
        atomic_write_text(output, "".join(json.dumps({"text": s, "embedding": [round(float(x), 6) for x in v]}) + "\n"
                                          for s, v in zip(sentences, arr)))
    result: dict[str, Any] = {"sentences": len(sentences), "dim": int(arr.shape[1]), "output": str(output)}
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
