"""Settings defaults are written once: the YAML section is the source, the dataclass reads it
(:func:`pipeline.core.config.defaults_from`), and a key on one side only fails when the class is defined."""

from __future__ import annotations

from dataclasses import MISSING, dataclass, fields
from pathlib import Path

import pytest

from models.decoding import DecodeOptions
from pipeline.core.config import CONFIG_DIR, defaults_from, load_yaml_with_bases
from pipeline.core.errors import ConfigError
from pipeline.serving.settings import ServeSettings, settings_from


def _defaults(cls: type) -> dict:
    return {f.name: f.default for f in fields(cls) if f.default is not MISSING}


def test_decode_options_defaults_are_the_decoding_yaml() -> None:
    section = load_yaml_with_bases(CONFIG_DIR / "decoding.yaml")["decoding"]
    assert _defaults(DecodeOptions) == section
    assert DecodeOptions() == DecodeOptions.from_mapping(section)
    assert (DecodeOptions().method, DecodeOptions().beam_size, DecodeOptions().max_len) == ("beam", 3, 20)


def test_serve_settings_defaults_are_the_serve_yaml(monkeypatch: pytest.MonkeyPatch) -> None:
    section = load_yaml_with_bases(CONFIG_DIR / "serve.yaml")["serve"]
    assert {k: v for k, v in _defaults(ServeSettings).items() if k != "token"} == section
    monkeypatch.delenv(section["token_env"], raising=False)
    assert settings_from(section) == ServeSettings()
    assert (ServeSettings().port, ServeSettings().max_beam_size, ServeSettings().token) == (8000, 5, None)


def _yaml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "s.yaml"
    path.write_text(text)
    return path


def test_a_changed_yaml_changes_the_defaults(tmp_path: Path) -> None:
    path = _yaml(tmp_path, "s:\n  size: 7\n  name: wide\n")

    @dataclass(frozen=True)
    @defaults_from(path, "s")
    class Settings:
        size: int
        name: str
        secret: str | None = None

    assert Settings() == Settings(size=7, name="wide", secret=None)
    assert Settings(size=2).size == 2


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("s:\n  size: 7\n  name: a\n  colour: red\n", "keys without a field ['colour']"),
        ("s:\n  size: 7\n", "fields without a default ['name']"),
        ("t:\n  size: 7\n", "no 's:' mapping"),
    ],
)
def test_a_key_on_one_side_only_is_refused_naming_the_file(tmp_path: Path, text: str, words: str) -> None:
    path = _yaml(tmp_path, text)
    with pytest.raises(ConfigError) as err:

        @defaults_from(path, "s")
        class Settings:
            size: int
            name: str

    assert str(path) in str(err.value) and words in str(err.value)
