"""Prompt datasets for RL training: read the rows, check the prompts, stream them reproducibly.

`load_rows` turns `data.path` into plain dicts with every column kept (reward functions get
the others). The small formats (.jsonl, .json, .parquet, .csv) are read directly, so that an
error names the file and line; `datasets` is imported only for its directories and hub
names. Generated sources ('reasoning_gym:NAME?...') are registered in `SOURCES` by the spec
of the function that makes their rows, so that this module imports no task. `PromptStream`
hands the trainer its prompts, each epoch's order a function of (seed, epoch) alone: a
checkpoint stores two integers, and no global generator is touched.
"""

from __future__ import annotations

import csv
import importlib
import json
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from grpo.errors import UserError, first_line
from grpo.infra.imports import import_callable

__all__ = ["REASONING_GYM", "SOURCES", "is_reasoning_gym", "load_rows", "load_rows_for_options", "PromptStream"]

# A data path that starts with this names rows a reasoning-gym task generates.
REASONING_GYM = "reasoning_gym:"

# Data paths that name generated rows, not a file: prefix -> the spec of the function that
# makes them, `make_rows(path, *, prompt_column, task_options) -> list[dict]`, imported on use
# (as `grpo.rewards.BUILTIN_REWARDS` names its functions), so that data imports no task.
SOURCES: dict[str, str] = {REASONING_GYM: "grpo.tasks.reasoning_gym:make_rows"}

# A row and where it came from ("line 7", "row 3"), so that a check made after reading can
# still point at the culprit.
Located = tuple[str, dict]


def is_reasoning_gym(path: str) -> bool:
    """Whether a data path is a 'reasoning_gym:NAME?...' spec rather than a file or a dataset."""
    return isinstance(path, str) and path.startswith(REASONING_GYM)


def _generated_source(path: str) -> str | None:
    """The spec of the function that makes the rows `path` names (`SOURCES`), or None for a
    file, a directory or a `datasets` name."""
    if not isinstance(path, str):
        return None
    return next((spec for prefix, spec in SOURCES.items() if path.startswith(prefix)), None)


def load_rows(
    path: str, *, prompt_column: str = "prompt", split: str = "train", task_options: dict | None = None
) -> list[dict]:
    """Rows of a prompt dataset, each a dict of its columns.

    The format follows the file ending: .jsonl (one JSON object per line, blank lines
    skipped), .json (a list of objects, or an object with one list value such as
    {"data": [...]}), .parquet, .csv (values stay strings). An existing directory is a dataset
    saved with `datasets`' save_to_disk (a DatasetDict gives its `split`) or else a directory
    of data files for `datasets.load_dataset`. Anything else is a `datasets` name.

    Every row must hold `prompt_column`: a non-empty string (plain prompt) or a list of
    {"role": ..., "content": ...} messages (conversational prompt).

    'reasoning_gym:NAME?size=N&seed=S&...' has reasoning-gym's task NAME generate the rows
    (the prompt under `prompt_column`; see `grpo.tasks.reasoning_gym`), with `task_options`
    (the config's `data.task_options`) as the task's own options; other paths take none.
    """
    source = _generated_source(path)
    if source is not None:
        make_rows = import_callable(source, kind="data source", form="pkg.module:function")
        located = _numbered(make_rows(path, prompt_column=prompt_column, task_options=task_options))
    elif task_options:
        named = " or ".join(f"'{prefix}NAME'" for prefix in SOURCES)
        raise UserError(f"data.task_options: only a {named} data.path takes task options, not {path!r}")
    else:
        located = _read(path, split)
    if not located:
        raise UserError(f"data.path: {path} has no rows")
    _check_prompts(located, path, prompt_column)
    return [row for _, row in located]


def load_rows_for_options(
    path: str, *, prompt_column: str = "prompt", column_option: str = "--prompt-column"
) -> list[dict]:
    """`load_rows` for a command's options: its errors name `--data` and `column_option`
    where they would name the config keys data.path and data.prompt_column."""
    try:
        return load_rows(path, prompt_column=prompt_column)
    except UserError as err:
        text = str(err)
        for key, flag in (("data.path:", "--data:"), ("data.prompt_column:", f"{column_option}:")):
            if text.startswith(key):
                raise UserError(flag + text[len(key) :]) from None
        raise


# --- reading ---------------------------------------------------------------------------------


def _read(path: str, split: str) -> list[Located]:
    """Dispatch on what `path` is: a data file, a directory, or a `datasets` name."""
    if not path.strip():
        # Path("") is ".", which would quietly load the working directory.
        raise UserError("data.path: is empty")
    local = Path(path).expanduser()
    if local.is_dir():
        return _read_dataset_dir(local, path, split)
    reader = _FILE_READERS.get(local.suffix.lower())
    if reader is not None:
        # A data-file ending means the user meant a file: a typo must not become a hub lookup.
        if not local.is_file():
            raise UserError(f"data.path: no such file {path!r}")
        return reader(local, path)
    if local.exists():
        raise UserError(
            f"data.path: cannot read {path!r}: expected a .jsonl, .json, .parquet or .csv file, "
            "a dataset directory or a `datasets` name"
        )
    # Hub names never start with '/', '.' or '~', so these can only be missing local paths.
    if local.is_absolute() or path.startswith((".", "~")):
        raise UserError(f"data.path: no such file or directory {path!r}")
    return _read_hub(path, split)


def _read_text(path: Path, name: str) -> str:
    """The file as text; utf-8-sig drops the byte-order mark some editors write."""
    try:
        return path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as err:
        raise UserError(f"{name}: not UTF-8 text ({err.reason} at byte {err.start})") from err
    except OSError as err:
        raise UserError(f"data.path: cannot read {name!r} ({err.strerror})") from err


def _read_jsonl(path: Path, name: str) -> list[Located]:
    """One JSON object per line. Split on '\\n' only: a JSON string may hold U+2028."""
    rows = []
    for number, line in enumerate(_read_text(path, name).split("\n"), start=1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as err:
            raise UserError(f"{name} line {number}: invalid JSON ({err.msg})") from err
        if not isinstance(value, dict):
            raise UserError(f"{name} line {number}: expected a JSON object, got {_describe(value)}")
        rows.append((f"line {number}", value))
    return rows


def _read_json(path: Path, name: str) -> list[Located]:
    """A list of objects, or an object whose one list value is the rows (other keys: metadata)."""
    try:
        value = json.loads(_read_text(path, name))
    except json.JSONDecodeError as err:
        # "Extra data" after a first complete value is the mark of JSON Lines named .json.
        hint = "; for one object per line, name the file .jsonl" if err.msg == "Extra data" else ""
        raise UserError(f"{name} line {err.lineno}: invalid JSON ({err.msg}){hint}") from err
    if isinstance(value, dict):
        list_keys = [key for key, item in value.items() if isinstance(item, list)]
        if len(list_keys) != 1:
            found = ", ".join(list_keys) if list_keys else "none"
            raise UserError(
                f"{name}: expected a list of objects or an object with a single list value such "
                f'as {{"data": [...]}}, got an object with list values: {found}'
            )
        value = value[list_keys[0]]
    elif not isinstance(value, list):
        raise UserError(
            f"{name}: expected a list of objects or an object with a single list value such as "
            f'{{"data": [...]}}, got {_describe(value)}'
        )
    rows = []
    for number, item in enumerate(value, start=1):
        if not isinstance(item, dict):
            raise UserError(f"{name} row {number}: expected a JSON object, got {_describe(item)}")
        rows.append((f"row {number}", item))
    return rows


def _read_parquet(path: Path, name: str) -> list[Located]:
    """A Parquet table through pyarrow; lists of structs come back as lists of dicts."""
    pyarrow = _import_optional("pyarrow", f"reading {name!r}")
    parquet = _import_optional("pyarrow.parquet", f"reading {name!r}")
    try:
        table = parquet.read_table(path)
    except (pyarrow.ArrowException, OSError) as err:
        raise UserError(f"{name}: not a readable Parquet file ({first_line(err)})") from err
    return _numbered(table.to_pylist())


def _read_csv(path: Path, name: str) -> list[Located]:
    """A CSV file with a header row; values stay strings, as CSV carries no types.

    `strict=True` makes stray or unterminated quotes an error instead of a silently merged
    field; a row with more or fewer fields than the header is an error too.
    """
    rows = []
    try:
        with path.open(newline="", encoding="utf-8-sig") as file:
            reader = csv.DictReader(file, strict=True)
            for row in reader:
                # DictReader files surplus fields under the key None and fills missing ones
                # with None; a field read from the file is always a string.
                line = reader.reader.line_num
                surplus = row.pop(None, [])
                missing = sum(value is None for value in row.values())
                if surplus or missing:
                    header = len(reader.fieldnames)
                    raise UserError(
                        f"{name} line {line}: {header + len(surplus) - missing} fields, the header has {header}"
                    )
                rows.append((f"line {line}", row))
    except csv.Error as err:
        raise UserError(f"{name} line {reader.reader.line_num}: malformed CSV ({err})") from err
    except UnicodeDecodeError as err:
        raise UserError(f"{name}: not UTF-8 text ({err.reason} at byte {err.start})") from err
    except OSError as err:
        raise UserError(f"data.path: cannot read {name!r} ({err.strerror})") from err
    return rows


_FILE_READERS: dict[str, Callable[[Path, str], list[Located]]] = {
    ".jsonl": _read_jsonl,
    ".json": _read_json,
    ".parquet": _read_parquet,
    ".csv": _read_csv,
}


def _read_dataset_dir(path: Path, name: str, split: str) -> list[Located]:
    """A save_to_disk directory (it holds state.json or dataset_dict.json), else data files."""
    datasets = _import_optional("datasets", f"loading {name!r}")
    if not ((path / "state.json").is_file() or (path / "dataset_dict.json").is_file()):
        return _load_dataset(datasets, str(path), name, split)
    try:
        loaded = datasets.load_from_disk(str(path))
    except Exception as err:  # any failure inside `datasets` is the same one-line story
        raise UserError(f"data.path: cannot load dataset {name!r} ({first_line(err)})") from err
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            splits = ", ".join(loaded)
            raise UserError(f"data.path: {name} has no split {split!r} (splits: {splits})")
        loaded = loaded[split]
    return _numbered(loaded.to_list())


def _read_hub(name: str, split: str) -> list[Located]:
    """A `datasets` name; it needs a network (or a warm cache) to load."""
    datasets = _import_optional("datasets", f"loading dataset {name!r}")
    return _load_dataset(datasets, name, name, split)


def _load_dataset(datasets: ModuleType, target: str, name: str, split: str) -> list[Located]:
    """`datasets.load_dataset(target)`; errors quote `name`, what the user wrote."""
    try:
        loaded = datasets.load_dataset(target, split=split)
    except Exception as err:  # network, unknown name, unknown split, bad files: all one line
        raise UserError(f"data.path: cannot load dataset {name!r} ({first_line(err)})") from err
    return _numbered(loaded.to_list())


def _numbered(rows: list[dict]) -> list[Located]:
    return [(f"row {number}", row) for number, row in enumerate(rows, start=1)]


def _import_optional(module: str, purpose: str) -> ModuleType:
    """Import a module of the `data` extra, or say how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise UserError(
            f"data.path: {purpose} needs the {module.split('.')[0]} package: pip install 'grpo[data]'"
        ) from err


# --- checking --------------------------------------------------------------------------------


def _check_prompts(located: list[Located], name: str, prompt_column: str) -> None:
    """Every row holds a usable prompt; otherwise name the first row that does not."""
    if not any(prompt_column in row for _, row in located):
        columns = ", ".join(dict.fromkeys(key for _, row in located for key in row)) or "none"
        raise UserError(f"data.prompt_column: no column {prompt_column!r} in {name} (columns: {columns})")
    for where, row in located:
        if prompt_column not in row:
            raise UserError(
                f"data.prompt_column: no column {prompt_column!r} in {name} {where} "
                f"(columns: {', '.join(row) or 'none'})"
            )
        problem = _prompt_problem(row[prompt_column])
        if problem is not None:
            raise UserError(
                f"{name} {where}: {prompt_column!r} must be a non-empty string or a list of "
                f"{{role, content}} messages, {problem}"
            )


def _prompt_problem(prompt: Any) -> str | None:
    """What is wrong with a prompt value, or None if it is a usable plain or chat prompt."""
    if isinstance(prompt, str):
        return None if prompt.strip() else "got an empty string"
    if not isinstance(prompt, list):
        return f"got {_describe(prompt)}"
    if not prompt:
        return "got an empty list"
    for number, message in enumerate(prompt, start=1):
        if not isinstance(message, dict):
            return f"but message {number} is {_describe(message)}"
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                return f"but message {number} has no string {key!r}"
    return None


_KINDS = {
    dict: "an object",
    list: "a list",
    str: "a string",
    bool: "a boolean",
    int: "a number",
    float: "a number",
    type(None): "null",
}


def _describe(value: Any) -> str:
    """A value's kind in the user's (JSON) words, never its possibly long contents."""
    return _KINDS.get(type(value), type(value).__name__)


# --- streaming -------------------------------------------------------------------------------


class PromptStream:
    """An endless, reproducible stream of rows, one shuffled pass (epoch) after another.

    Epoch e's order is a permutation drawn from a private generator seeded with (seed, e):
    no row repeats within an epoch, the order changes between epochs, and the position
    (epoch, index within the epoch) is all a checkpoint needs to resume the exact sequence.
    With `shuffle=False` every epoch is the rows in their given order.
    """

    def __init__(self, rows: list[dict], *, seed: int, shuffle: bool = True) -> None:
        if not rows:
            raise ValueError("PromptStream needs at least one row")
        if seed < 0:
            raise ValueError(f"PromptStream seed must be non-negative, got {seed}")
        self._rows = list(rows)
        self._seed = seed
        self._shuffle = shuffle
        self._epoch = 0
        self._position = 0
        self._order = self._order_of(0)

    @property
    def epoch(self) -> int:
        """Completed passes over the rows so far."""
        return self._epoch

    def take(self, k: int) -> list[dict]:
        """The next k rows, crossing into following epochs as needed (k may exceed the rows).

        Each row is a shallow copy, so a caller that pops a column (as the trainer does to
        separate the prompt from the reward columns) cannot change what later epochs see.
        """
        if k < 0:
            raise ValueError(f"take needs k >= 0, got {k}")
        batch: list[dict] = []
        while len(batch) < k:
            end = min(len(self._rows), self._position + k - len(batch))
            batch.extend(dict(self._rows[i]) for i in self._order[self._position : end])
            self._position = end
            if self._position == len(self._rows):
                self._start_epoch(self._epoch + 1)
        return batch

    def state_dict(self) -> dict:
        """The position, JSON-serialisable: {"epoch": int, "position": int}."""
        return {"epoch": self._epoch, "position": self._position}

    def load_state_dict(self, state: dict) -> None:
        """Resume at a position saved by `state_dict` (same rows and seed assumed)."""
        saved = state if isinstance(state, dict) else {}
        fields = [saved.get("epoch"), saved.get("position")]
        # type(), not isinstance: True is an int, but not an epoch.
        if not all(type(value) is int and value >= 0 for value in fields):
            raise UserError(
                "checkpoint: the prompt stream state must be "
                f'{{"epoch": int >= 0, "position": int >= 0}}, got {state!r}'
            )
        epoch, position = fields
        if position >= len(self._rows):
            raise UserError(
                f"checkpoint: prompt stream position {position} is past the end of the dataset "
                f"({len(self._rows)} rows); resume with the data.path the run started with"
            )
        self._start_epoch(epoch)
        self._position = position

    def _start_epoch(self, epoch: int) -> None:
        self._epoch = epoch
        self._position = 0
        self._order = self._order_of(epoch)

    def _order_of(self, epoch: int) -> list[int]:
        """Row indices in epoch `epoch`'s order."""
        if not self._shuffle:
            return list(range(len(self._rows)))
        # SeedSequence hashes the pair into an independent stream per epoch, so epoch e can be
        # rebuilt from (seed, e) alone, without replaying earlier epochs or any global RNG.
        generator = np.random.default_rng([self._seed, epoch])
        return generator.permutation(len(self._rows)).tolist()
