"""One grammar for every command: each option name and short flag has one meaning (docs/cli.md).

:data:`MEANINGS` is the one place where a long option name gets its meaning and its short flag; every command's
options must be listed there with the same short flag (tests/test_cli_grammar.py), so ``-m`` is the captioner in
every command that has it and never anything else. :class:`GrammarCommand` refuses an old spelling of an option
(:data:`pipeline.core.renamed.RENAMED_OPTIONS`) in one line before the options are parsed. :func:`options_table`
renders the tables of docs/cli.md from the Typer app and :func:`write_table` rewrites them there::

    python -c "import typer, cli; from pathlib import Path; from pipeline.commands.grammar import write_table; \\
               write_table(Path('docs/cli.md'), typer.main.get_command(cli.app))"
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from typer._click.exceptions import NoArgsIsHelpError
from typer._click.exceptions import UsageError as ClickUsageError
from typer.core import TyperCommand, TyperGroup

from pipeline.commands.common import fail
from pipeline.core.renamed import renamed_option_line

#: the default run directory: where `demo`, `prepare`, `train` and `train-encoder` write (--out), and what
#: `evaluate`, `caption` and `serve` read (--model), so the stages chain without options
DEFAULT_RUN = Path("runs/demo")


@dataclass(frozen=True)
class Meaning:
    """What one long option name means in every command that offers it, and its short flag (if any)."""

    short: str | None
    text: str
    flag: bool = False  # an on/off switch (no value)
    aliases: tuple[str, ...] = ()  # other long spellings accepted for the same option


MEANINGS: dict[str, Meaning] = {
    # common options (pipeline/commands/options.py)
    "--config": Meaning("-c", "YAML config file of the command's stage (default: configs/<stage>.yaml)"),
    "--set": Meaning("-s", "dotted config override KEY=VALUE, repeatable"),
    "--force": Meaning(
        None, "redo finished work instead of skipping or resuming it; write over an existing output file", flag=True
    ),
    "--verbose": Meaning("-v", "debug logging", flag=True),
    "--quiet": Meaning("-q", "warnings and errors only", flag=True),
    "--threads": Meaning(None, "torch CPU threads per process (also BUTD_THREADS)"),
    "--device": Meaning(None, "where the model runs: auto | cpu | cuda | cuda:N"),
    "--batch-size": Meaning(None, "images (or sentences) per step or forward pass"),
    "--precision": Meaning(None, "numeric precision of the model's arithmetic"),
    "--num-workers": Meaning(None, "data-loading processes (0: in the main process)", aliases=("--workers",)),
    # decoding (pipeline/commands/decoding_opts.py)
    "--beam-size": Meaning(None, "beam size of caption decoding"),
    "--n-best": Meaning(None, "captions returned per image"),
    "--max-len": Meaning(None, "most generated tokens per caption"),
    "--length-penalty": Meaning(None, "alpha of the beam search length penalty"),
    "--block-trigrams": Meaning(
        None, "forbid repeating a trigram within a caption", flag=True, aliases=("--no-block-trigrams",)
    ),
    "--stop-rule": Meaning(None, "when beam search stops"),
    # what the commands read and write
    "--model": Meaning(
        "-m",
        "the captioner: a checkpoint, run directory, released file or catalogue name, or an architecture name "
        "where one is built (train, info)",
    ),
    "--models": Meaning(None, "comma-separated captioner architecture names"),
    "--captioner": Meaning(None, "which trained captioner of a run directory"),
    "--vocab": Meaning(None, "a released captioner's vocabulary file"),
    "--weights": Meaning("-w", "the detector: a weights file, a catalogue name or hf: id, or `random`"),
    "--list": Meaning(None, "print the catalogue of public weights and data", flag=True),
    "--releases": Meaning(None, "list the detector releases, presets and recipes", flag=True),
    "--out": Meaning("-o", "the run directory the command writes its stages into"),
    "--output": Meaning(None, "the file the command writes its results to"),
    "--format": Meaning("-f", "format of the file the command reads or writes"),
    "--store": Meaning(None, "a feature store (directory or .h5 file)"),
    "--data": Meaning(None, "a prepared captions folder (RUN/data)"),
    "--cache": Meaning(None, "a feature store reused and extended while captioning"),
    "--file-list": Meaning(None, "a text file with one image path per line"),
    "--image-ids": Meaning(None, "JSON mapping image file names to COCO image ids"),
    "--image-root": Meaning(None, "the folder that relative image paths are read from"),
    "--images": Meaning(None, "the image folder of an annotations file"),
    "--coco": Meaning(None, "a COCO annotations file whose images (and boxes) are read"),
    "--annotations": Meaning("-a", "a COCO instances file to score against"),
    "--gallery": Meaning(None, "a folder to write an HTML gallery into"),
    "--visualize": Meaning(None, "where to draw what the model attends to (PNG pictures)"),
    "--predictions": Meaning("-p", "a COCO results file of generated captions"),
    "--references": Meaning("-r", "a COCO captions file of reference captions"),
    "--metrics": Meaning("-e", "comma-separated caption metrics to compute"),
    "--split": Meaning(None, "a split of the prepared captions (train | val | test)"),
    "--retrieval": Meaning(None, "a sentence-encoder checkpoint for caption <-> image retrieval"),
    "--checkpoint": Meaning("-k", "a sentence-encoder checkpoint"),
    "--input": Meaning("-i", "the file of sentences to embed"),
    "--json": Meaning(None, "print the result as JSON", flag=True),
    "--boxes": Meaning(None, "how many regions the detector keeps per image"),
    "--preset": Meaning(None, "the detector architecture (an extractor preset)"),
    "--recipe": Meaning(None, "the test-time recipe of a public release"),
    "--release": Meaning(None, "the release (test-time recipe) imported features came from"),
    "--shard": Meaning(None, "i/n: this process's share of the images"),
    "--limit": Meaning(None, "only the first N images"),
    "--strict": Meaning(None, "exit 1 when any image failed", flag=True),
    "--merge-shards": Meaning(None, "merge finished shards into the store", flag=True),
    "--dtype": Meaning(None, "float type of the stored features"),
    "--identity": Meaning(None, "a JSON file with the extractor identity"),
    "--keys": Meaning(None, "how image ids of a feature file become store keys"),
    "--sizes": Meaning(None, "a COCO file with each image's width and height"),
    "--skip-bad": Meaning(None, "skip and report bad rows instead of stopping", flag=True),
    "--fc": Meaning(None, "a folder of per-image pooled vectors imported with the features"),
    "--commit-every": Meaning(None, "commit the store every N images"),
    "--expect": Meaning(None, "a text file of image ids that must be present"),
    "--verify": Meaning(None, "read every row of a feature store and check its checksums", flag=True),
    "--host": Meaning(None, "the address the server listens on"),
    "--port": Meaning("-P", "the TCP port the server listens on"),
    "--token": Meaning(None, "the bearer token clients must send"),
    "--world": Meaning(None, "a synthetic world folder"),
    "--reinit-heads": Meaning(None, "new class and attribute heads for another label set", flag=True),
    "--generate-only": Meaning(None, "only write the synthetic world", flag=True),
    "--num-images": Meaning(None, "images in the synthetic world"),
    "--seed": Meaning(None, "seed of the synthetic world"),
    "--seeds": Meaning(None, "training seeds per captioner"),
    "--quick": Meaning(None, "reduced sizes, the same code path", flag=True),
    "--features": Meaning(None, "comma-separated feature kinds: region, grid, oracle, clip"),
}


class GrammarCommand(TyperCommand):
    """A command whose command-line mistakes are one ``error:`` line and exit 2, as every other user mistake: an
    old spelling of an option (refused before parsing, naming the new one), an unknown option, a missing required
    option or argument, a value of the wrong type."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        line = renamed_option_line(self.name or "", list(args))
        if line is not None and not ctx.resilient_parsing:
            fail(line)
        try:
            return super().parse_args(ctx, args)
        except ClickUsageError as exc:
            if ctx.resilient_parsing:
                raise
            fail(f"{self.name}: {exc.format_message()} (see `{ctx.command_path} --help`)")
            raise  # unreachable: fail() exits


class GrammarGroup(TyperGroup):
    """The command group (``cli.py`` itself): a mistake before the command runs (an unknown command, an unknown
    global option, a global option without its value, no command at all after global options) is one ``error:``
    line and exit 2, as a mistake in a command's own options is (:class:`GrammarCommand`)."""

    def _refuse(self, ctx: Any, exc: ClickUsageError) -> None:
        if ctx.resilient_parsing or isinstance(exc, NoArgsIsHelpError):
            raise exc
        fail(f"{exc.format_message()} (see `{ctx.command_path} --help`)")

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, args)
        except ClickUsageError as exc:
            self._refuse(ctx, exc)
            raise  # unreachable: _refuse() exits or re-raises

    def resolve_command(self, ctx: Any, args: list[str]) -> Any:
        try:
            return super().resolve_command(ctx, args)
        except ClickUsageError as exc:
            self._refuse(ctx, exc)
            raise  # unreachable

    def invoke(self, ctx: Any) -> Any:
        if not ctx._protected_args and not self.invoke_without_command and not ctx.resilient_parsing:
            fail(f"missing command (see `{ctx.command_path} --help`)")
        return super().invoke(ctx)


@dataclass(frozen=True)
class OptionUse:
    """One option of one command, as the Typer app declares it."""

    command: str
    long: str
    names: tuple[str, ...]  # every spelling: long, aliases, short
    flag: bool
    required: bool
    choices: tuple[str, ...]
    help: str


def option_uses(group: Any) -> Iterator[OptionUse]:
    """Every option of every command of the click group built from the Typer app (``typer.main.get_command``)."""
    for name in sorted(group.commands):
        for param in group.commands[name].params:
            if param.param_type_name != "option":
                continue
            names = tuple(param.opts) + tuple(param.secondary_opts)
            long = next(n for n in param.opts if n.startswith("--"))
            choices = tuple(str(c) for c in (param.type_descriptor.choices or ()))
            flag = bool(getattr(param, "is_flag", False))
            yield OptionUse(name, long, names, flag, bool(param.required), choices, param.help or "")


def _arguments(command: Any) -> str:
    args = [p for p in command.params if p.param_type_name == "argument"]
    return " ".join(
        (p.name.upper() + ("..." if p.nargs == -1 else ""))
        if p.required
        else f"[{p.name.upper()}{'...' if p.nargs == -1 else ''}]"
        for p in args
    )


def options_table(group: Any) -> str:
    """The markdown tables of docs/cli.md: each command's arguments and required options, then each option name
    with its short flag, its one meaning (:data:`MEANINGS`) and the commands that offer it."""
    uses = list(option_uses(group))
    lines = ["| command | arguments | required options |", "|---|---|---|"]
    for name in sorted(group.commands):
        required = ", ".join(f"`{u.long}`" for u in uses if u.command == name and u.required)
        lines.append(f"| `{name}` | {_arguments(group.commands[name]) or '-'} | {required or '-'} |")
    lines += ["", "| option | short | value | meaning | commands |", "|---|---|---|---|---|"]
    for long in sorted({u.long for u in uses}):
        meaning = MEANINGS.get(long)
        of = [u for u in uses if u.long == long]
        value = "switch" if of[0].flag else "VALUE"
        spelled = ", ".join(f"`{n}`" for n in (long, *(meaning.aliases if meaning else ())))
        short = f"`{meaning.short}`" if meaning and meaning.short else "-"
        text = meaning.text if meaning else "(not in MEANINGS)"
        lines.append(f"| {spelled} | {short} | {value} | {text} | {', '.join(sorted({u.command for u in of}))} |")
    return "\n".join(lines)


TABLE_BEGIN, TABLE_END = "<!-- options table: begin -->", "<!-- options table: end -->"


def write_table(doc: Path, group: Any) -> None:
    """Replace the generated part of ``doc`` (between :data:`TABLE_BEGIN` and :data:`TABLE_END`)."""
    text = doc.read_text(encoding="utf-8")
    head, _, rest = text.partition(TABLE_BEGIN)
    _, _, tail = rest.partition(TABLE_END)
    doc.write_text(f"{head}{TABLE_BEGIN}\n{options_table(group)}\n{TABLE_END}{tail}", encoding="utf-8")
