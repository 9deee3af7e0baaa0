"""`cli embed`: one odd sentence never costs the others (refused up front or guarded), rows stay aligned."""

from __future__ import annotations

import json

import numpy as np
from test_retrieval import invoke, trained  # noqa: F401  (the module-scoped tiny encoder)


def test_empty_sentence_is_refused_and_listed(trained, tmp_path) -> None:  # noqa: F811
    _, enc, _ = trained
    jl = tmp_path / "s.jsonl"
    jl.write_text('{"text": "a red circle"}\n{"text": "   "}\n{"text": "two squares"}\n')
    r = invoke("embed", "-k", str(enc / "best.pt"), "-i", str(jl), "--output", str(tmp_path / "e.npy"))
    assert r.exit_code == 0, r.output
    arr = np.load(tmp_path / "e.npy")
    assert arr.shape[0] == 3 and np.isfinite(arr[[0, 2]]).all() and np.isnan(arr[1]).all()
    fails = [json.loads(x) for x in (tmp_path / "e.npy.failures.jsonl").read_text().splitlines()]
    assert fails == [{"line": 2, "text": "", "reason": "empty", "detail": "no word in the sentence"}]
    assert "not embedded: 1" in r.output


def test_a_sentence_on_which_the_encoder_raises_costs_only_itself(trained, tmp_path, monkeypatch) -> None:  # noqa: F811
    """Fault injection: the encoder raises whenever its batch holds the word 'square'."""
    _, enc, _ = trained
    import pipeline.embedding.embed as embed
    from pipeline.embedding.checkpoint import load_encoder

    def faulty_load(*a, **kw):
        model, vocab, extra = load_encoder(*a, **kw)
        bad = vocab.id("square")
        real = model.encode

        def encode(tokens, lengths):
            if (tokens == bad).any():
                raise RuntimeError("injected failure")
            return real(tokens, lengths)

        model.encode = encode
        return model, vocab, extra

    monkeypatch.setattr(embed, "load_encoder", faulty_load)
    txt = tmp_path / "s.txt"
    txt.write_text("a red circle\na blue square\ntwo green triangles\n")
    r = invoke("embed", "-k", str(enc / "best.pt"), "-i", str(txt), "--output", str(tmp_path / "e.jsonl"))
    assert r.exit_code == 0, r.output
    rows = [json.loads(x) for x in (tmp_path / "e.jsonl").read_text().splitlines()]
    assert [x["text"] for x in rows] == ["a red circle", "a blue square", "two green triangles"]
    assert rows[1]["embedding"] is None and "encoder_failed" in rows[1]["error"]
    assert len(rows[0]["embedding"]) == len(rows[2]["embedding"]) > 0
    fails = [json.loads(x) for x in (tmp_path / "e.jsonl.failures.jsonl").read_text().splitlines()]
    assert [(f["line"], f["reason"]) for f in fails] == [(2, "encoder_failed")]
