"""Released captioners (models/released/): files in the exact layouts of M2 and AoANet, restricted unpickling,
conversion to native checkpoints (names, shapes, vocabulary rows), refusal of tampered pickles, the CLI."""

from __future__ import annotations

import pickle

import pytest
import torch
from release_helpers import write_aoanet, write_m2_checkpoint, write_m2_vocab
from typer.testing import CliRunner

from models.loading import load_captioner
from models.released import aoanet as rel_aoa
from models.released import convert_release, detect, ensure_native, load_release
from models.released import m2 as rel_m2
from pipeline.core.errors import UsageError
from pipeline.core.vocab import BOS, EOS, PAD, UNK

SMALL_M2 = dict(d=16, d_ff=24, m=3, d_in=12, max_len=10)
SMALL_AOA = dict(d=16, d_in=12)
WORDS = ["a", "man", "dog", "on", "the", "grass", "with", "ball"]


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("BUTD_CACHE", str(tmp_path / "cache"))


@pytest.fixture
def m2_files(tmp_path):
    write_m2_vocab(tmp_path / "vocab.pkl", WORDS)
    state = write_m2_checkpoint(tmp_path / "meshed_memory_transformer.pth", 4 + len(WORDS), **SMALL_M2)
    return tmp_path / "meshed_memory_transformer.pth", tmp_path / "vocab.pkl", state


@pytest.fixture
def aoa_files(tmp_path):
    state = write_aoanet(tmp_path, WORDS + ["UNK"], **SMALL_AOA)
    return tmp_path / "model-best.pth", tmp_path / "infos_aoanet-best.pkl", state


def test_real_m2_vocab_pkl_loads_through_the_restricted_unpickler(shared_data) -> None:
    itos = rel_m2.read_vocab(shared_data / "m2" / "vocab.pkl")
    assert len(itos) == 10_201
    assert itos[:8] == ["<unk>", "<pad>", "<bos>", "<eos>", "a", "on", "of", "the"]
    words = rel_m2.project_words(itos)
    assert words[:5] == ["<pad>", "<bos>", "<eos>", "<unk>", "a"] and len(words) == 10_201


def test_m2_layout_has_the_release_keys(m2_files) -> None:
    path, _, state = m2_files
    assert "decoder.layers.2.fc_alpha3.weight" in state and "encoder.layers.0.mhatt.attention.m_k" in state
    assert "decoder.running_seq" in state and state["decoder.layers.0.self_att.running_keys"].shape == (0, 16)
    kind, obj = load_release(path)
    assert kind == "m2" and set(obj) >= {"state_dict", "numpy_rng_state", "val_cider"}


def test_m2_conversion_maps_names_shapes_and_vocabulary_rows(m2_files) -> None:
    path, vocab, state = m2_files
    payload = convert_release(path, vocab)
    assert payload.model_name == "m2" and list(payload.vocab)[:5] == ["<pad>", "<bos>", "<eos>", "<unk>", "a"]
    cfg = payload.model_config
    assert (
        cfg["official_mask"] is True and cfg["fixed_regions"] == 50 and cfg["max_len"] == 10 and cfg["num_memory"] == 3
    )
    w = payload.weights
    emb, out = state["decoder.word_emb.weight"], state["decoder.fc.weight"]
    for ours, theirs in ((PAD, 1), (BOS, 2), (EOS, 3), (UNK, 0), (4, 4), (11, 11)):
        assert torch.equal(w["word_emb.weight"][ours], emb[theirs]) and torch.equal(w["out.weight"][ours], out[theirs])
    assert torch.equal(w["layers.1.gates.2.weight"], state["decoder.layers.1.fc_alpha3.weight"])
    assert torch.equal(w["encoder.attn.2.attention.m_v"], state["encoder.layers.2.mhatt.attention.m_v"])
    assert torch.equal(w["encoder.ff.0.norm.bias"], state["encoder.layers.0.pwff.layer_norm.bias"])
    assert torch.equal(w["pos_emb.weight"], state["decoder.pos_emb.weight"])
    assert payload.decoding["stop_rule"] == "official_m2" and payload.decoding["beam_size"] == 5
    model, ckpt = load_captioner(path, companion=vocab)
    assert ckpt.release.kind == "m2" and model.encoder.official_mask and model.fixed_regions == 50


def test_m2_converted_model_runs_and_pads_to_fifty_regions(m2_files) -> None:
    path, vocab, _ = m2_files
    model, _ = load_captioner(path, companion=vocab)
    model.eval()
    feats = torch.rand(2, 60, 12)
    mask = torch.ones(2, 60, dtype=torch.bool)
    mask[1, 7:] = False
    with torch.no_grad():
        enc = model.encode(feats, mask, torch.zeros(2, 60, 4), torch.ones(2, 2))
        assert enc["allowed"].shape == (2, 50)  # first 50 regions; the 7-region image zero-padded to 50
        short = model.encode(feats[1:, :7], mask[1:, :7], torch.zeros(1, 7, 4), torch.ones(1, 2))
    torch.testing.assert_close(short["cross_k"], enc["cross_k"][1:], atol=1e-6, rtol=0)


def test_cached_conversion_is_reused_and_native(m2_files, tmp_path, monkeypatch) -> None:
    path, vocab, _ = m2_files
    first = ensure_native(path, vocab)
    stamp = first.stat().st_mtime_ns
    assert ensure_native(path, vocab) == first and first.stat().st_mtime_ns == stamp
    import models.released as released

    def never(*_a, **_k):
        raise AssertionError("the release file was unpickled again")

    monkeypatch.setattr(released, "load_release", never)
    model, ckpt = load_captioner(path, companion=vocab)  # later runs: hashes, then the native copy only
    assert ckpt.release.kind == "m2"
    data = torch.load(first, weights_only=True)  # the native file needs no allowlist
    assert data["format"] == "butd-caption-checkpoint" and data["release"]["vocab_file"] == "vocab.pkl"


def test_aoanet_layout_conversion_and_rows(aoa_files) -> None:
    path, infos, state = aoa_files
    assert "refiner.layers.5.self_attn.aoa_layer.0.weight" in state and "core.attention.norm.a_2" in state
    assert "refiner.layers.0.sublayer.0.norm.b_2" in state and "core.attention.linears.0.weight" in state
    payload = convert_release(path, infos)
    v = len(WORDS) + 1  # release words 1..V, V = UNK
    assert payload.model_name == "aoa" and list(payload.vocab) == ["<pad>", "<bos>", "<eos>", "<unk>", *WORDS]
    cfg = payload.model_config
    assert cfg["num_layers"] == 6 and not cfg["use_ff"] and cfg["d_model"] == 16 and cfg["ctx_drop"] is True
    w = payload.weights
    emb, logit, bias = state["embed.0.weight"], state["logit.weight"], state["logit.bias"]
    for ours, theirs in ((PAD, 0), (BOS, 0), (EOS, 0), (UNK, v), (4, 1), (4 + len(WORDS) - 1, len(WORDS))):
        assert torch.equal(w["embed.0.weight"][ours], emb[theirs])
    assert torch.equal(w["logit.weight"][EOS], logit[0]) and torch.equal(w["logit.bias"][UNK], bias[v])
    assert float(w["logit.bias"][PAD]) < -1e29 and float(w["logit.bias"][BOS]) < -1e29
    assert torch.equal(w["refiner.3.k.weight"], state["refiner.layers.3.self_attn.linears.1.weight"])
    assert torch.equal(w["query_norm.a"], state["core.attention.norm.a_2"])
    model, ckpt = load_captioner(path, companion=infos)
    model.eval()
    assert ckpt.decoding["stop_rule"] == "official_aoanet" and ckpt.decoding["beam_size"] == 2
    with torch.no_grad():  # the log-softmax over the release's rows is unchanged by the two impossible rows
        enc = model.encode(
            torch.rand(1, 5, 12), torch.ones(1, 5, dtype=torch.bool), torch.zeros(1, 5, 4), torch.ones(1, 2)
        )
        logp, _ = model.step(torch.tensor([BOS]), enc, model.init_state(enc))
    assert float(logp[0, PAD].exp()) == 0.0 and abs(float(logp[0, 2:].exp().sum()) - 1) < 1e-5


def test_dataparallel_prefix_and_zip_format(tmp_path) -> None:
    state = write_aoanet(tmp_path, WORDS + ["UNK"], **SMALL_AOA)
    torch.save({f"module.{k}": v for k, v in state.items()}, tmp_path / "model-best.pth")  # saved from DataParallel
    assert convert_release(tmp_path / "model-best.pth").model_name == "aoa"  # infos found next to it
    write_m2_vocab(tmp_path / "vocab.pkl", WORDS)
    write_m2_checkpoint(tmp_path / "m2.pth", 4 + len(WORDS), **SMALL_M2)
    from models.released.unpickle import load_weights_file

    obj = load_weights_file(tmp_path / "m2.pth", "M2 checkpoint")  # re-saved in the zip format of torch >= 1.6
    torch.save(obj, tmp_path / "m2zip.pth")
    assert load_release(tmp_path / "m2zip.pth")[0] == "m2"


@pytest.mark.parametrize("protocol", [0, 2, 4])
def test_aoanet_infos_any_pickle_protocol(tmp_path, protocol: int) -> None:
    write_aoanet(tmp_path, WORDS + ["UNK"], protocol=protocol, **SMALL_AOA)
    infos = rel_aoa.read_infos(tmp_path / "infos_aoanet-best.pkl")
    assert infos["opt"]["rnn_size"] == 16 and infos["vocab"]["1"] == "a" and infos["best_val_score"] == 1.2
    assert isinstance(infos["opt"], dict)


def test_aoanet_unsupported_option_is_one_clear_error(tmp_path) -> None:
    from release_helpers import aoanet_options

    write_aoanet(tmp_path, WORDS + ["UNK"], **SMALL_AOA)
    infos = tmp_path / "infos_aoanet-best.pkl"
    obj = {
        "opt": aoanet_options(len(WORDS) + 1, d=16, d_in=12, norm_att_feat=1),
        "vocab": {str(i + 1): w for i, w in enumerate(WORDS + ["UNK"])},
    }
    infos.write_bytes(pickle.dumps(obj, protocol=2))
    with pytest.raises(UsageError, match="norm_att_feat=1"):
        convert_release(tmp_path / "model-best.pth", infos)


@pytest.mark.parametrize("bad", [b"cos\nsystem\n", b"cbuiltins\neval\n", b"cdata.vocab\nLoader\n"])
def test_tampered_pickle_is_refused_naming_the_file(m2_files, bad: bytes) -> None:
    path, vocab, _ = m2_files
    raw = vocab.read_bytes()
    assert raw.count(b"ccollections\nCounter\n") == 1
    vocab.write_bytes(raw.replace(b"ccollections\nCounter\n", bad))
    with pytest.raises(UsageError) as info:
        rel_m2.read_vocab(vocab)
    msg = str(info.value)
    assert str(vocab) in msg and "refused" in msg and "\n" not in msg
    assert bad.split(b"\n")[0][1:].decode() in msg


def test_tampered_infos_refused_and_cli_prints_one_line(aoa_files) -> None:
    import cli

    path, infos, _ = aoa_files
    raw = infos.read_bytes()
    assert b"cargparse\nNamespace\n" in raw
    infos.write_bytes(raw.replace(b"cargparse\nNamespace\n", b"cposix\nsystem\n"))
    result = CliRunner().invoke(
        cli.app, ["convert-captioner", str(path), "--vocab", str(infos), "--output", str(path.parent / "x.pt")]
    )
    assert result.exit_code == 2
    lines = [ln for ln in result.output.strip().splitlines() if ln.strip()]
    assert (
        len(lines) == 1 and "refused" in lines[0] and "posix.system" in lines[0] and "infos_aoanet-best.pkl" in lines[0]
    )
    assert not (path.parent / "x.pt").exists()


def test_not_a_release_is_a_clear_error(tmp_path) -> None:
    torch.save({"weights": {"x": torch.zeros(1)}}, tmp_path / "other.pth")
    assert detect(torch.load(tmp_path / "other.pth", weights_only=True)) is None
    with pytest.raises(UsageError, match="neither a butd-caption checkpoint nor a released"):
        convert_release(tmp_path / "other.pth")
    with pytest.raises(UsageError, match="pass its vocab.pkl with --vocab"):
        path = tmp_path / "m2.pth"
        write_m2_checkpoint(path, 12, **SMALL_M2)
        convert_release(path)


def test_cli_convert_and_info(m2_files, tmp_path) -> None:
    import cli

    path, vocab, _ = m2_files
    runner = CliRunner()
    out = tmp_path / "m2-native.pt"
    res = runner.invoke(cli.app, ["convert-captioner", str(path), "--vocab", str(vocab), "--output", str(out)])
    assert res.exit_code == 0, res.output
    assert out.is_file() and "m2" in res.output
    info = runner.invoke(cli.app, ["info", str(path)])
    assert info.exit_code == 0, info.output
    assert "M2 Meshed-Memory Transformer" in info.output and "official_m2" in info.output
    info_native = runner.invoke(cli.app, ["info", str(out)])
    assert info_native.exit_code == 0 and "converted from" in info_native.output


def test_cli_info_names_the_vocabulary_pickles(m2_files, aoa_files, shared_data) -> None:
    import cli

    runner = CliRunner()
    res = runner.invoke(cli.app, ["info", str(shared_data / "m2" / "vocab.pkl")])
    assert res.exit_code == 0, res.output
    assert "M2 vocab.pkl" in res.output and "10,201 words" in res.output
    res = runner.invoke(cli.app, ["info", str(aoa_files[1])])
    assert res.exit_code == 0, res.output
    assert "AoANet infos pickle" in res.output and "rnn_size=16" in res.output
    res = runner.invoke(cli.app, ["info", str(aoa_files[0])])
    assert res.exit_code == 0 and "AoANet (husthuaan/AoANet)" in res.output
