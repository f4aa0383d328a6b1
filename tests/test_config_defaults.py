"""configs/default.toml and the app/config dataclasses state the same defaults, so the two cannot drift."""

from __future__ import annotations

import dataclasses
import re
import tomllib

from app.config import DEFAULT_CONFIG, Config, load_config


def _sections() -> dict[str, object]:
    return {f.name: getattr(Config(), f.name) for f in dataclasses.fields(Config)}


def _commented_keys(text: str) -> dict[str, set[str]]:
    """{section: keys written as `# key = ...`}: the fields whose default is None (TOML has no null)."""
    out: dict[str, set[str]] = {}
    section = ""
    for line in text.splitlines():
        if m := re.match(r"\[(\w+)\]", line):
            section = m.group(1)
        elif m := re.match(r"#\s*(\w+)\s*=", line):
            out.setdefault(section, set()).add(m.group(1))
    return out


def test_every_toml_key_equals_its_dataclass_default():
    toml = tomllib.loads(DEFAULT_CONFIG.read_text(encoding="utf-8"))
    sections = _sections()
    assert set(toml) == set(sections)
    for name, keys in toml.items():
        for key, value in keys.items():
            default = getattr(sections[name], key)
            value = tuple(value) if isinstance(value, list) else value
            assert (value, type(value)) == (default, type(default)), f"[{name}] {key}: {value!r} != {default!r}"


def test_every_dataclass_field_is_in_default_toml():
    text = DEFAULT_CONFIG.read_text(encoding="utf-8")
    toml, commented = tomllib.loads(text), _commented_keys(text)
    for name, section in _sections().items():
        for f in dataclasses.fields(section):
            if getattr(section, f.name) is None:  # unset = from the checkpoint: listed as a comment
                assert f.name in commented.get(name, set()), f"[{name}] {f.name} missing (as a comment)"
            else:
                assert f.name in toml[name], f"[{name}] {f.name} missing from default.toml"


def test_loading_default_toml_is_the_dataclass_tree():
    assert load_config() == Config()
