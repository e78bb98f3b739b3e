"""Command-line flags made from config fields: each flag takes its help, default and type
from the field that `grpo.config.fields.opt` declared (one default and one docstring each), so
that a setting is written once, there. `grpo.cli` builds its parsers with these."""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any, Literal

from grpo.config.fields import REQUIRED, field_default


def fields(config: type) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(config)}


def flag_name(name: str) -> str:
    """A field's flag: --the-name."""
    return "--" + name.replace("_", "-")


def shown_default(value: Any) -> str:
    """A default as --help prints it; "" for none (None, False, REQUIRED: the doc says what then)."""
    if value is None or value is False or value is REQUIRED:
        return ""
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (list, tuple)):
        return ",".join(map(str, value))
    return str(value)


def field_help(config: type, name: str, shown: str | None = None) -> str:
    """The field's doc as a flag's help: its first word in lower case (unless a name such as
    LoRA), no final period, then "(default: ...)": the field's default, `shown`, or what a
    doc's last sentence "Default: ..." says (for a default of None)."""
    f = fields(config)[name]
    doc, _, said = f.metadata["doc"].removesuffix(".").partition(". Default: ")
    first = doc.split(" ", 1)[0]
    if first[1:].islower() or len(first) == 1:
        doc = first[0].lower() + doc[1:]
    shown = shown if shown is not None else said or shown_default(field_default(f))
    return (doc + (f" (default: {shown})" if shown else "")).replace("%", "%%")  # argparse formats help with %


def flag_kind(hint: Any) -> dict:
    """argparse's type or choices for a field's type hint (None dropped from an optional one);
    {} where the caller must say (a field of several types)."""
    optional = typing.get_origin(hint) in (typing.Union, types.UnionType)
    options = [a for a in typing.get_args(hint) if a is not type(None)] if optional else [hint]
    if len(options) != 1:
        return {}
    (one,) = options
    if typing.get_origin(one) is Literal:
        return {"choices": typing.get_args(one)}
    return {"type": one} if one in (int, float) else {}


def field_flag(
    parser, config: type, name: str, *flags: str, unset: bool = False, shown: str | None = None, **kwargs
) -> None:
    """Add the flag that sets field `name` of the config class `config`: `--the-name` (or
    `flags`), its value in args.<name>, its help, default and type from the field (`kwargs`
    override them: a stricter type, a metavar). A field without a default is a required flag.
    `unset`: the flag's own default is None, so that the command tells a flag given from one
    left out; the help still shows the field's default."""
    f = fields(config)[name]
    hint = typing.get_type_hints(config)[name]
    default = field_default(f)
    if hint is bool:
        kwargs.setdefault("action", "store_true")
    else:
        kwargs = {**flag_kind(hint), **kwargs}
    if unset:
        kwargs.setdefault("default", None)
    elif default is REQUIRED:
        kwargs.setdefault("required", True)
    else:
        kwargs.setdefault("default", default)
    parser.add_argument(*(flags or [flag_name(name)]), dest=name, help=field_help(config, name, shown), **kwargs)


def config_from(config: type, args: argparse.Namespace):
    """The config whose fields the parsed flags set; a flag left unset (None) leaves its
    field's default."""
    return config(**{name: getattr(args, name) for name in fields(config) if getattr(args, name, None) is not None})
