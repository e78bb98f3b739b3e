"""reasoning-gym's procedural tasks (the optional `gym` extra) as data, a reward and a task.

reasoning-gym generates problems of ~100 kinds, offline, each with a scorer of its own. A
spec `reasoning_gym:NAME?size=N&seed=S&format=text|chat&OPTION=VALUE...` stands wherever a
data path goes (`parse_spec`, `make_rows`): rows with the prompt, `answer`, `completion`
(the same answer, what `grpo sft --data` trains on) and what scoring needs. `reward` (the
built-in reward `reasoning_gym`) scores a completion with its row's task's own
`score_answer`, partial credit included; `task` (what `grpo eval` checks such rows with)
counts it correct only at 1.0. The user's guide: docs/reasoning-gym.md.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import numbers
import threading
from collections.abc import Mapping, Sequence
from types import ModuleType
from typing import Any
from urllib.parse import unquote

import yaml

from grpo.errors import UserError
from grpo.infra.imports import describe, one_line
from grpo.rewards.rules import text_of
from grpo.tasks.base import Task

__all__ = [
    "DEFAULT_SEED",
    "DEFAULT_SIZE",
    "PREFIX",
    "GymSpec",
    "extract_answer",
    "make_rows",
    "parse_spec",
    "reward",
    "task",
    "task_names",
]

PREFIX = "reasoning_gym:"  # a data path naming these rows (registered in grpo.data.SOURCES)
DEFAULT_SIZE = 500  # reasoning-gym's own default size
DEFAULT_SEED = 0
FORMATS = ("text", "chat")
_SPEC_KEYS = ("size", "seed", "format")  # the spec's own keys; every other key is a task option
# The columns a row carries for scoring (besides answer and metadata).
TASK_COLUMN, OPTIONS_COLUMN, ENTRY_COLUMN = "reasoning_gym_task", "reasoning_gym_options", "reasoning_gym_entry"


def _library() -> ModuleType:
    """reasoning_gym, imported on first use (it takes a moment and is an optional extra)."""
    try:
        import reasoning_gym
    except ImportError as err:
        raise UserError("reasoning_gym: needs the reasoning-gym package: pip install 'grpo[gym]'") from err
    return reasoning_gym


def _registry() -> dict[str, tuple[type, type]]:
    """reasoning-gym's registry: task name -> (dataset class, config dataclass)."""
    return _library().factory.DATASETS


def task_names() -> list[str]:
    """Every task name reasoning-gym registers, sorted."""
    return sorted(_registry())


@dataclasses.dataclass(frozen=True)
class GymSpec:
    """A parsed 'reasoning_gym:NAME?...' spec (docs/reasoning-gym.md)."""

    name: str
    size: int = DEFAULT_SIZE
    seed: int = DEFAULT_SEED
    format: str = "text"
    options: dict = dataclasses.field(default_factory=dict)  # the task's own options, checked

    @property
    def dataset_options(self) -> dict:
        """Everything reasoning_gym.create_dataset takes besides the name."""
        return {**self.options, "size": self.size, "seed": self.seed}


def _scalar(key: str, raw: str, spec: str) -> Any:
    """A query-string value as YAML reads it ('2' -> 2, 'true' -> True), %-escapes undone."""
    text = unquote(raw)
    try:
        return yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError as err:
        raise UserError(f"data.path: {spec!r}: cannot read {key}={raw!r} ({one_line(str(err), 80)})") from None


def _query(query: str, spec: str) -> dict[str, Any]:
    """'a=1&b=x' -> {'a': 1, 'b': 'x'}; a key twice or a part without '=' is an error."""
    values: dict[str, Any] = {}
    for part in filter(None, query.split("&")):
        key, sep, raw = part.partition("=")
        key = unquote(key)
        if not sep or not key:
            raise UserError(f"data.path: {spec!r}: expected KEY=VALUE after '?', got {part!r}")
        if key in values:
            raise UserError(f"data.path: {spec!r}: {key!r} is given twice")
        values[key] = _scalar(key, raw, spec)
    return values


def parse_spec(spec: str, task_options: Mapping[str, Any] | None = None) -> GymSpec:
    """The task, size, seed, format and options a spec names, all checked (UserError otherwise).

    `task_options` (the config's `data.task_options`) are the task's options beside those of
    the query string; they may not hold the spec's own keys (size, seed, format).
    """
    if not spec.startswith(PREFIX):
        raise ValueError(f"not a reasoning_gym spec: {spec!r}")
    name, _, query = spec[len(PREFIX) :].partition("?")
    given = _query(query, spec)
    extra = dict(task_options or {})
    reserved = [key for key in _SPEC_KEYS if key in extra]
    if reserved:
        raise UserError(
            f"data.task_options: {reserved[0]!r} belongs in data.path: '{PREFIX}{name or 'NAME'}?{reserved[0]}=...'"
        )
    both = sorted(set(given) & set(extra))
    if both:
        raise UserError(f"data.task_options: {both[0]!r} is also given in data.path {spec!r}; give it once")
    registry = _registry()
    if not name:
        raise UserError(f"data.path: {spec!r} names no task; expected '{PREFIX}NAME', e.g. {PREFIX}chain_sum")
    if name not in registry:
        raise UserError(f"data.path: {_unknown_task(name, registry)}")
    size, seed, form = given.pop("size", DEFAULT_SIZE), given.pop("seed", DEFAULT_SEED), given.pop("format", "text")
    if type(size) is not int or size < 1:
        raise UserError(f"data.path: {spec!r}: size must be a positive integer, got {size!r}")
    if type(seed) is not int or seed < 0:
        raise UserError(f"data.path: {spec!r}: seed must be an integer >= 0, got {seed!r}")
    if form not in FORMATS:
        raise UserError(f"data.path: {spec!r}: format must be {' or '.join(FORMATS)}, got {form!r}")
    _check_options(name, given, registry[name][1], f"data.path: {spec!r}")
    _check_options(name, extra, registry[name][1], "data.task_options")
    return GymSpec(name=name, size=size, seed=seed, format=form, options={**given, **extra})


def _unknown_task(name: str, registry: Mapping[str, Any]) -> str:
    """'reasoning-gym has no task ...' with the close names, or all of them when none is close."""
    close = difflib.get_close_matches(name, registry, n=4, cutoff=0.6)
    if close:
        return f"reasoning-gym has no task {name!r}; close names: {', '.join(close)}"
    return f"reasoning-gym has no task {name!r} (tasks: {', '.join(sorted(registry))})"


def _check_options(name: str, options: Mapping[str, Any], config_class: type, where: str) -> None:
    """Every option is a field of the task's config dataclass (its own validation comes later);
    `where` starts the message: the config key, or data.path and the spec."""
    fields = [f.name for f in dataclasses.fields(config_class) if f.name not in ("size", "seed")]
    for key in options:
        if key not in fields:
            close = difflib.get_close_matches(key, fields, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            known = ", ".join(fields) or "none"
            raise UserError(f"{where}: task {name!r} has no option {key!r} ({hint}options: {known})")


def _build(name: str, options: Mapping[str, Any]) -> Any:
    """reasoning_gym.create_dataset(name, **options). composite's `datasets` may be mappings
    ({name, weight, config}, as in a YAML config): they become the DatasetSpecs it takes, as
    reasoning-gym's own YAML reader makes them."""
    options = dict(options)
    if name == "composite" and isinstance(options.get("datasets"), list):
        from reasoning_gym.composite import DatasetSpec

        options["datasets"] = [DatasetSpec(**d) if isinstance(d, Mapping) else d for d in options["datasets"]]
    return _library().create_dataset(name, **options)


def _create(name: str, options: Mapping[str, Any], spec: str) -> Any:
    """`_build`, with the task's validation errors as one line."""
    try:
        return _build(name, options)
    except UserError:
        raise
    except Exception as exc:  # AssertionError from the config's validate(), TypeError, ...
        detail = one_line(str(exc)) or type(exc).__name__
        raise UserError(
            f"data.path: {spec!r}: task {name!r} rejects the options {one_line(repr(dict(options)), 120)} ({detail})"
        ) from exc


def _json_safe(value: Any) -> Any:
    """`value` as JSON-safe data: tuples and sets as lists, numpy values as Python ones, keys as
    strings, other objects as their str()."""
    if value is None or isinstance(value, (str, bool, int)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, Mapping):
        return {str(key): _json_safe(item) for key, item in value.items()}
    if isinstance(value, (set, frozenset)):
        items = [_json_safe(item) for item in value]
        return sorted(items, key=repr)
    if isinstance(value, (list, tuple)):
        return [_json_safe(item) for item in value]
    if hasattr(value, "tolist"):  # numpy arrays and scalars
        return _json_safe(value.tolist())
    if isinstance(value, numbers.Number):
        return str(value)  # Fraction, Decimal, complex: exact as text
    return str(value)


def make_rows(path: str, *, prompt_column: str = "prompt", task_options: Mapping[str, Any] | None = None) -> list[dict]:
    """The rows a 'reasoning_gym:NAME?...' spec names: the prompt (under `prompt_column`),
    `answer`, `completion` (the same answer), `metadata` (JSON-safe), and for scoring
    `reasoning_gym_task`, `reasoning_gym_options` (size and seed included) and
    `reasoning_gym_entry` (the entry as generated). reasoning-gym draws item i from seed + i."""
    spec = parse_spec(path, task_options)
    options = spec.dataset_options
    dataset = _create(spec.name, options, path)
    rows = []
    for index in range(spec.size):
        try:
            entry = dataset[index]
        except Exception as exc:
            raise UserError(
                f"data.path: {path!r}: task {spec.name!r} failed to generate item {index} ({describe(exc)})"
            ) from exc
        question = str(entry["question"])
        answer = entry.get("answer")
        answer = None if answer is None else str(answer)
        rows.append(
            {
                prompt_column: question if spec.format == "text" else [{"role": "user", "content": question}],
                "answer": answer,
                "completion": answer,
                "metadata": _json_safe(entry.get("metadata", {})),
                TASK_COLUMN: spec.name,
                OPTIONS_COLUMN: dict(options),
                ENTRY_COLUMN: entry,
            }
        )
    return rows


# ---- scoring --------------------------------------------------------------------------------


def _answer(completion: Any) -> str:
    """The answer reasoning-gym's scorers expect: the content of the last `<answer>...</answer>`
    (its own `utils.extract_answer`), else the whole completion; stripped. It may be empty:
    some tasks' right answer is (ab's empty program)."""
    text = text_of(completion)
    tagged = _library().utils.extract_answer(text)
    return (text if tagged is None else tagged).strip()


def extract_answer(completion: str) -> str | None:
    """A completion's final answer as a vote of maj@k: what the reward scores, None when empty."""
    return _answer(completion) or None


_datasets: dict[tuple[str, str], Any] = {}
_datasets_lock = threading.Lock()


def _dataset(name: str, options: Mapping[str, Any]) -> Any:
    """The task object of (name, options), built once: its score_answer is the scorer."""
    key = (name, json.dumps(options, sort_keys=True, default=str))
    with _datasets_lock:
        if key not in _datasets:
            registry = _registry()
            if name not in registry:
                raise UserError(f"reward 'reasoning_gym': {_unknown_task(name, registry)}")
            try:
                _datasets[key] = _build(name, options)
            except Exception as exc:
                raise UserError(
                    f"reward 'reasoning_gym': cannot build task {name!r} with options "
                    f"{one_line(key[1], 120)} ({describe(exc)})"
                ) from exc
        return _datasets[key]


def _score(completion: Any, name: Any, options: Any, entry: Any) -> float | None:
    if not isinstance(name, str) or not isinstance(entry, Mapping):
        return None  # not a reasoning_gym row
    dataset = _dataset(name, options if isinstance(options, Mapping) else {})
    try:
        score = dataset.score_answer(_answer(completion), dict(entry))
    except Exception:
        return 0.0  # a scorer that cannot read the answer: a malformed answer is a wrong one
    return None if score is None else float(score)


def reward(
    prompts: Sequence[Any],
    completions: Sequence[Any],
    reasoning_gym_task: Sequence[Any] | None = None,
    reasoning_gym_options: Sequence[Any] | None = None,
    reasoning_gym_entry: Sequence[Any] | None = None,
    answer: Sequence[Any] | None = None,
    metadata: Sequence[Any] | None = None,
    **columns: Any,
) -> list[float | None]:
    """Each completion scored by its row's reasoning-gym task (`score_answer`), 0.0 to 1.0.

    The answer is the content of the completion's last `<answer>...</answer>`, else the
    whole completion, stripped (possibly empty). The entry scored against is the row's
    `reasoning_gym_entry`, or, for rows saved and read back without it, one rebuilt from
    the prompt, `answer` and `metadata` columns. A row without `reasoning_gym_task` cannot
    be scored (None).
    """
    n = len(completions)
    tasks = reasoning_gym_task if reasoning_gym_task is not None else [None] * n
    options = reasoning_gym_options if reasoning_gym_options is not None else [None] * n
    entries = reasoning_gym_entry if reasoning_gym_entry is not None else [None] * n
    scores = []
    for i, completion in enumerate(completions):
        entry = entries[i]
        if not isinstance(entry, Mapping) and answer is not None:
            entry = {
                "question": text_of(prompts[i]),
                "answer": answer[i],
                "metadata": metadata[i] if metadata is not None else {},
            }
        scores.append(_score(completion, tasks[i], options[i], entry))
    return scores


task = Task(name="reasoning_gym", verifier=reward, extract_answer=extract_answer, threshold=1.0)
