"""Prompt datasets for RL training: read the rows, check the prompts, stream them reproducibly.

`load_rows` turns `data.path` into plain dicts with every column kept (reward functions get
the others); `given_rows` does the same for rows handed to `grpo.train(dataset=...)`. The small
formats (.jsonl, .json, .parquet, .csv) are read directly, so that an error names the file and
line; `datasets` is imported only for its directories and hub names (and their
configurations, `data.config`). `data.system_prompt` is put into the rows themselves
(`with_system_prompt`), as TRL's recipes map it into a dataset, so that the samplers, the
reward functions and samples.jsonl all see the chat the model saw. Generated sources ('reasoning_gym:NAME?...') are registered in `SOURCES` by the spec
of the function that makes their rows, so that this module imports no task. `PromptStream`
hands the trainer its prompts, each epoch's order a function of (seed, epoch) alone: a
checkpoint stores two integers, and no global generator is touched.
"""

from __future__ import annotations

import csv
import importlib
import json
import re
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from grpo.errors import UserError, first_line
from grpo.infra.imports import import_callable

__all__ = [
    "GIVEN_DATASET",
    "REASONING_GYM",
    "SOURCES",
    "check_chat_template",
    "given_rows",
    "is_reasoning_gym",
    "load_rows",
    "load_rows_for_options",
    "with_system_prompt",
    "PromptStream",
]

# A data path that starts with this names rows a reasoning-gym task generates.
REASONING_GYM = "reasoning_gym:"

# Data paths that name generated rows, not a file: prefix -> the spec of the function that
# makes them, `make_rows(path, *, prompt_column, task_options) -> list[dict]`, imported on use
# (as `grpo.rewards.BUILTIN_REWARDS` names its functions), so that data imports no task.
SOURCES: dict[str, str] = {
    REASONING_GYM: "grpo.tasks.reasoning_gym:make_rows",
    # A verifiers v1 taskset's tasks (the verifiers extra; grpo.rollout.verifiers_env).
    "verifiers:": "grpo.rollout.verifiers_env:make_rows",
}

# data.path of a run whose rows were handed to grpo.train (dataset=...): what config.yaml
# records, so that a resume from the command line says to hand them again.
GIVEN_DATASET = "<dataset given to grpo.train>"

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
    path: str,
    *,
    prompt_column: str = "prompt",
    split: str = "train",
    task_options: dict | None = None,
    config: str | None = None,
    system_prompt: str = "",
) -> list[dict]:
    """Rows of a prompt dataset, each a dict of its columns.

    The format follows the file ending: .jsonl (one JSON object per line, blank lines
    skipped), .json (a list of objects, or an object with one list value such as
    {"data": [...]}), .parquet, .csv (values stay strings). An existing directory is a dataset
    saved with `datasets`' save_to_disk (a DatasetDict gives its `split`) or else a dataset
    folder for `datasets.load_dataset` (data files, or a card whose `configs` name them).
    Anything else is a `datasets` name. `config` is the dataset's configuration
    (load_dataset's second argument); an unknown one is answered with the dataset's list.

    Every row must hold `prompt_column`: a non-empty string (plain prompt) or a list of
    {"role": ..., "content": ...} messages (conversational prompt). A `system_prompt` then
    goes before each (`with_system_prompt`).

    'reasoning_gym:NAME?size=N&seed=S&...' has reasoning-gym's task NAME generate the rows
    (the prompt under `prompt_column`; see `grpo.tasks.reasoning_gym`), with `task_options`
    (the config's `data.task_options`) as the task's own options; 'verifiers:ID' has the verifiers
    taskset ID's tasks be the rows (`grpo.rollout.verifiers_env`), task_options its config's
    fields; other paths take none.
    """
    if path == GIVEN_DATASET:
        raise UserError(
            "data.path: this run's rows were handed to grpo.train(dataset=...): hand them again, "
            "or name a file or dataset in data.path"
        )
    source = _generated_source(path)
    if source is not None:
        _no_configurations(config, path, "generates its rows")
        make_rows = import_callable(source, kind="data source", form="pkg.module:function")
        located = _numbered(make_rows(path, prompt_column=prompt_column, task_options=task_options))
    elif task_options:
        named = " or ".join(f"'{prefix}NAME'" for prefix in SOURCES)
        raise UserError(f"data.task_options: only a {named} data.path takes task options, not {path!r}")
    else:
        located = _read(path, split, config)
    if not located:
        raise UserError(f"data.path: {path} has no rows")
    _check_prompts(located, path, prompt_column)
    return with_system_prompt([row for _, row in located], prompt_column, system_prompt)


def given_rows(
    dataset: Any, *, prompt_column: str = "prompt", split: str = "train", system_prompt: str = ""
) -> list[dict]:
    """The rows of a dataset handed over in Python (`grpo.train(dataset=...)`, TRL's
    train_dataset): a `datasets.Dataset`, a `DatasetDict` (its `split`) or a list of dicts;
    checked as `load_rows` checks a file's, and given `system_prompt` likewise."""
    name = "dataset"
    if isinstance(dataset, dict) and all(hasattr(part, "to_list") for part in dataset.values()):  # a DatasetDict
        if split not in dataset:
            raise UserError(f"data.split: the dataset has no split {split!r} (splits: {', '.join(dataset) or 'none'})")
        dataset, name = dataset[split], f"dataset[{split!r}]"
    if hasattr(dataset, "to_list") and hasattr(dataset, "column_names"):  # a datasets.Dataset
        located = _numbered(dataset.to_list())
    elif isinstance(dataset, (list, tuple)):
        for number, row in enumerate(dataset, start=1):
            if not isinstance(row, dict):
                raise UserError(f"dataset row {number}: expected a dict of columns, got {_describe(row)}")
        located = _numbered(list(dataset))
    else:
        raise UserError(
            f"dataset: expected a datasets.Dataset, a DatasetDict or a list of dicts, got {type(dataset).__name__}"
        )
    if not located:
        raise UserError("dataset: has no rows")
    _check_prompts(located, name, prompt_column)
    return with_system_prompt([row for _, row in located], prompt_column, system_prompt)


def with_system_prompt(rows: list[dict], prompt_column: str, system_prompt: str) -> list[dict]:
    """Each row with `system_prompt` as a system message before its prompt: a plain string
    becomes the chat [system, user]; a chat gets it first, unless it opens with a system
    message of its own (a row's own instructions are the more specific). No system prompt:
    the rows as they are. Rows are copied, never changed in place."""
    if not system_prompt:
        return rows
    system = {"role": "system", "content": system_prompt}
    out = []
    for row in rows:
        prompt = row[prompt_column]
        if isinstance(prompt, str):
            prompt = [system, {"role": "user", "content": prompt}]
        elif prompt[0].get("role") != "system":
            prompt = [system, *prompt]
        out.append({**row, prompt_column: prompt})
    return out


def check_chat_template(
    rows: list[dict], prompt_column: str, tokenizer: Callable[[], Any], system_prompt: str = ""
) -> None:
    """Chat prompts (the data's, or made by `system_prompt`) are rendered by the tokenizer's
    chat template: one without says so before any model loads. `tokenizer` returns it, and is
    called only where a prompt is a chat (a tokenizer takes a moment to load)."""
    if not any(isinstance(row[prompt_column], list) for row in rows):
        return
    if getattr(tokenizer(), "chat_template", None) is not None:
        return
    if system_prompt:
        raise UserError(
            "data.system_prompt: the model's tokenizer has no chat template to render the system message "
            "with (give the tokenizer one, or write the instructions into the prompts)"
        )
    raise UserError("the prompts are chat messages but the model's tokenizer has no chat template")


def load_rows_for_options(
    path: str,
    *,
    prompt_column: str = "prompt",
    column_option: str = "--prompt-column",
    split: str = "train",
    config: str | None = None,
) -> list[dict]:
    """`load_rows` for a command's options: its errors name `--data`, `column_option`,
    `--split` and `--data-config` where they would name the config keys data.path,
    data.prompt_column, data.split and data.config."""
    try:
        return load_rows(path, prompt_column=prompt_column, split=split, config=config)
    except UserError as err:
        text = str(err)
        flags = {"data.path:": "--data:", "data.prompt_column:": f"{column_option}:"}
        flags.update({"data.split:": "--split:", "data.config:": "--data-config:"})
        for key, flag in flags.items():
            if text.startswith(key):
                raise UserError(flag + text[len(key) :]) from None
        raise


# --- reading ---------------------------------------------------------------------------------


def _read(path: str, split: str, config: str | None = None) -> list[Located]:
    """Dispatch on what `path` is: a data file, a directory, or a `datasets` name."""
    if not path.strip():
        # Path("") is ".", which would quietly load the working directory.
        raise UserError("data.path: is empty")
    local = Path(path).expanduser()
    if local.is_dir():
        return _read_dataset_dir(local, path, split, config)
    reader = _FILE_READERS.get(local.suffix.lower())
    if reader is not None:
        # A data-file ending means the user meant a file: a typo must not become a hub lookup.
        if not local.is_file():
            raise UserError(f"data.path: no such file {path!r}")
        _no_configurations(config, path, "is one file")
        return reader(local, path)
    if local.exists():
        raise UserError(
            f"data.path: cannot read {path!r}: expected a .jsonl, .json, .parquet or .csv file, "
            "a dataset directory or a `datasets` name"
        )
    # Hub names never start with '/', '.' or '~', so these can only be missing local paths.
    if local.is_absolute() or path.startswith((".", "~")):
        raise UserError(f"data.path: no such file or directory {path!r}")
    return _read_hub(path, split, config)


def _no_configurations(config: str | None, name: str, why: str) -> None:
    """data.config names a configuration of a `datasets` dataset; other data has none."""
    if config is not None:
        raise UserError(f"data.config: {name} {why}, with no configurations (got {config!r}): leave data.config unset")


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


def _read_dataset_dir(path: Path, name: str, split: str, config: str | None) -> list[Located]:
    """A save_to_disk directory (it holds state.json or dataset_dict.json), else a dataset
    folder for load_dataset (data files, or a README.md card whose `configs` name them)."""
    datasets = _import_optional("datasets", f"loading {name!r}")
    if not ((path / "state.json").is_file() or (path / "dataset_dict.json").is_file()):
        return _load_dataset(datasets, str(path), name, split, config)
    _no_configurations(config, name, "is a saved dataset (save_to_disk)")
    try:
        loaded = datasets.load_from_disk(str(path))
    except Exception as err:  # any failure inside `datasets` is the same one-line story
        raise UserError(f"data.path: cannot load dataset {name!r} ({first_line(err)})") from err
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            splits = ", ".join(loaded)
            raise UserError(f"data.split: {name} has no split {split!r} (splits: {splits})")
        loaded = loaded[split]
    return _numbered(loaded.to_list())


def _split_problem(err: Exception, name: str, split: str) -> str | None:
    """The line for a split the dataset lacks (`datasets` says 'Unknown split ... Should be
    one of [...]'), naming data.split and the splits there are; None for any other failure."""
    found = re.search(r"Unknown split .*Should be one of (\[[^\]]*\])", str(err))
    if found is None:
        return None
    splits = ", ".join(re.findall(r"'([^']*)'", found.group(1)))
    return f"data.split: {name} has no split {split!r} (splits: {splits})"


def _read_hub(name: str, split: str, config: str | None) -> list[Located]:
    """A `datasets` name; it needs a network (or a warm cache) to load."""
    datasets = _import_optional("datasets", f"loading dataset {name!r}")
    return _load_dataset(datasets, name, name, split, config)


def _load_dataset(datasets: ModuleType, target: str, name: str, split: str, config: str | None) -> list[Located]:
    """`datasets.load_dataset(target, config, split=split)`; errors quote `name`, what the user wrote."""
    try:
        loaded = datasets.load_dataset(target, config, split=split)
    except Exception as err:  # network, unknown name, configuration or split, bad files: all one line
        raise UserError(
            _configuration_problem(datasets, target, name, config)
            or _split_problem(err, name, split)
            or f"data.path: cannot load dataset {name!r} ({first_line(err)})"
        ) from err
    return _numbered(loaded.to_list())


def _configuration_problem(datasets: ModuleType, target: str, name: str, config: str | None) -> str | None:
    """After a failed load: the line that names the dataset's configurations, when the
    configuration is what failed (an unknown one, or none named where there are several);
    None when it is not, or the list cannot be read either (then the load's own error says)."""
    try:
        names = list(datasets.get_dataset_config_names(target))
    except Exception:  # noqa: BLE001 (no list to offer: the load's error is the story)
        return None
    listed = ", ".join(names)
    if config is None and len(names) > 1:
        return f"data.config: {name} has several configurations, name one (configurations: {listed})"
    if config is not None and names and config not in names:
        return f"data.config: {name} has no configuration {config!r} (configurations: {listed})"
    return None


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
