"""The options every command shares, declared once.

A command module declares only the options that are special to it; :func:`command` registers the function
with the root app, adds the common options it asks for and hands them over as one :class:`CommandOptions`::

    @command(app, "train", help="...", force=True,
             everyday=Everyday(device="train.device", batch_size=("train.xe.batch_size", "train.scst.batch_size")))
    def train_command(opts: CommandOptions, out: out_option("Run directory.") = DEFAULT_RUN) -> None:
        cfg = opts.resolve("train")            # configs/train.yaml + --config + --set + the everyday options

Common options (all commands): ``--config/-c``, ``--set/-s`` (repeatable), ``--verbose/-v``, ``--quiet/-q``,
``--threads`` (the thread policy of :mod:`pipeline.core.threads`, applied before the body runs);
on request ``--force``. The *everyday* options of a command that runs a model are ``--device``,
``--batch-size``, ``--precision`` and ``--num-workers``; :class:`Everyday` says which config keys each one sets
(a command may also read ``opts.device`` etc. itself). Logging is set up and errors become one ``error:``
line (:func:`pipeline.commands.common.guarded`) before the command body runs.

To add a common option: a field of :class:`CommandOptions`, an entry of ``_OPTIONS`` and, if it maps onto
config keys, a field of :class:`Everyday`.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from pipeline.commands import decoding_opts as d
from pipeline.commands.common import guarded, init, resolve_config
from pipeline.commands.decoding_opts import decoding_overrides
from pipeline.commands.grammar import GrammarCommand
from pipeline.core import threads as thread_policy
from pipeline.core.config import Config
from pipeline.core.errors import UsageError
from pipeline.core.precision import PRECISIONS

ConfigOpt = Annotated[
    Optional[Path],
    typer.Option("--config", "-c", help="YAML config (may use _base_); defaults to the stage's file in configs/."),
]
SetOpt = Annotated[
    Optional[list[str]],
    typer.Option("--set", "-s", help="Dotted override KEY=VALUE (value read as YAML), repeatable: --set train.lr=1e-4"),
]
ForceOpt = Annotated[bool, typer.Option("--force", help="Redo a stage that already finished.")]
VerboseOpt = Annotated[bool, typer.Option("--verbose", "-v", help="Debug logging.")]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="Warnings and errors only.")]
ThreadsOpt = Annotated[
    Optional[int],
    typer.Option(
        "--threads",
        show_default=False,
        help="Torch CPU threads per process (default: the cores this process may use, less its DataLoader workers; "
        "pipeline/core/threads.py). Also BUTD_THREADS.",
    ),
]
DeviceOpt = Annotated[Optional[str], typer.Option("--device", help="auto | cpu | cuda | cuda:N")]
BatchSizeOpt = Annotated[
    Optional[int], typer.Option("--batch-size", help="Batch size (images per step or forward pass).")
]


def precision_option(choices: Sequence[str] = PRECISIONS) -> Any:
    """A ``--precision`` option whose help lists the values the command accepts."""
    return Annotated[Optional[str], typer.Option("--precision", help=f"{' | '.join(choices)} (default: the config's)")]


NumWorkersOpt = Annotated[
    Optional[int], typer.Option("--num-workers", "--workers", help="Data-loading processes (0: in the main process).")
]


def out_option(help_text: str) -> Any:
    """The ``--out/-o`` option: the run directory the command writes into (docs/cli.md), with the command's help."""
    return Annotated[Path, typer.Option("--out", "-o", help=help_text)]


def output_option(help_text: str, required: bool = False) -> Any:
    """The ``--output`` option: the file the command writes its results to (no short flag: ``-o`` is ``--out``)."""
    if required:
        return Annotated[Path, typer.Option("--output", help=help_text, show_default=False)]
    return Annotated[Optional[Path], typer.Option("--output", help=help_text)]


Keys = str | Sequence[str]


def _keys(value: Keys | None) -> tuple[str, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, str) else tuple(value)


@dataclass(frozen=True)
class Everyday:
    """Which dotted config keys the everyday options set for one command (a tuple sets several keys).

    ``--precision`` takes the one vocabulary of :mod:`pipeline.core.precision` in every command; a value that
    cannot apply (fp16 where the detector runs, fp16 on a CPU) is refused where it is resolved, in one line.
    """

    device: Keys | None = None
    batch_size: Keys | None = None
    precision: Keys | None = None
    num_workers: Keys | None = None
    direct: tuple[str, ...] = ()  # everyday options the command reads from ``opts`` itself (no config key)

    @classmethod
    def section(cls, name: str) -> Everyday:
        """All four everyday options set the like-named keys of one config section (``name.device``, ...)."""
        return cls(
            device=f"{name}.device",
            batch_size=f"{name}.batch_size",
            precision=f"{name}.precision",
            num_workers=f"{name}.num_workers",
        )

    def offered(self) -> tuple[str, ...]:
        """The everyday options this command declares."""
        mapped = tuple(n for n in ("device", "batch_size", "precision", "num_workers") if getattr(self, n) is not None)
        return mapped + tuple(n for n in self.direct if n not in mapped)


@dataclass(frozen=True)
class CommandOptions:
    """The common options of one command invocation."""

    config: Path | None = None
    overrides: tuple[str, ...] = ()
    force: bool = False
    verbose: bool = False
    quiet: bool = False
    device: str | None = None
    batch_size: int | None = None
    precision: str | None = None
    num_workers: int | None = None
    threads: int | None = None
    everyday: Everyday = field(default_factory=Everyday)
    decoding: Mapping[str, Any] = field(
        default_factory=dict
    )  # the decoding flags given (name -> value), see DECODING_FLAGS

    def everyday_overrides(self) -> list[str]:
        """``KEY=VALUE`` overrides for the everyday options that were given (strings as JSON = YAML strings)."""
        out: list[str] = []
        if self.precision is not None and self.precision not in PRECISIONS:
            raise UsageError(f"--precision must be one of {', '.join(PRECISIONS)}, not {self.precision!r}")
        if self.batch_size is not None and self.batch_size < 1:
            raise UsageError(f"--batch-size must be 1 or more, not {self.batch_size}")
        if self.num_workers is not None and self.num_workers < 0:
            raise UsageError(f"--num-workers must be 0 (load in this process) or more, not {self.num_workers}")
        for name in ("device", "batch_size", "precision", "num_workers"):
            value = getattr(self, name)
            if value is None:
                continue
            for key in _keys(getattr(self.everyday, name)):
                out.append(f"{key}={json.dumps(value)}")
        return out

    def decoding_overrides(self) -> list[str]:
        """``decoding.KEY=VALUE`` for the decoding flags given (``--beam-size 5`` -> ``decoding.beam_size=5``): the
        last layer of :func:`models.decoding.captions.layered_decoding`, the same in every command that decodes."""
        if not self.decoding:
            return []

        return [f"decoding.{key}={json.dumps(value)}" for key, value in decoding_overrides(**self.decoding).items()]

    def resolve(self, stage: str, extra: Sequence[str] = (), first: Sequence[str] = (), show: bool = True) -> Config:
        """``configs/<stage>.yaml`` (or ``--config``) with ``first``, ``--set``, ``extra``, the everyday options and
        the decoding flags applied in that order (later wins)."""
        overrides = [*first, *self.overrides, *extra, *self.everyday_overrides(), *self.decoding_overrides()]
        return resolve_config(stage, self.config, overrides, show=show)


_OPTIONS: dict[str, tuple[str, Any, Any]] = {  # CommandOptions field -> (parameter name, annotation, default)
    "config": ("config", ConfigOpt, None),
    "overrides": ("set_", SetOpt, None),
    "force": ("force", ForceOpt, False),
    "device": ("device", DeviceOpt, None),
    "batch_size": ("batch_size", BatchSizeOpt, None),
    "precision": ("precision", precision_option(), None),
    "num_workers": ("num_workers", NumWorkersOpt, None),
    "verbose": ("verbose", VerboseOpt, False),
    "quiet": ("quiet", QuietOpt, False),
    "threads": ("threads", ThreadsOpt, None),
}


#: the decoding flags of the commands that decode captions (declared in :mod:`pipeline.commands.decoding_opts`)
DECODING_FLAGS = ("beam_size", "n_best", "max_len", "length_penalty", "block_trigrams", "stop_rule")


def _decoding_params() -> list[tuple[str, Any, Any]]:
    types = (d.BeamSizeOpt, d.NBestOpt, d.MaxLenOpt, d.LengthPenaltyOpt, d.TrigramOpt, d.StopRuleOpt)
    return [(name, ann, None) for name, ann in zip(DECODING_FLAGS, types)]


def help_from_doc(fn: Callable[..., Any], fields: Mapping[str, str] | None = None) -> str:
    """A command's help from its docstring: paragraphs re-joined into one line each (Typer's rich help keeps
    single line breaks), paragraphs indented by 4 spaces (examples) kept as they are; ``{name}`` is replaced by
    ``fields[name]`` (text generated at registration, e.g. from a registry)."""
    doc = inspect.getdoc(fn) or ""
    for name, text in (fields or {}).items():
        doc = doc.replace("{" + name + "}", text)
    paragraphs = doc.split("\n\n")
    return "\n\n".join(
        p if p.startswith("    ") else " ".join(line.strip() for line in p.splitlines()) for p in paragraphs
    )


def command(
    app: typer.Typer,
    name: str,
    *,
    help: str | None = None,
    config: bool = True,
    overrides: bool = True,
    force: bool = False,
    everyday: Everyday | None = None,
    decoding: bool = False,
    help_fields: Mapping[str, str] | None = None,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register ``fn(opts, **own_options)`` as command ``name`` with the common options added to its signature.

    The command's help is ``help`` or else ``fn``'s docstring (paragraphs; example lines indented by 4 spaces) with
    ``help_fields`` filled in (:func:`help_from_doc`).

    ``config``: offer ``--config``; ``overrides``: offer ``--set``; ``force``: offer ``--force``; ``everyday``: the
    everyday options and the config keys they set; ``decoding``: offer the decoding flags (``--beam-size``,
    ``--n-best``, ``--max-len``, ``--length-penalty``, ``--block-trigrams``, ``--stop-rule``), handed over as
    ``opts.decoding``. ``--threads``, ``--verbose`` and ``--quiet`` are always offered.
    """
    ev = everyday or Everyday()
    fields = (["config"] if config else []) + (["overrides"] if overrides else []) + (["force"] if force else [])
    fields += list(ev.offered()) + ["threads", "verbose", "quiet"]

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        own = [
            p.replace(kind=inspect.Parameter.KEYWORD_ONLY)
            for p in inspect.signature(fn, eval_str=True).parameters.values()
            if p.name != "opts"
        ]
        taken = {p.name for p in own}
        common = (_decoding_params() if decoding else []) + [_OPTIONS[f] for f in fields]
        clash = taken & {param for param, _, _ in common}
        if clash:
            raise TypeError(f"command {name}: {', '.join(sorted(clash))} is a common option; drop it from the function")
        params = own + [
            inspect.Parameter(param, inspect.Parameter.KEYWORD_ONLY, annotation=ann, default=default)
            for param, ann, default in common
        ]

        def body(**kwargs: Any) -> Any:
            values = {f: kwargs.pop(_OPTIONS[f][0]) for f in fields}
            values["overrides"] = tuple(values.get("overrides") or ())
            flags = {n: kwargs.pop(n) for n in (DECODING_FLAGS if decoding else ())}
            opts = CommandOptions(everyday=ev, decoding={k: v for k, v in flags.items() if v is not None}, **values)
            init(opts.verbose, opts.quiet)
            thread_policy.prepare_process(opts.threads)
            thread_policy.apply()  # torch's own default ignores cgroup quotas and torchrun's processes
            return fn(opts, **kwargs)

        body.__name__, body.__qualname__, body.__doc__ = fn.__name__, fn.__qualname__, fn.__doc__
        body.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
        body.__annotations__ = {p.name: p.annotation for p in params}
        app.command(name, cls=GrammarCommand, help=help if help is not None else help_from_doc(fn, help_fields))(
            guarded(body)
        )
        return fn

    return decorate
