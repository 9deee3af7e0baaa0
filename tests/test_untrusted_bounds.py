"""Untrusted release files are bounded in time and memory, and every reader's error is one line naming the file:
reference bombs (a few hundred bytes standing for terabytes), AoANet vocabularies with odd keys, weights that lack
a tensor the conversion reads. Each is tried through `info`, `convert-captioner` and the Python API `caption` uses."""

from __future__ import annotations

import pickle
import resource
import struct
import subprocess
import time
from pathlib import Path

import pytest
import torch
from release_helpers import write_aoanet, write_m2_checkpoint, write_m2_vocab

from pipeline.core.errors import UsageError

WORDS = ["a", "man", "dog", "on", "the", "grass", "with", "ball"]


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("BUTD_CACHE", str(tmp_path / "cache"))


def shared_reference_bomb(levels: int = 40, width: int = 10) -> bytes:
    """A pickle of ``levels`` nested lists, each holding ``width`` references to the one below: width**levels leaves."""
    x: list = []
    for _ in range(levels):
        x = [x] * width
    return pickle.dumps(x, protocol=2)


def m2_vocab_bomb() -> bytes:
    """An M2 ``vocab.pkl`` (a ``data.vocab.Vocab`` object) whose ``itos`` is a reference bomb."""
    inner = shared_reference_bomb()
    assert inner[:2] == b"\x80\x02" and inner[-1:] == b"."
    body = inner[2:-1]  # the list, then BUILD it into the Vocab stand-in
    return b"\x80\x02cdata.vocab\nVocab\nq\xf0)\x81}(X\x04\x00\x00\x00itos" + body + b"ub."


def counter_copy_bomb(entries: int = 20000, copies: int = 20000) -> bytes:
    """``[Counter(d), Counter(d), ...]`` with one shared ``d``: every ``Counter`` copies it (quadratic expansion)."""
    d = b"}q\x00(" + b"".join(b"J" + struct.pack("<i", i) + b"J" + struct.pack("<i", i) for i in range(entries)) + b"u"
    one = b"ccollections\nCounter\nq\x01" + d + b"\x85R"
    again = b"h\x01h\x00\x85R"
    return b"\x80\x02(" + one + again * (copies - 1) + b"l."


#: one thread for the ``cli`` children that read the planted files
BOUNDED = {"OMP_NUM_THREADS": "1"}


def limit_memory() -> None:
    """The ``cli`` child's data limit, 4 GB: a bomb that slipped through dies instead of the machine."""
    resource.setrlimit(resource.RLIMIT_DATA, (4 << 30, 4 << 30))


def one_error_line(res: subprocess.CompletedProcess | object, name: str) -> str:
    out = res.stderr if isinstance(res, subprocess.CompletedProcess) else res.output
    code = res.returncode if isinstance(res, subprocess.CompletedProcess) else res.exit_code
    lines = [x for x in out.splitlines() if x.startswith("error:")]
    assert code == 2 and len(lines) == 1 and "Traceback" not in out, out[-3000:]
    assert name in lines[0], lines[0]
    return lines[0]


def test_reference_bombs_are_refused_quickly_in_bounded_memory(cli, tmp_path: Path) -> None:
    from models.released import m2 as rel_m2

    bomb = tmp_path / "vocab.pkl"
    bomb.write_bytes(m2_vocab_bomb())
    assert bomb.stat().st_size < 1000
    t0 = time.perf_counter()
    with pytest.raises(UsageError, match="vocab.pkl: refused to load the M2 vocab.pkl: it expands past"):
        rel_m2.read_vocab(bomb)
    assert time.perf_counter() - t0 < 30
    counter = tmp_path / "counter.pkl"
    counter.write_bytes(counter_copy_bomb())
    t0 = time.perf_counter()
    with pytest.raises(UsageError, match="counter.pkl: refused to load"):
        rel_m2.read_vocab(counter)
    assert time.perf_counter() - t0 < 30
    # the CLI commands that read a vocabulary: one line naming the file, exit 2, in bounded time and memory
    weights = tmp_path / "meshed_memory_transformer.pth"
    write_m2_checkpoint(weights, 4 + len(WORDS), d=16, d_ff=24, m=3, d_in=12, max_len=10)
    one_error_line(cli("info", str(bomb), env=BOUNDED, timeout=120, preexec_fn=limit_memory), "vocab.pkl")
    one_error_line(
        cli(
            "convert-captioner",
            str(weights),
            "--vocab",
            str(bomb),
            "--output",
            str(tmp_path / "x.pt"),
            env=BOUNDED,
            timeout=120,
            preexec_fn=limit_memory,
        ),
        "vocab.pkl",
    )
    assert not (tmp_path / "x.pt").exists()


def test_an_honest_vocabulary_is_well_within_the_limit(tmp_path: Path) -> None:
    from models.released import m2 as rel_m2

    words = [f"w{i}" for i in range(20000)]
    write_m2_vocab(tmp_path / "vocab.pkl", words)
    assert len(rel_m2.read_vocab(tmp_path / "vocab.pkl")) == 4 + len(words)


@pytest.mark.parametrize("odd", ["\u00b2", "1" * 5000, "01", " 1", "-1", "\u0661"])
def test_aoanet_vocabulary_with_odd_keys_is_one_line_everywhere(cli, tmp_path: Path, odd: str) -> None:
    from models.released import convert_release, describe_captioner

    write_aoanet(tmp_path, WORDS + ["UNK"], d=16, d_in=12)
    infos = tmp_path / "infos_aoanet-best.pkl"
    data = pickle.loads(infos.read_bytes())  # the test's own file
    vocab = dict(data["vocab"])
    vocab[odd] = vocab.pop("3")
    data["vocab"] = vocab
    infos.write_bytes(pickle.dumps(data, protocol=2))
    with pytest.raises(UsageError, match="infos_aoanet-best.pkl: the vocab keys must be"):
        describe_captioner(infos)
    with pytest.raises(UsageError, match="infos_aoanet-best.pkl: the vocab keys must be"):
        convert_release(tmp_path / "model-best.pth", infos)
    one_error_line(cli.invoke("info", str(infos)), "infos_aoanet-best.pkl")
    one_error_line(
        cli.invoke(
            "convert-captioner",
            str(tmp_path / "model-best.pth"),
            "--vocab",
            str(infos),
            "--output",
            str(tmp_path / "x.pt"),
        ),
        "infos_aoanet-best.pkl",
    )


@pytest.mark.parametrize(
    "kind,key",
    [
        ("aoanet", "embed.0.weight"),
        ("aoanet", "logit.bias"),
        ("aoanet", "att_embed.0.weight"),
        ("m2", "decoder.word_emb.weight"),
        ("m2", "decoder.pos_emb.weight"),
        ("m2", "encoder.fc.weight"),
    ],
)
def test_release_weights_missing_a_tensor_are_one_line_everywhere(cli, tmp_path: Path, kind: str, key: str) -> None:
    from models.loading import load_captioner
    from models.released import describe_captioner

    if kind == "aoanet":
        write_aoanet(tmp_path, WORDS + ["UNK"], d=16, d_in=12)
        weights, vocab = tmp_path / "model-best.pth", tmp_path / "infos_aoanet-best.pkl"
        state = torch.load(weights, weights_only=True)
        if key not in MARKERS_OF[kind]:
            del state[key]
        else:
            state[key] = torch.zeros(0)
        torch.save(state, weights)
    else:
        write_m2_vocab(tmp_path / "vocab.pkl", WORDS)
        weights, vocab = tmp_path / "meshed_memory_transformer.pth", tmp_path / "vocab.pkl"
        write_m2_checkpoint(weights, 4 + len(WORDS), d=16, d_ff=24, m=3, d_in=12, max_len=10)
        ckpt = torch.load(weights, weights_only=False)  # the test's own file
        del ckpt["state_dict"][key]
        torch.save(ckpt, weights)
    info = cli.invoke("info", str(weights))
    if info.exit_code != 0:  # describing it may already need the tensor
        one_error_line(info, weights.name)
    else:
        assert describe_captioner(weights) is not None
    one_error_line(
        cli.invoke("convert-captioner", str(weights), "--vocab", str(vocab), "--output", str(tmp_path / "x.pt")),
        weights.name,
    )
    with pytest.raises(UsageError, match=weights.name):  # what `caption --model W --vocab V` does first
        load_captioner(weights, torch.device("cpu"), companion=vocab)


MARKERS_OF = {"aoanet": ("core.att_lstm.weight_ih", "att_embed.0.weight", "core.att2ctx.0.weight")}
