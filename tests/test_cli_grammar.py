"""One CLI grammar (docs/cli.md): each option name and short flag has one meaning across the commands, old
spellings are refused in one line, every example of every ``--help`` parses against its command and the config
schema, the help lists the registries' own choices (``info --releases`` the detector releases, presets and recipes,
which help reads without loading torchvision), and the stages chain through the default run directory."""

from __future__ import annotations

import functools
import json
import shlex
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest
import typer
from PIL import Image

import extractors
import models
from cli import app
from extractors.recipes import default_recipes
from extractors.releases import available_releases
from pipeline.commands.grammar import DEFAULT_RUN, MEANINGS, TABLE_BEGIN, TABLE_END, option_uses, options_table
from pipeline.core.config import load_config
from pipeline.core.renamed import RENAMED_OPTIONS

REPO = Path(__file__).resolve().parent.parent
GROUP = typer.main.get_command(app)
#: the config stage each command resolves (``opts.resolve(STAGE)``), for checking the --set keys of its examples
STAGES = {
    "caption": "caption",
    "serve": "serve",
    "evaluate": "evaluate",
    "extract": "extract",
    "prepare": "prepare",
    "train": "train",
    "train-encoder": "embed",
    "embed": "embed",
    "train-detector": "train_detector",
    "eval-detector": "train_detector",
    "demo": "demo",
}


def _help(name: str) -> str:
    return GROUP.commands[name].help or ""


def test_each_long_option_and_short_flag_has_one_meaning() -> None:
    problems = []
    meaning_of_short: dict[str, set[str]] = defaultdict(set)
    for use in option_uses(GROUP):
        meaning = MEANINGS.get(use.long)
        if meaning is None:
            problems.append(f"{use.command} {use.long}: not declared in pipeline.commands.grammar.MEANINGS")
            continue
        expected = {use.long, *meaning.aliases, *([meaning.short] if meaning.short else [])}
        if set(use.names) != expected:
            problems.append(
                f"{use.command} {use.long}: spelled {sorted(use.names)}, the grammar says {sorted(expected)}"
            )
        if use.flag != meaning.flag:
            problems.append(
                f"{use.command} {use.long}: {'a switch' if use.flag else 'takes a value'}, unlike its meaning"
            )
        for name in use.names:
            if not name.startswith("--"):
                meaning_of_short[name].add(use.long)
    problems += [f"{short} means {sorted(longs)}" for short, longs in meaning_of_short.items() if len(longs) > 1]
    shorts = [m.short for m in MEANINGS.values() if m.short]
    problems += [f"{s} is the short flag of two options" for s in set(shorts) if shorts.count(s) > 1]
    assert problems == []
    # the grammar of the issue: the captioner, the detector, the run directory, a file, the evaluation flags
    assert (MEANINGS["--model"].short, MEANINGS["--weights"].short, MEANINGS["--out"].short) == ("-m", "-w", "-o")
    assert MEANINGS["--output"].short is None and {
        MEANINGS[n].short for n in ("--metrics", "--predictions", "--port")
    } == {"-e", "-p", "-P"}


def test_the_grammar_check_catches_a_second_meaning() -> None:
    """The check above on a planted clash: evaluate's --metrics spelled -m beside caption's --model/-m."""
    app = typer.Typer()
    from pipeline.commands.options import command

    @command(app, "one", config=False, overrides=False)
    def one(opts, model: str = typer.Option("x", "--model", "-m")) -> None:  # noqa: B008 - typer's declaration
        """One.

        Example:

            butd-caption one
        """

    @command(app, "two", config=False, overrides=False)
    def two(opts, metrics: str = typer.Option("x", "--metrics", "-m")) -> None:  # noqa: B008
        """Two.

        Example:

            butd-caption two
        """

    uses = [u for u in option_uses(typer.main.get_command(app)) if "-m" in u.names]
    assert {u.long for u in uses} == {"--model", "--metrics"}
    assert any(set(u.names) != {u.long, MEANINGS[u.long].short} for u in uses)


def test_docs_cli_md_holds_the_generated_table() -> None:
    text = (REPO / "docs" / "cli.md").read_text(encoding="utf-8")
    between = text.partition(TABLE_BEGIN)[2].partition(TABLE_END)[0].strip()
    assert between == options_table(GROUP), (
        'docs/cli.md is out of step with the commands: python -c "import typer, cli; from pathlib import Path; '
        "from pipeline.commands.grammar import write_table; "
        "write_table(Path('docs/cli.md'), typer.main.get_command(cli.app))\""
    )
    assert "(not in MEANINGS)" not in between


def _examples() -> list[tuple[str, str]]:
    """``(command whose help shows it, example line)`` for every ``butd-caption ...`` / ``cli.py ...`` example."""
    out = []
    for name in sorted(GROUP.commands):
        for line in _help(name).splitlines():
            line = line.strip()
            if line.startswith("butd-caption ") or " cli.py " in f" {line}":
                out.append((name, line))
    return out


def _example_args(line: str) -> list[str]:
    tokens = shlex.split(line.split("   (")[0])  # a trailing "(comment)" is prose
    start = tokens.index("cli.py") if "cli.py" in tokens else tokens.index("butd-caption")
    return tokens[start + 1 :]


def _check_example(args: list[str]) -> str | None:
    """None if ``args`` (command and options) parse against the command and its --set keys against the schema."""
    name, rest = args[0], args[1:]
    if name not in GROUP.commands:
        return f"no command {name!r}"
    command = GROUP.commands[name]
    try:
        ctx = command.make_context(name, list(rest))
    except (typer.Exit, SystemExit, Exception) as exc:  # GrammarCommand turns a parse error into fail() -> Exit(2)
        return f"does not parse ({type(exc).__name__}: {exc})"
    params = ctx.params
    sets = list(params.get("set_") or [])
    config = params.get("config")
    if config is not None and not (REPO / config).is_file():
        return f"config file {config} not found"
    try:
        if name == "info" and params.get("model"):
            models.model_config(params["model"], sets)
        elif sets or config is not None:
            load_config(STAGES[name], REPO / config if config is not None else None, sets)
    except Exception as exc:  # a key or value the schema refuses
        return f"--set/--config refused: {exc}"
    return None


def test_every_help_example_parses_against_its_command_and_the_schema() -> None:
    examples = _examples()
    assert len(examples) >= 30 and {n for n, _ in examples} >= set(GROUP.commands) - {"info"} | {"info"}
    failures = [
        f"{name} help: {line}: {problem}"
        for name, line in examples
        if (problem := _check_example(_example_args(line))) is not None
    ]
    assert failures == []


@pytest.mark.parametrize(
    "args,problem",
    [
        (
            ["caption", "photo.jpg", "-o", "x.jsonl"],
            "does not parse",
        ),  # -o is the run directory, caption writes --output
        (["evaluate", "--metrics", "bleu", "--nope"], "does not parse"),
        (["embed", "--input", "s.txt"], "does not parse"),  # --checkpoint and --output are required
        (["train", "--set", "train.nope=1"], "refused"),
        (["demo", "--config", "configs/none.yaml"], "not found"),
    ],
)
def test_the_example_check_catches_bad_examples(args: list[str], problem: str) -> None:
    found = _check_example(args)
    assert found is not None and problem in found


@pytest.mark.parametrize("command,old", [(c, o) for c, spellings in RENAMED_OPTIONS.items() for o in spellings])
def test_an_old_spelling_is_refused_naming_the_new_one(cli, command: str, old: str, tmp_path: Path) -> None:
    args = {
        "convert-captioner": [str(tmp_path / "m.pth")],
        "export-features": [str(tmp_path / "s")],
        "merge-features": [str(tmp_path / "a")],
    }.get(command, [])
    res = cli.invoke(command, *args, old, str(tmp_path / "x"), env={"COLUMNS": "300"})
    errors = [ln for ln in res.output.splitlines() if ln.strip()]
    assert res.exit_code == 2 and len(errors) == 1, res.output
    new = RENAMED_OPTIONS[command][old].split()[0]
    assert errors[0].startswith(f"error: {command} {old} was renamed: use {new}")
    assert not (tmp_path / "x").exists()


def test_parse_errors_are_one_line(cli) -> None:
    for args, text in (
        (["embed"], "Missing option '--checkpoint'"),
        (["caption", "--nope"], "No such option: --nope"),
        (["serve", "-P", "many"], "Invalid value for '--port'"),
        (["evaluate", "-m", "bleu,cider"], "give the metrics with --metrics/-e bleu,cider"),
    ):
        res = cli(*args, timeout=120)
        lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
        assert res.returncode == 2 and len(lines) == 1 and lines[0].startswith("error:") and text in lines[0], (
            res.stderr
        )


def test_help_lists_the_registries_own_choices() -> None:
    """Captioners and metrics are named in the help; presets, recipes and releases are named by ``info
    --releases`` (listing them loads torchvision), which the help of their options points to."""
    from pipeline.metrics.coco import METRICS

    helps = {u.command + " " + u.long: " ".join(u.help.split()) for u in option_uses(GROUP)}
    assert all(
        name in helps["train --model"] and name in helps["info --model"] for name in models.available_captioners()
    )
    assert all(name in helps["evaluate --metrics"] for name in METRICS)
    for option in ("extract --preset", "extract --recipe", "import-features --release"):
        assert "butd-caption info --releases" in helps[option], option


def test_info_releases_lists_every_release_preset_and_recipe(cli) -> None:
    res = cli.invoke("info", "--releases")
    assert res.exit_code == 0, res.output
    lines = res.stdout.splitlines()
    releases = available_releases()
    assert len(lines) == len(releases) + 2
    for release, line in zip(releases, lines):
        head, _, rest = line.partition(": ")
        assert head == f"release {release.name}"
        fields = dict(part.split(" ", 1) for part in rest.split("; ", 6))
        assert fields["layouts"].split(", ") == list(release.weights_layouts or ["-"])
        assert fields["recipe"].split(" ", 1)[0] == release.recipe_name
        assert fields["preset"] == (release.preset or "-") and fields["source"] == release.source
        assert set(release.catalogue) <= set(fields["catalogue"].split(", "))
        assert fields["formats"].split(", ") == list(release.import_formats or ["-"])
    assert lines[-2] == f"presets: {', '.join(extractors.available_extractors())}"
    recipes = lines[-1].removeprefix("recipes: ").split(", ")
    assert set(recipes) == set(default_recipes()) | {r for release in releases for r in release.recipes}
    assert {"caffe", "vinvl", "grid-feats", "clip-vil", "clip"} <= set(recipes)
    clip = next(line for line in lines if line.startswith("release clip-vil: "))
    assert "layouts openai, open_clip, hf;" in clip and "recipe clip-vil (or clip);" in clip and "clip-rn50x4" in clip
    caffe = next(line for line in lines if line.startswith("release caffe: "))
    assert "; formats butd-tsv, obj36-tsv, cocobu, m2-hdf5; source peteanderson80/" in caffe


def test_info_releases_takes_no_target(cli) -> None:
    res = cli.invoke("info", "--releases", "runs/demo")
    errors = [line for line in res.stderr.splitlines() if line.strip()]
    assert res.exit_code == 2 and len(errors) == 1 and errors[0].startswith("error:") and "TARGET" in errors[0]
    assert res.stdout == ""


def test_unknown_preset_recipe_and_release_are_one_line_naming_the_known(cli, tmp_path: Path) -> None:
    Image.new("RGB", (64, 48)).save(tmp_path / "a.jpg")
    extract = ["extract", str(tmp_path / "a.jpg"), "--weights", "random", "--store", str(tmp_path / "s")]
    for args, known in (
        ([*extract, "--preset", "nosuch"], "bottom-up-caffe-r101"),
        ([*extract, "--recipe", "nosuch"], "grid-feats"),
        (
            ["import-features", str(tmp_path / "a.jpg"), "-f", "butd-tsv", "--store", str(tmp_path / "i")]
            + ["--release", "nosuch"],
            "clip-vil",
        ),
    ):
        res = cli.invoke(*args, "--device", "cpu") if args[0] == "extract" else cli.invoke(*args)
        errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
        assert res.exit_code == 2 and len(errors) == 1, (args, res.stderr)
        assert "'nosuch'" in errors[0] and "known:" in errors[0] and known in errors[0], errors[0]
    assert not (tmp_path / "s").exists()  # refused before the stage takes its folder


def test_help_does_not_import_torchvision(cli) -> None:
    """``cli --help`` and every command's help are read without loading torchvision or the extractor modules."""
    code = (
        "import json, sys, typer, cli; from typer.testing import CliRunner; "
        "names = list(typer.main.get_command(cli.app).commands); "
        "codes = [CliRunner().invoke(cli.app, [*n, '--help']).exit_code for n in [[], *([n] for n in names)]]; "
        "print(json.dumps([codes, [m for m in ('torchvision', 'extractors.bottom_up') if m in sys.modules]]))"
    )
    env = cli.environment(unset=["BUTD_PLUGINS"])
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    codes, loaded = json.loads(res.stdout.splitlines()[-1])
    assert len(codes) == len(GROUP.commands) + 1 and set(codes) == {0}
    assert loaded == []


def test_no_help_tells_the_history_of_the_project() -> None:
    import re

    words = re.compile(r"\b(issues?|previously|formerly|no longer|used to|as\s+before|renamed|later versions?)\b", re.I)
    texts = {name: _help(name) for name in GROUP.commands}
    texts.update({f"{u.command} {u.long}": u.help for u in option_uses(GROUP)})
    assert {k: words.findall(v) for k, v in texts.items() if words.search(v)} == {}


def test_required_options_are_marked_required() -> None:
    required = {(u.command, u.long) for u in option_uses(GROUP) if u.required}
    assert {
        ("embed", "--checkpoint"),
        ("embed", "--input"),
        ("embed", "--output"),
        ("convert-captioner", "--output"),
        ("export-features", "--output"),
        ("merge-features", "--store"),
        ("import-features", "--format"),
        ("import-features", "--store"),
        ("eval-detector", "--annotations"),
    } <= required


def test_each_stage_writes_where_the_next_reads() -> None:
    defaults = {(u.command, u.long): GROUP.commands[u.command].params for u in option_uses(GROUP)}
    value = {
        key: next(p.default for p in params if p.param_type_name == "option" and key[1] in p.opts)
        for key, params in defaults.items()
    }
    for name in ("demo", "prepare", "train", "train-encoder", "train-detector"):
        assert Path(value[(name, "--out")]) == DEFAULT_RUN, name
    assert Path(value[("caption", "--model")]) == DEFAULT_RUN and Path(value[("serve", "--model")]) == DEFAULT_RUN
    assert Path(value[("extract", "--store")]) == DEFAULT_RUN / "features" / "store"


def _karpathy(path: Path) -> Path:
    words = [
        "a red circle",
        "two blue squares",
        "a green square",
        "one red circle",
        "a big blue circle",
        "small squares",
    ]
    images = [
        {
            "cocoid": i,
            "filename": f"{i}.jpg",
            "split": ("train", "train", "train", "val", "test", "test")[i],
            "sentences": [{"tokens": w.split(), "raw": w} for w in (words[i], words[(i + 1) % 6])],
        }
        for i in range(6)
    ]
    path.write_text(json.dumps({"images": images}))
    return path


def test_prepare_train_evaluate_chain_through_the_default_run(cli, tmp_path: Path) -> None:
    """`prepare FILE` writes RUN/data of the default run directory, `train` reads that run (and asks for its
    features there), `evaluate` and `caption` read that run, all without an option."""

    run = functools.partial(cli, cwd=tmp_path, env={"COLUMNS": "300"})

    prepared = run("prepare", str(_karpathy(tmp_path / "dataset.json")))
    assert prepared.returncode == 0, prepared.stderr
    manifest = json.loads((tmp_path / DEFAULT_RUN / "data" / "manifest.json").read_text())
    assert manifest["summary"]["images"] == 6
    trained = run("train", "--model", "san")
    assert trained.returncode == 2 and f"{DEFAULT_RUN / 'features' / 'store'} does not exist" in trained.stderr
    evaluated = run("evaluate")
    assert evaluated.returncode == 2 and f"{DEFAULT_RUN / 'features' / 'store'} not found" in evaluated.stderr
    Image.new("RGB", (32, 24), (200, 40, 40)).save(tmp_path / "photo.jpg")
    captioned = run("caption", "photo.jpg")
    assert captioned.returncode == 2 and f"{DEFAULT_RUN} holds no trained captioner" in captioned.stderr
    unknown = run("train", "--model", "nope")
    assert unknown.returncode == 2 and "unknown captioner 'nope'" in unknown.stderr and "san" in unknown.stderr
