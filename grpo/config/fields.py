"""How every config of the project declares its fields: `opt(default, doc)`, a dataclass field
with its documentation attached (the run's config, and those of `grpo sft`, `eval`, `rm`,
`demo` and `vllm-serve`; the command-line flags take their help and default from it), and
the walks over such dataclasses that the rest of `grpo.config` shares."""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import field
from typing import Any


# `opt(REQUIRED, doc)`: a field the caller must give (it has no default).
REQUIRED: Any = dataclasses.MISSING


def opt(default: Any, doc: str, *, key: str | None = None, **kw) -> Any:
    """A dataclass field with its documentation attached: every config of the project (the
    run's, and those of `grpo sft`, `eval`, `rm` and `demo`) declares its fields so, one
    docstring per field; the command-line flags take their help and default from it. `key`:
    the field's name in YAML and --set where it cannot be its Python name (a keyword)."""
    metadata = {"doc": doc, **({"key": key} if key else {})}
    if default is REQUIRED:
        return field(metadata=metadata, **kw)
    if isinstance(default, (list, dict)) or dataclasses.is_dataclass(default):
        return field(default_factory=lambda: copy.deepcopy(default), metadata=metadata, **kw)
    return field(default=default, metadata=metadata, **kw)


def key_of(f: dataclasses.Field) -> str:
    """A field's config key: its Python name, or the `key` it was declared with (`opt`)."""
    return f.metadata.get("key", f.name)


def as_tree(value: Any) -> Any:
    """A config (or any part of one) as nested dicts and lists under its config keys, as
    `dataclasses.asdict` but keyed by `key_of` (functions and classes kept as they are)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {key_of(f): as_tree(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return type(value)(as_tree(v) for v in value)
    if isinstance(value, dict):
        return {k: as_tree(v) for k, v in value.items()}
    return copy.deepcopy(value)


def field_default(f: dataclasses.Field) -> Any:
    """A field's default (a fresh copy of a mutable one), or REQUIRED when it has none."""
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


class Frozen:
    """A config section that refuses changes once its config is validated (`freeze`): what a
    run decides from it is a value returned by what decides it, never written back."""

    def __setattr__(self, name: str, value: Any) -> None:
        if self.__dict__.get("_frozen", False):
            raise dataclasses.FrozenInstanceError(
                f"cannot set {type(self).__name__}.{name}: a validated config is read-only "
                "(build another with config_from_dict and overrides, or dataclasses.replace)"
            )
        object.__setattr__(self, name, value)


def freeze(value: Any) -> Any:
    """`value` with every config section in it read-only (what validation ends with)."""
    if isinstance(value, Frozen):
        for f in dataclasses.fields(value):
            freeze(getattr(value, f.name))
        object.__setattr__(value, "_frozen", True)
    elif isinstance(value, (list, tuple)):
        for v in value:
            freeze(v)
    elif isinstance(value, dict):
        for v in value.values():
            freeze(v)
    return value
