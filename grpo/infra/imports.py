"""Resolving what a user names by 'pkg.module:attr' (reward functions, tasks, answer extractors).

One importer for every plugin, so that each kind fails alike: a mistake (an unknown
built-in name, a module that is missing or crashes on import, a missing attribute, something
that is not callable) is a one-line UserError that starts with what was being resolved and
the spec as written, e.g. "reward 'mypkg:fn': module 'mypkg' has no attribute 'fn'".

Modules are imported from sys.path, with the working directory tried last: the `grpo`
console script puts its own bin directory on sys.path, not the working directory, so a
rewards.py next to the user's config would not be found otherwise. A module whose file
changed since a spec last imported it is read again (`_current`), as a new process would
read it: a second run in a notebook, the reward edited in between, runs the edit.
"""

from __future__ import annotations

import difflib
import importlib
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any

from grpo.errors import UserError

__all__ = ["builtin_spec", "describe", "import_callable", "import_object", "one_line", "spec_of"]

_DETAIL_CHARS = 200  # of an exception's text or a bad value, in an error message
_read: dict[str, tuple[int, int] | None] = {}  # module name -> its file's (mtime, size) when a spec last imported it


def one_line(text: str, limit: int = _DETAIL_CHARS) -> str:
    """`text` with its whitespace runs (newlines included) collapsed, cut to `limit` chars."""
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit] + "..."


def describe(exc: BaseException) -> str:
    """'ValueError: boom', on one line."""
    detail = one_line(str(exc))
    return f"{type(exc).__name__}: {detail}" if detail else type(exc).__name__


def builtin_spec(name: str, builtins: Mapping[str, str], *, kind: str, form: str) -> str:
    """The 'pkg.module:attr' spec a built-in `name` stands for (a name with no ':').

    An unknown name is a UserError that suggests the closest built-in and says that a
    spec of `form` (e.g. 'pkg.module:function') is the other way to name one.
    """
    if name in builtins:
        return builtins[name]
    close = difflib.get_close_matches(name, builtins, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise UserError(f"unknown {kind} {name!r}{hint} (built-ins: {', '.join(sorted(builtins))}; or give '{form}')")


def _import_module(spec: str, module_name: str, kind: str):
    cwd = os.getcwd()
    # Appended, not prepended, so that it never shadows an installed package.
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)
    try:
        return _current(module_name)
    except Exception as exc:
        # ImportError's text already says what is missing; anything else (a SyntaxError, a
        # crash while the module runs) needs its type to make sense.
        detail = one_line(str(exc)) if isinstance(exc, ImportError) else describe(exc)
        raise UserError(f"{kind} {spec!r}: cannot import module {module_name!r} ({detail})") from exc


def _current(module_name: str):
    """The module, imported; reloaded where its file changed since a spec last imported it
    (only the module named: those it imports are Python's to cache). A module imported first
    by someone else is taken as it is."""
    module = sys.modules.get(module_name)
    if module is not None and module_name in _read and _read[module_name] != _stamp(module):
        module = importlib.reload(module)
    else:
        module = importlib.import_module(module_name)
    _read[module_name] = _stamp(module)
    return module


def _stamp(module) -> tuple[int, int] | None:
    """(mtime in ns, size) of the module's file; None where it has none (a namespace package)."""
    try:
        stat = os.stat(module.__file__)
    except (AttributeError, TypeError, OSError):
        return None
    return stat.st_mtime_ns, stat.st_size


def import_object(spec: str, *, kind: str, form: str = "pkg.module:name") -> Any:
    """The object 'pkg.module:attr' names; attr may be dotted ('mod:Class.method').

    `kind` starts every error message ("reward", "task", ...); `form` is what a spec of
    this kind looks like, for the message about a malformed one.
    """
    if not isinstance(spec, str):
        raise UserError(f"{kind} {spec!r}: expected '{form}', got a {type(spec).__name__}")
    module_name, _, attr_path = spec.partition(":")
    if not module_name or not attr_path:
        raise UserError(f"{kind} {spec!r}: expected '{form}'")
    obj: Any = _import_module(spec, module_name, kind)
    owner = f"module {module_name!r}"
    walked: list[str] = []
    for part in attr_path.split("."):
        if not hasattr(obj, part):
            raise UserError(f"{kind} {spec!r}: {owner} has no attribute {part!r}")
        obj = getattr(obj, part)
        walked.append(part)
        owner = repr(f"{module_name}:{'.'.join(walked)}")
    return obj


def import_callable(spec: str, *, kind: str, form: str = "pkg.module:function") -> Callable[..., Any]:
    """`import_object`, checked to name a function, a method or an instance with __call__."""
    obj = import_object(spec, kind=kind, form=form)
    attr_path = spec.partition(":")[2]
    # A class is callable, but calling it builds an instance instead of doing the work.
    if isinstance(obj, type):
        raise UserError(
            f"{kind} {spec!r}: {attr_path!r} is a class; name a function, a method or an instance with __call__"
        )
    if not callable(obj):
        raise UserError(f"{kind} {spec!r}: {attr_path!r} is not callable (it is a {type(obj).__name__})")
    return obj


def spec_of(spec) -> str:
    """How user code is named: a spec as written; an object given directly (from Python) as
    'module:qualname' (what a worker process would import, and what config.yaml records)."""
    if isinstance(spec, str):
        return spec
    return f"{getattr(spec, '__module__', '?')}:{getattr(spec, '__qualname__', type(spec).__name__)}"
