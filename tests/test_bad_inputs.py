"""Bad user input is refused in one `error:` line naming the file or option, with the usage exit code 2 and no
Python traceback (a corpus of malformed configs, files and options run through the CLI)."""

from __future__ import annotations

from pathlib import Path

from PIL import Image


def _one_error_line(res, code: int = 2) -> str:
    """The single ``error:`` line of a refused run (exit ``code``, no traceback; log records aside)."""
    assert res.exit_code == code, res.output
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
    assert "Traceback" not in res.output
    log_lines = ("INFO ", "WARNING ", " " * 9)  # the log's records and their continuation lines
    lines = [line for line in res.output.splitlines() if line.strip() and not line.startswith(log_lines)]
    assert len(lines) == 1 and lines[0].startswith("error: "), res.output
    return lines[0]


def test_a_config_with_a_recursive_yaml_anchor_is_refused_naming_the_file(cli, tmp_path: Path) -> None:
    config = tmp_path / "loop.yaml"
    config.write_text("train: &x\n  stages: [*x]\n")
    line = _one_error_line(cli.invoke("train", "--config", str(config), "--out", str(tmp_path / "run")))
    assert str(config) in line and "refers to itself" in line


def test_a_set_value_with_a_recursive_yaml_anchor_is_refused_naming_the_key(cli, tmp_path: Path) -> None:
    line = _one_error_line(cli.invoke("train", "--set", "train.stages=&x [*x]", "--out", str(tmp_path / "run")))
    assert "--set train.stages" in line and "refers to itself" in line


def test_a_config_whose_aliases_expand_to_a_billion_values_is_refused_naming_the_file(cli, tmp_path: Path) -> None:
    """Nine levels of ten aliases: a small graph once loaded, 10^9 values once expanded (as the config digest
    would); refused from the graph, without expanding it."""
    lines = ["a0: &a0 [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 9)]
    config = tmp_path / "laughs.yaml"
    config.write_text("prepare:\n" + "".join(f"  {line}\n" for line in lines))
    line = _one_error_line(cli.invoke("prepare", "--config", str(config), "--out", str(tmp_path / "run")))
    assert str(config) in line and "more than 1,000,000 values" in line


def test_deeply_nested_configs_and_set_values_are_refused_in_one_line(cli, tmp_path: Path) -> None:
    shallow, deep = tmp_path / "nested.yaml", tmp_path / "deep.yaml"
    shallow.write_text("prepare:\n  karpathy_json: " + "[" * 100 + "]" * 100 + "\n")
    deep.write_text("prepare:\n  karpathy_json: " + "[" * 5000 + "]" * 5000 + "\n")  # beyond PyYAML's recursion
    line = _one_error_line(cli.invoke("prepare", "--config", str(shallow), "--out", str(tmp_path / "run")))
    assert str(shallow) in line and "more than 64 levels deep" in line
    line = _one_error_line(cli.invoke("prepare", "--config", str(deep), "--out", str(tmp_path / "run")))
    assert str(deep) in line and "too deeply" in line
    value = "[" * 5000 + "]" * 5000
    line = _one_error_line(cli.invoke("prepare", "--set", f"prepare.karpathy_json={value}", "--out", str(tmp_path)))
    assert "--set prepare.karpathy_json" in line and "too deeply" in line


def test_info_refuses_a_set_it_has_nothing_to_apply_to(cli, tiny_captioner: Path) -> None:
    line = _one_error_line(cli.invoke("info", "--set", "a.b"))
    assert "--set applies to --model NAME" in line
    for target in (tiny_captioner, tiny_captioner / "features" / "store", tiny_captioner / "train-a" / "best.pt"):
        line = _one_error_line(cli.invoke("info", str(target), "--set", "num_layers=1"))
        assert "--set applies to --model NAME" in line and str(target) in line
    assert cli.invoke("info", "--model", "san", "--set", "num_layers=1").exit_code == 0


def test_a_file_list_with_a_utf16_mark_but_odd_bytes_is_refused_naming_it(cli, tmp_path: Path) -> None:
    listing = tmp_path / "photos.txt"
    listing.write_bytes(b"\xff\xfe\x00bad\nline\x80\n")  # the UTF-16 mark, then an odd number of bytes
    for command in ("extract", "caption"):
        line = _one_error_line(cli.invoke(command, "--file-list", str(listing), "--weights", "random"))
        assert f"file list {listing}" in line and "UTF-16" in line


def test_import_features_refuses_a_negative_commit_interval(cli, tmp_path: Path) -> None:
    source = tmp_path / "rows.tsv"
    source.write_text("")
    for value in ("-1", "-5"):
        res = cli.invoke("import-features", str(source), "-f", "obj36-tsv", "--store", str(tmp_path / "s"),
                         "--commit-every", value)  # fmt: skip
        assert _one_error_line(res) == f"error: --commit-every must be 0 (commit by size only) or more, not {value}"
    assert not (tmp_path / "s").exists()


def test_prepare_refuses_a_split_file_without_images(cli, tmp_path: Path) -> None:
    karpathy = tmp_path / "dataset_coco.json"
    karpathy.write_text('{"images": []}')
    line = _one_error_line(cli.invoke("prepare", str(karpathy), "--out", str(tmp_path / "run")))
    assert line == f"error: {karpathy}: holds no image to prepare captions for (an empty 'images' list)"
    assert not (tmp_path / "run" / "data" / "manifest.json").exists()


def test_a_vocabulary_file_with_a_native_checkpoint_is_refused_not_ignored(cli, tiny_captioner: Path, tmp_path) -> None:
    vocab = tmp_path / "vocab.pkl"
    photo = tmp_path / "photo.png"
    Image.new("RGB", (64, 48), (200, 30, 30)).save(photo)
    model = ["--model", str(tiny_captioner), "--vocab", str(vocab), "--device", "cpu"]
    for res in (cli.invoke("evaluate", *model), cli.invoke("caption", str(photo), *model, "--weights", "random")):
        line = _one_error_line(res)
        assert "butd-caption checkpoint with its own vocabulary" in line and str(vocab) in line


def test_evaluate_refuses_an_unknown_split_as_a_usage_error(cli, tiny_captioner: Path) -> None:
    line = _one_error_line(cli.invoke("evaluate", "--model", str(tiny_captioner), "--split", "tset", "--device", "cpu"))
    assert line.startswith("error: --split (evaluate.split) must be a split of the prepared captions (train, val, ")
    assert line.endswith("not 'tset'")


def test_caption_does_not_overwrite_a_json_or_csv_output_it_did_not_write(cli, tiny_captioner: Path, tmp_path) -> None:
    photo = tmp_path / "photo.png"
    Image.new("RGB", (64, 48), (200, 30, 30)).save(photo)
    for name in ("captions.csv", "captions.json"):
        output = tmp_path / name
        output.write_text("someone else's file\n")
        res = cli.invoke("caption", str(photo), "--model", str(tiny_captioner), "--weights", "random",
                         "--output", str(output), "--device", "cpu")  # fmt: skip
        line = _one_error_line(res)
        assert f"{output} exists and was not written by `caption`" in line and "--force" in line
        assert output.read_text() == "someone else's file\n"
        output.unlink()


def test_mistakes_before_the_command_are_one_error_line(cli) -> None:
    res = cli("captoin", "photos/")
    assert res.returncode == 2 and "Traceback" not in res.stderr + res.stdout, res.stderr
    assert res.stderr.splitlines() == [
        "error: No such command 'captoin'. Did you mean 'caption'? (see `butd-caption --help`)"
    ]
    for args, line in (
        (["--nosuch", "info"], "error: No such option: --nosuch (see `butd-caption --help`)"),
        (["--threads"], "error: Option '--threads' requires an argument. (see `butd-caption --help`)"),
        (["--threads", "1"], "error: missing command (see `butd-caption --help`)"),
    ):
        assert _one_error_line(cli.invoke(*args)) == line


def test_a_store_identity_mismatch_names_the_differing_values_not_both_identities() -> None:
    from pipeline.store.format import identity_mismatch

    config = {"recipe": {f"field{i}": i for i in range(60)}, "boxes": {"conf": 0.2, "nms": 0.3}}
    stored = {"name": "bottom-up-butd", "weights_sha256": "0" * 64, "config": config}
    given = {**stored, "config": {**config, "boxes": {"conf": 0.3, "nms": 0.3}}}
    line = identity_mismatch("feats", stored, given)
    assert line == (
        'feature store feats was written by a different extractor ("bottom-up-butd"; differs in config): '
        "config.boxes.conf stored 0.2 vs given 0.3; use another store path"
    )


def test_a_second_extract_into_a_store_being_written_names_the_store_option(cli, tmp_path: Path) -> None:
    from pipeline.core.locks import acquire_lock
    from pipeline.core.stages import stage_lock

    photo = tmp_path / "photo.png"
    Image.new("RGB", (64, 48), (200, 30, 30)).save(photo)
    store = tmp_path / "store"
    with acquire_lock(stage_lock(store), "the first extract"):
        marker = store / "running.json"  # the first extract's record of its run, which the refused one leaves alone
        marker.write_text('{"stage": "store", "config_digest": "0"}')
        line = _one_error_line(cli.invoke("extract", str(photo), "--weights", "random", "--store", str(store)))
        assert marker.read_text() == '{"stage": "store", "config_digest": "0"}'
    assert "is being written by another process" in line
    assert line.endswith("wait for it to finish or use another --store")


def test_a_hub_id_that_would_leave_the_cache_is_refused_naming_it(cli, tmp_path: Path) -> None:
    env = {"BUTD_CACHE": str(tmp_path / "cache"), "HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_OFFLINE": "1"}
    outside = tmp_path / "outside"
    for hub_id, component in (
        (f"hf:owner/name/{outside}/w.bin", "''"),  # an empty component: the file became an absolute path
        ("hf:owner/name/w.bin@../../../../outside", "'..'"),
        ("hf:owner/name/./w.bin", "'.'"),
        ("hf:owner/name/w.bin?x=1", "'w.bin?x=1'"),
    ):
        line = _one_error_line(cli.invoke("fetch", hub_id, env=env))
        assert hub_id in line and component in line and "hf:OWNER/NAME[/FILE][@REVISION]" in line, line
    assert not outside.exists()
    # a revision with slashes (refs/pr/1) and a file in a subfolder stay valid hub ids
    from pipeline.hub.resolve import parse_hub_id

    hub = parse_hub_id("hf:owner/name/sub/w.bin@refs/pr/1")
    assert (hub.filename, hub.revision) == ("sub/w.bin", "refs/pr/1")


class _CallsPrint:
    def __reduce__(self):
        return (print, ("this ran",))


def test_a_captioner_pth_naming_a_disallowed_global_is_refused_naming_it(cli, tmp_path: Path) -> None:
    import pickle

    import torch

    zipped, legacy = tmp_path / "zipped.pth", tmp_path / "legacy.pth"
    torch.save({"state_dict": {}, "hook": _CallsPrint()}, zipped)
    legacy.write_bytes(pickle.dumps({"state_dict": _CallsPrint()}, protocol=4))
    vocab = tmp_path / "vocab.pkl"
    vocab.write_bytes(pickle.dumps({"itos": ["a"]}))
    res = cli.invoke("convert-captioner", str(zipped), "--vocab", str(vocab), "--output", str(tmp_path / "o.pt"))
    line = _one_error_line(res)
    assert str(zipped) in line and "the global 'print'" in line and "nothing from the file was run" in line, line
    assert "this ran" not in res.output
    # a pickle protocol torch's weights-only reader does not take: its reason, without torch's advice or warning
    line = _one_error_line(
        cli.invoke("convert-captioner", str(legacy), "--vocab", str(vocab), "--output", str(tmp_path / "o.pt"))
    )
    assert str(legacy) in line and "Unsupported operand" in line and "weights_only" not in line, line
    assert not (tmp_path / "o.pt").exists()


def test_convert_captioner_refuses_to_write_over_its_own_input(cli, tmp_path: Path) -> None:
    import pickle

    source, vocab = tmp_path / "release.pth", tmp_path / "vocab.pkl"
    source.write_bytes(b"release bytes")
    vocab.write_bytes(pickle.dumps({"itos": ["a"]}))
    for output, what in ((source, "SOURCE"), (vocab, "--vocab"), (tmp_path / "." / "release.pth", "SOURCE")):
        line = _one_error_line(
            cli.invoke("convert-captioner", str(source), "--vocab", str(vocab), "--output", str(output))
        )
        assert str(output) in line and f"is the {what} file" in line, line
    assert source.read_bytes() == b"release bytes"
    other = tmp_path / "kept.pt"
    other.write_bytes(b"another file")
    line = _one_error_line(cli.invoke("convert-captioner", str(source), "--vocab", str(vocab), "--output", str(other)))
    assert f"--output {other} exists: pass --force to overwrite it" in line
    assert other.read_bytes() == b"another file"
