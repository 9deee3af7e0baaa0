"""Numbers checked before work, strict outputs, inputs as editors save them, failed writes that name their file:
--length-penalty nan, --beam-size 2 --n-best 4, --max-len past the position table, NaN scores in JSON, formula
cells in CSV, file lists with a byte-order mark, globs over folders with repeated names, a full disk mid-append."""

from __future__ import annotations

import csv
import errno
import json
import math
import os
from pathlib import Path

import pytest
import torch
from PIL import Image
from typer.testing import CliRunner

from pipeline.core.errors import ConfigError, UsageError, os_error_message


def strict_loads(text: str):
    def refuse(name: str):
        raise ValueError(f"{name} in strict JSON")

    return json.loads(text, parse_constant=refuse)


def photo(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (24, 20), (1, 2, 3)).save(path)
    return path


# ---- numbers -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "args,flag",
    [
        (["--length-penalty", "nan"], "--length-penalty"),
        (["--length-penalty", "inf"], "--length-penalty"),
        (["--beam-size", "2", "--n-best", "4"], "--n-best 4 cannot exceed --beam-size 2"),
        (["--max-len", "0"], "--max-len"),
        (["--set", "caption.conf_thresh=nan"], "caption.conf_thresh"),
        (["--set", "caption.batch_size=0"], "caption.batch_size"),
        (["--n-best", "0"], "--n-best"),
        (["--batch-size", "0"], "--batch-size"),
        (["--num-workers", "-1"], "--num-workers"),
    ],
)
def test_caption_refuses_bad_numbers_before_any_work(tmp_path: Path, args: list[str], flag: str) -> None:
    """One line, exit 2, before the model is even looked for (the --model here does not exist)."""
    import cli

    res = CliRunner().invoke(
        cli.app, ["caption", str(photo(tmp_path / "a.jpg")), "--model", str(tmp_path / "none.pt"), *args]
    )
    lines = [x for x in res.output.splitlines() if x.startswith("error:")]
    assert res.exit_code == 2 and len(lines) == 1 and "Traceback" not in res.output, res.output[-2000:]
    assert flag in lines[0] and "none.pt" not in lines[0], lines[0]


@pytest.mark.parametrize(
    "command", [["extract", "--store", "S"], ["train", "--out", "R"], ["evaluate", "--model", "M.pt"]]
)
def test_every_model_command_refuses_a_zero_batch_and_negative_workers(tmp_path: Path, command: list[str]) -> None:
    import cli

    for flag, value in (("--batch-size", "0"), ("--num-workers", "-2")):
        args = [command[0], *[str(tmp_path / a) if a.isupper() or "." in a else a for a in command[1:]], flag, value]
        res = CliRunner().invoke(cli.app, args)
        lines = [x for x in res.output.splitlines() if x.startswith("error:")]
        assert res.exit_code == 2 and len(lines) == 1 and flag in lines[0], res.output[-2000:]


def test_decoding_numbers_are_finite_and_n_best_is_never_silently_widened(tmp_path: Path) -> None:
    from models.decoding import DecodeOptions
    from models.decoding.captions import merge_decoding
    from pipeline.commands.decoding_opts import decoding_overrides
    from pipeline.core.config import load_config

    for bad in (math.nan, math.inf, -math.inf):
        with pytest.raises(UsageError, match="--length-penalty must be a finite number"):
            decoding_overrides(length_penalty=bad)
        with pytest.raises(ConfigError, match="finite"):
            DecodeOptions(length_penalty=bad)
        with pytest.raises(ConfigError, match="finite"):
            DecodeOptions(method="sample", temperature=bad)
    with pytest.raises(ConfigError, match="caption.nms_thresh.*nan"):
        load_config("caption", None, ["caption.nms_thresh=nan"])
    yaml_nan = tmp_path / "nan.yaml"
    yaml_nan.write_text("caption:\n  conf_thresh: .nan\n")  # YAML's own NaN is a float
    with pytest.raises(ConfigError, match="'caption.conf_thresh' must be a finite number"):
        load_config("caption", yaml_nan, [])
    with pytest.raises(ConfigError, match="n_best \\(4\\) cannot exceed beam_size \\(2\\)"):
        DecodeOptions.from_mapping(merge_decoding({"beam_size": 3}, {"beam_size": 2, "n_best": 4}))
    assert (
        merge_decoding({"beam_size": 3}, {"n_best": 4})["beam_size"] == 4
    )  # the checkpoint's own beam: widened, said in a log line
    assert merge_decoding({"beam_size": 5}, {"n_best": 4})["beam_size"] == 5


@pytest.mark.parametrize(
    "name,config",
    [
        ("san", {"d_model": 16, "num_heads": 2, "d_ff": 32, "num_layers": 1, "feat_dim": 8}),
        (
            "m2",
            {
                "d_model": 16,
                "num_heads": 2,
                "d_ff": 32,
                "num_layers": 3,
                "num_dec_layers": 1,
                "num_memory": 2,
                "feat_dim": 8,
                "max_len": 12,
            },
        ),
    ],
)
def test_max_len_past_the_position_table_is_refused_up_front(name: str, config: dict) -> None:
    from models import build_captioner
    from models.decoding import DecodeOptions, check_max_len

    model = build_captioner(name, 20, **config)
    limit = model.max_caption_len()
    assert limit is not None and limit >= 12
    check_max_len(DecodeOptions(max_len=limit), model)
    with pytest.raises(ConfigError, match=f"--max-len {limit + 1} is longer than the {limit} positions"):
        check_max_len(DecodeOptions(max_len=limit + 1), model, "--max-len")
    aoa = build_captioner("aoa", 20, d_model=16, num_heads=2, feat_dim=8, num_layers=0)
    assert aoa.max_caption_len() is None  # recurrent: no table, no limit
    assert name in ("san", "m2") and torch.is_tensor(next(model.parameters()))


# ---- strict outputs ------------------------------------------------------------------------------------------
def test_non_finite_scores_are_null_and_formula_cells_are_neutralised(tmp_path: Path) -> None:
    from pipeline.captioning.journal import dumps_row
    from pipeline.captioning.output import finalize, plan_output

    rows = [
        {"image": '=HYPERLINK("http://x","y").jpg', "key": "@SUM(A1).jpg", "caption": "a cat", "score": math.nan},
        {"image": "+1.jpg", "key": "-2.jpg", "caption": "=cmd|' /C calc'!A0", "score": -1.5},
        {
            "image": "ok.jpg",
            "key": "ok.jpg",
            "caption": "a dog",
            "score": math.inf,
            "nbest": [{"caption": "a dog", "score": math.nan}],
        },
    ]
    for r in rows:
        back = strict_loads(dumps_row(r).decode())
        assert all(v is None or not isinstance(v, float) or math.isfinite(v) for v in back.values())
    assert strict_loads(dumps_row(rows[0]).decode())["score"] is None
    json_plan = plan_output(tmp_path / "out.json", None)
    finalize(json_plan, iter(rows), True)
    assert [r["score"] for r in strict_loads(json_plan.path.read_text())] == [None, -1.5, None]
    csv_plan = plan_output(tmp_path / "out.csv", None)
    finalize(csv_plan, iter(rows), True)
    table = list(csv.DictReader(csv_plan.path.open(newline="", encoding="utf-8")))
    for r in table:
        for col in ("image", "key", "caption"):
            assert not r[col].startswith(("=", "+", "-", "@")), r[col]
    assert (
        table[0]["image"] == '\'=HYPERLINK("http://x","y").jpg' and table[1]["score"] == "-1.5"
    )  # numbers stay numbers


# ---- inputs --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("encoding", ["utf-8-sig", "utf-16", "utf-8"])
def test_file_list_saved_with_a_byte_order_mark(tmp_path: Path, encoding: str) -> None:
    from extractors.inputs import items_from_file_list
    from pipeline.core.fileio import read_json

    for name in ("first.jpg", "second.jpg"):
        photo(tmp_path / name)
    lst = tmp_path / "list.txt"
    lst.write_bytes("first.jpg\r\nsecond.jpg\r\n".encode(encoding))
    items = items_from_file_list(lst)
    assert [(it.key, it.problem) for it in items] == [("first.jpg", None), ("second.jpg", None)]
    ids = tmp_path / "ids.json"
    ids.write_bytes(json.dumps({"first.jpg": 1}).encode("utf-8-sig"))
    assert read_json(ids) == {"first.jpg": 1}


def test_glob_over_folders_with_repeated_names_keys_by_relative_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from extractors.inputs import items_from_paths

    for day in ("day1", "day2", "day3"):
        photo(tmp_path / "trip" / day / "IMG_0001.JPG")
    monkeypatch.chdir(tmp_path)
    items = items_from_paths(["trip/*/IMG_0001.JPG"])
    assert sorted(it.key for it in items) == ["day1/IMG_0001.JPG", "day2/IMG_0001.JPG", "day3/IMG_0001.JPG"]
    assert [it.key for it in items_from_paths(["trip/day1/*.JPG"])] == ["IMG_0001.JPG"]  # one level: keys unchanged
    both = items_from_paths(["trip/day1", "trip/day2"])  # two folders, one name: keyed by the path they share
    assert sorted(it.key for it in both) == ["day1/IMG_0001.JPG", "day2/IMG_0001.JPG"]


# ---- failed writes -------------------------------------------------------------------------------------------
def test_a_failed_append_names_the_file_and_leaves_no_torn_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pipeline.captioning import journal as jmod

    out, fail = tmp_path / "out.jsonl", tmp_path / "out.failures.jsonl"
    j = jmod.Journal({"results": out, "failures": fail}, {"m": 1})
    j.append({"results": [{"key": "a.jpg", "caption": "a cat"}], "failures": []})
    committed = out.read_bytes()
    real_write = os.write

    def too_large(fd: int, data) -> int:  # half the batch lands, then the file-size limit
        real_write(fd, bytes(data[: len(data) // 2]))
        raise OSError(errno.EFBIG, "File too large")

    monkeypatch.setattr(jmod.os, "write", too_large)
    with pytest.raises(OSError) as info:
        j.append({"results": [{"key": "b.jpg", "caption": "a dog on the grass"}], "failures": []})
    line = os_error_message(info.value)
    assert str(out) in line and "append captions to" in line and "File too large" in line, line
    assert out.read_bytes() == committed  # the torn half line is cut off at once, not left for a rerun
    monkeypatch.setattr(jmod.os, "write", real_write)
    j.close()
    again = jmod.Journal({"results": out, "failures": fail}, {"m": 1})
    assert again.done == {"a.jpg"} and [r["key"] for r in again.read("results")] == ["a.jpg"]
    again.close()


def test_a_torn_last_line_is_cut_on_the_next_open(tmp_path: Path) -> None:
    from pipeline.captioning.journal import Journal

    out, fail = tmp_path / "out.jsonl", tmp_path / "out.failures.jsonl"
    j = Journal({"results": out, "failures": fail}, {"m": 1})
    j.append({"results": [{"key": "a.jpg", "caption": "a cat"}], "failures": []})
    j.close()
    with out.open("ab") as fh:
        fh.write(b'{"key": "b.jpg", "capt')  # a killed run's torn line
    j = Journal({"results": out, "failures": fail}, {"m": 1})
    assert out.read_text().count("\n") == 1 and strict_loads(out.read_text())["key"] == "a.jpg"
    j.close()
