"""CLI flags generated from `Settings`: one `--kebab-case` flag per field, its description as the help.

A flag left out is absent from the parsed namespace (`argparse.SUPPRESS`), so it never hides the
environment or the config file, and a flag given before the subcommand (`chatcore --data-dir X serve`)
survives the subcommand's parser.
"""

from __future__ import annotations

import argparse
import json
import types
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic.fields import FieldInfo

from chatcore.config import Settings


def add_settings_flags(parser: argparse.ArgumentParser, names: Iterable[str] | None = None) -> None:
    """Add a flag for each of `names` (default: every field) to `parser`."""
    for name in names if names is not None else Settings.model_fields:
        field = Settings.model_fields[name]
        parser.add_argument("--" + name.replace("_", "-"), dest=name, default=argparse.SUPPRESS,
                            help=_help(name, field), **_kind(field.annotation))


def _help(name: str, field: FieldInfo) -> str:
    default = field.get_default(call_default_factory=True)
    shown = "unset" if default is None else json.dumps(default) if isinstance(default, list) else default
    text = f"{field.description or ''} (CHATCORE_{name.upper()}; default: {shown})".lstrip()
    return text.replace("%", "%%")  # argparse formats help with %


def _kind(annotation: Any) -> dict[str, Any]:
    """`add_argument` keywords for a field's type: bool as --x/--no-x, Literal as choices, a number or a word."""
    options = [_plain(a) for a in _union(annotation) if a is not type(None)]
    words = [w for option in options if get_origin(option) is Literal for w in get_args(option)]
    others = [option for option in options if get_origin(option) is not Literal]
    if others == [bool]:
        return {"action": argparse.BooleanOptionalAction}
    if not others:
        return {"choices": words}
    if len(others) != 1:
        raise TypeError(f"no flag type for {annotation!r}")
    parse = _parser(others[0])
    return {"type": _or_words(parse, words) if words else parse, "metavar": _metavar(others[0], words)}


def _union(annotation: Any) -> tuple[Any, ...]:
    return get_args(annotation) if get_origin(annotation) in (Union, types.UnionType) else (annotation,)


def _plain(annotation: Any) -> Any:
    return get_args(annotation)[0] if get_origin(annotation) is Annotated else annotation


def _parser(kind: Any) -> Callable[[str], Any]:
    if kind in (int, float, str, Path):
        return kind
    if get_origin(kind) is list:
        return _string_list
    raise TypeError(f"no flag type for {kind!r}")


def _string_list(value: str) -> list[str]:
    """A JSON list, as in the environment, or comma-separated words."""
    if value.lstrip().startswith("["):
        try:
            items = json.loads(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a JSON list: {value!r}") from None
        if not isinstance(items, list) or not all(isinstance(item, str) for item in items):
            raise argparse.ArgumentTypeError(f"expected a JSON list of strings, not {value!r}")
        return items
    return [item.strip() for item in value.split(",") if item.strip()]


def _or_words(parse: Callable[[str], Any], words: list[str]) -> Callable[[str], Any]:
    def parse_or_word(value: str) -> Any:
        if value in words:
            return value
        try:
            return parse(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number or {' or '.join(words)}, not {value!r}") from None

    return parse_or_word


def _metavar(kind: Any, words: list[str]) -> str:
    name = {int: "N", float: "X", str: "TEXT", Path: "PATH"}.get(kind, "LIST")
    return "|".join([name, *words])
