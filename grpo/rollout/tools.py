"""Tools and environments for multi-turn rollouts, in the shape TRL's GRPOTrainer takes them.

A tool is a plain Python function (sync or async; its type hints and Google-style docstring
become the JSON schema the chat template shows); an environment is a class, one instance per
rollout, whose public methods are its tools (`reset(**row)` starts an episode, an optional
`get_reward()` scores it). The model calls a tool in its chat template's format, Hermes
(`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`), Qwen3's or Llama 3's
(rollout.tool_format; `grpo.rollout.tool_formats`, whose Hermes names are here too).
A call is contained as a reward's is (`grpo.infra.contain.call_function`, in a worker with
rollout.tool_isolate): whatever goes wrong, a call written badly by the model included,
becomes the tool message `{"error": "..."}` so that the model can learn from it (TRL leaves
a call it cannot parse unanswered), and the run goes on. The user's guide: docs/tools.md.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from grpo.errors import Lost, UserError
from grpo.infra import contain
from grpo.infra.imports import import_object, one_line, spec_of
from grpo.rewards.types import WeightedReward
from grpo.rollout.tool_formats import TOOL_CALL, Call, HermesFormat, parse_calls  # the formats' part, here too

__all__ = ["TOOL_CALL", "Call", "Episode", "HermesFormat", "Toolbox", "answer_turn", "parse_calls"]

_RESERVED = ("reset", "get_reward")  # an environment's methods that are not tools


# ---- running calls ----------------------------------------------------------------------------


def as_content(name: str, result: Any) -> str:
    """A tool's result as the tool message's text: a string as it is, anything else as JSON."""
    if isinstance(result, str):
        return result
    try:
        return json.dumps(result)
    except (TypeError, ValueError):
        raise UserError(
            f"tool {name!r} returned a {type(result).__name__}, which is neither a string nor JSON-serialisable; "
            "return a str (or a number, list or dict)"
        ) from None


def _error(text: str) -> str:
    return json.dumps({"error": text})


@dataclass
class Episode:
    """One rollout's tools: the standalone functions and its environment's methods."""

    functions: dict[str, Callable]
    environment: Any = None
    timeout: float | None = None
    calls: int = 0  # tool calls answered (failed ones included)
    failures: int = 0  # calls answered with an error
    isolated: dict[str, str] = field(default_factory=dict)  # tool name -> the spec its worker process imports

    @property
    def done(self) -> bool:
        """Whether its environment says the episode is over (a `done` attribute that is True,
        as an OpenEnv observation sets it): its rollout runs no further call."""
        return getattr(self.environment, "done", None) is True

    def run(self, call: Call) -> dict:
        """The tool message that answers `call` (contained: module doc)."""
        return answer_turn([(self, [call])])[0][0]

    def _target(self, call: Call) -> Callable | str:
        """The function that answers `call`, or the error message that does (counted)."""
        if call.error is not None:
            self.failures += 1
            return _error(call.error)
        fn = self.functions.get(call.name)
        if fn is None:
            self.failures += 1
            return _error(f"unknown tool {call.name!r}; the tools are {', '.join(sorted(self.functions)) or 'none'}")
        return fn

    def _call(self, fn: Callable, call: Call) -> str:
        """`fn` run on the call's arguments here (or in its worker, isolated), answered."""
        spec = self.isolated.get(call.name)
        return self._settle(call, lambda: contain.call_function(fn, call.arguments, self.timeout, spec=spec))

    def _settle(self, call: Call, result: Callable[[], Any]) -> str:
        """The call's answer from `result()`, what it returned; a failure (counted) as an error."""
        try:
            value = result()
        except contain.TimedOut:
            self.failures += 1
            return _error(f"the tool took longer than {self.timeout:g} s")
        except contain.Failed as failure:
            self.failures += 1
            return _error(f"the tool {failure.description}")
        except Lost:
            raise  # the environment cannot go on: the run's failure, not the tool's
        except UserError as err:  # raised inside the tool: the tool's failure, not the run's
            self.failures += 1
            return _error(f"the tool raised {one_line(str(err))}")
        return as_content(call.name, value)


def answer_turn(turn: Sequence[tuple[Episode, list[Call]]]) -> list[list[dict]]:
    """The tool messages that answer one turn's calls, each (episode, its calls) of `turn` in
    order. Each call is contained (module doc) and counted in its episode. A sync tool (or an
    isolated one) runs when its rollout's turn comes; the turn's async tools, of every
    rollout, then run all at once on one event loop (as TRL awaits them), each bounded by
    the timeout: a turn that calls a remote tool from 64 rollouts waits for the slowest
    call, not for the sum of them."""
    answers: list[list[str | None]] = [[None] * len(calls) for _, calls in turn]
    waiting = []  # (row, call index, episode, call, fn): the async calls, run together below
    for i, (episode, calls) in enumerate(turn):
        for j, call in enumerate(calls):
            episode.calls += 1
            target = episode._target(call)
            if isinstance(target, str):
                answers[i][j] = target
            elif contain.is_async(target) and call.name not in episode.isolated:
                waiting.append((i, j, episode, call, target))
            else:
                answers[i][j] = episode._call(target, call)
    outcomes = contain.call_functions_concurrently([(fn, c.arguments, e.timeout) for _, _, e, c, fn in waiting])
    for (i, j, episode, call, _), outcome in zip(waiting, outcomes):
        answers[i][j] = episode._settle(call, outcome.get)
    return [
        [{"role": "tool", "name": call.name, "content": text} for call, text in zip(calls, row)]
        for (_, calls), row in zip(turn, answers)
    ]


def _schema(fn: Callable, name: str) -> dict:
    from transformers.utils import get_json_schema

    if isinstance(getattr(fn, "tool_schema", None), dict):  # a tool that carries its schema (an OpenEnv action's)
        return fn.tool_schema
    try:
        return get_json_schema(fn)
    except Exception as err:
        raise UserError(
            f"tool {name!r}: no JSON schema from its signature and docstring ({one_line(str(err))}); a tool needs "
            "type hints and a Google-style docstring with an Args: section"
        ) from None


def _importable(spec) -> str:
    """The spec a worker process imports `spec` by (rollout.tool_isolate): as written, or a
    function's 'module:qualname'; a one-line UserError for one no other process can import."""
    name = spec_of(spec)
    module, _, qualname = name.partition(":")
    if module == "__main__" or "<" in qualname or not qualname:
        raise UserError(
            f"tool {name!r}: rollout.tool_isolate imports each tool by its spec in a worker process, and this one is "
            "defined in a script or inside a function; define it at the top level of a module"
        )
    return name


def environment_tools(instance) -> dict[str, Callable]:
    """An environment's tools: its public methods, but reset and get_reward."""
    return {
        name: member
        for name, member in inspect.getmembers(instance, predicate=inspect.ismethod)
        if not name.startswith("_") and name not in _RESERVED
    }


ENVIRONMENT_COLUMN = "environment"  # with several environments: the row's field that picks one (TRL's)


@dataclass
class _Environment:
    """One environment class of a run, probed: what its rollouts' prompts show (`schemas`:
    the standalone tools' and its methods') and whether it scores them (get_reward)."""

    name: str | None  # its name in rollout.environment's mapping; None when the run has one
    factory: Callable
    schemas: list[dict]
    owns_reward: bool
    async_reward: bool

    @property
    def label(self) -> str:
        """How messages name it: its spec, after its name when it has one."""
        return spec_of(self.factory) if self.name is None else f"{self.name} ({spec_of(self.factory)})"

    def build(self):
        try:
            instance = self.factory()
        except Exception as err:
            raise UserError(f"environment {self.label!r}: building an instance failed ({one_line(str(err))})") from None
        if not callable(getattr(instance, "reset", None)):
            raise UserError(f"environment {self.label!r}: has no reset method (reset(**row) -> str | None)")
        return instance


class Toolbox:
    """A run's tools and environment classes, resolved and checked before the first step:
    each tool's schema built, each environment probed once (an instance built, its reset and
    tools found). `environment` is one class (or spec), or, as TRL's environment_factory
    takes it, a mapping of names to classes: then each row's `environment` field names its
    own, and its prompt shows that environment's tools only. `start` begins one episode per
    rollout."""

    def __init__(
        self,
        tools: Sequence[str | Callable] = (),
        environment: str | type | dict[str, str | type] | None = None,
        *,
        max_calls: int | None = None,
        timeout: float | None = None,
        isolate: bool = False,
        environment_action: str | type | None = None,
        environment_reward: str = "last",
    ):
        self.max_calls, self.timeout = max_calls, timeout
        self.openenv = {"action": environment_action, "reward": environment_reward}  # grpo.rollout.openenv.adapt's
        self.functions: dict[str, Callable] = {}
        self.isolated: dict[str, str] = {}  # with `isolate`: tool name -> its spec
        for spec in tools:
            fn = spec if callable(spec) else import_object(spec, kind="tool", form="pkg.module:function")
            if not callable(fn) or isinstance(fn, type):
                raise UserError(f"tool {spec_of(spec)!r}: not a function")
            name = getattr(fn, "__name__", None) or spec_of(spec)
            if name in self.functions:
                raise UserError(f"tool {spec_of(spec)!r}: two tools are named {name!r}")
            self.functions[name] = fn
            if isolate:
                self.isolated[name] = _importable(spec)
        self.several = isinstance(environment, dict)
        given = environment if self.several else ({} if environment is None else {None: environment})
        if self.several and not given:
            raise UserError("rollout.environment: an empty mapping; name at least one environment class")
        # What a prompt shows: the standalone tools and, with one environment, its methods
        # (with several, each row its own environment's: `schemas_of`).
        self.schemas = [_schema(fn, name) for name, fn in self.functions.items()]
        self.environments = {name: self._probe(name, spec) for name, spec in given.items()}
        if None in self.environments:
            self.schemas = self.environments[None].schemas
        if not self.environments and not self.schemas:
            raise UserError("rollout.tools / rollout.environment: no tool to give the model")

    @property
    def owns_reward(self) -> bool:
        """Whether an environment scores its rollouts (get_reward): a run may then have no other reward."""
        return any(env.owns_reward for env in self.environments.values())

    def _probe(self, name: str | None, spec: str | type) -> _Environment:
        if name is not None and (not isinstance(name, str) or not name):
            raise UserError(f"rollout.environment: {name!r} is not a name (a mapping of names to classes)")
        from grpo.rollout import openenv

        factory = openenv.adapt(spec, **self.openenv) or spec  # an OpenEnv environment, client or URL: TRL's shape
        if isinstance(factory, str):
            factory = import_object(spec, kind="environment", form="pkg.module:Class")
        if not callable(factory):
            raise UserError(f"environment {spec_of(spec)!r}: not a class")
        env = _Environment(name, factory, [], False, False)
        probe = env.build()
        methods = environment_tools(probe)
        clash = sorted(set(methods) & set(self.functions))
        if clash:
            raise UserError(f"environment {env.label!r}: method {clash[0]!r} has the name of a tool")
        env.schemas = self.schemas + [_schema(fn, f"{env.label}.{method}") for method, fn in methods.items()]
        if not env.schemas:
            raise UserError(
                f"environment {env.label!r}: no tool to give the model (an environment needs a public method)"
            )
        env.owns_reward = callable(getattr(probe, "get_reward", None))
        env.async_reward = env.owns_reward and inspect.iscoroutinefunction(probe.get_reward)
        return env

    @property
    def environment(self):
        """The run's environment class when it has exactly one (None without any, or with a mapping)."""
        return None if self.several or not self.environments else self.environments[None].factory

    @classmethod
    def from_config(cls, rollout, tools=None, environment=None) -> Toolbox | None:
        """The toolbox rollout.tools and rollout.environment describe (or the `tools` and
        `environment` given from Python instead); None when there is neither."""
        tools = rollout.tools if tools is None else tools
        environment = rollout.environment if environment is None else environment
        if not tools and environment is None:
            return None
        return cls(
            tools,
            environment,
            max_calls=rollout.max_tool_calls,
            timeout=rollout.tool_timeout,
            isolate=rollout.tool_isolate,
            environment_action=rollout.environment_action,
            environment_reward=rollout.environment_reward,
        )

    def check_prompts(self, rows: list[dict], prompt_column: str) -> None:
        """A one-line UserError unless every row's prompt is chat messages (the tools reach
        the model through the chat template) and, with several environments, every row
        names one of them in its `environment` field (checked before the first step, and by
        the sampler)."""
        plain = next((i for i, row in enumerate(rows) if isinstance(row[prompt_column], str)), None)
        if plain is not None:
            raise UserError(
                f"rollout.tools / rollout.environment: the prompts must be chat messages (a list of "
                f"{{'role': ..., 'content': ...}}), not plain text (row {plain} is): the tools reach the model "
                "through the chat template"
            )
        if self.several:
            for i, row in enumerate(rows):
                self._of(row, i)

    def _of(self, row: dict, index: int | None = None) -> _Environment | None:
        """The environment of a row: the run's one, or the one its `environment` field names."""
        if not self.several:
            return self.environments.get(None)
        name = row.get(ENVIRONMENT_COLUMN)
        if name not in self.environments:
            where = "a row" if index is None else f"row {index}"
            given = "has no 'environment' field" if ENVIRONMENT_COLUMN not in row else f"names {one_line(repr(name))}"
            raise UserError(
                f"rollout.environment: {where} {given}; with several environments each row's 'environment' "
                f"names one of {', '.join(map(repr, self.environments))}"
            )
        return self.environments[name]

    def schemas_of(self, row: dict) -> list[dict]:
        """The tools a row's prompt shows: the standalone ones and its environment's."""
        env = self._of(row)
        return self.schemas if env is None else env.schemas

    def start(self, rows: list[dict]) -> tuple[list[Episode], list[str | None]]:
        """One episode per row (a rollout), and the text each environment's reset adds to
        its prompt (None: none). reset gets the row's columns by keyword, as TRL passes them
        (but the `environment` field that picked it, with several)."""
        episodes, texts = [], []
        for row in rows:
            env = self._of(row)
            if env is None:
                episodes.append(Episode(dict(self.functions), timeout=self.timeout, isolated=self.isolated))
                texts.append(None)
                continue
            instance = env.build()
            columns = {k: v for k, v in row.items() if k != ENVIRONMENT_COLUMN} if self.several else row
            try:
                text = instance.reset(**columns)
            except UserError:
                raise  # already one line (an OpenEnv server that is gone, one that refused a session)
            except Exception as err:
                raise UserError(f"environment {env.label!r}: reset raised {one_line(repr(err))}") from None
            if text is not None and not isinstance(text, str):
                raise UserError(
                    f"environment {env.label!r}: reset returned a {type(text).__name__}; expected str or None"
                )
            tools = {**self.functions, **environment_tools(instance)}
            episodes.append(Episode(tools, instance, self.timeout, isolated=self.isolated))
            texts.append(text)
        return episodes, texts

    def rewards(self) -> list[WeightedReward]:
        """Each environment's get_reward as a reward of weight 1 (as TRL adds it), named after
        its class (and its name, with several: it scores its own rows, None the others'); none
        for an environment without get_reward."""
        return [_get_reward(env) for env in self.environments.values() if env.owns_reward]


def _get_reward(env: _Environment) -> WeightedReward:
    """`env`'s get_reward as a reward function over a batch's `environments` (one instance per
    rollout); with several environments, the rows whose `environment` field is not its name
    score None."""

    def mine(environments, kwargs) -> list[bool]:
        names = kwargs.get(ENVIRONMENT_COLUMN) or [None] * len(environments)
        return [env.name is None or name == env.name for name in names]

    if env.async_reward:

        async def get_reward(environments, **kwargs):
            return [await e.get_reward() if own else None for e, own in zip(environments, mine(environments, kwargs))]

    else:

        def get_reward(environments, **kwargs):
            return [e.get_reward() if own else None for e, own in zip(environments, mine(environments, kwargs))]

    name = spec_of(env.factory) if env.name is None else f"{env.name}:{spec_of(env.factory)}"
    return WeightedReward(name=f"{name}.get_reward", fn=get_reward, weight=1.0)


def with_observation(prompt: list[dict], text: str | None) -> list[dict]:
    """The prompt's messages with `text` (a reset's) appended to the last one's content (as
    TRL appends it); the row's own messages are left as they were."""
    if text is None:
        return prompt
    last = prompt[-1]
    return [*prompt[:-1], {**last, "content": f"{last.get('content') or ''}{text}"}]
