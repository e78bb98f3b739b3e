"""OpenEnv environments as rollout.environment: an `Environment` class run in this process, a
client factory, or a server URL, each turned into an environment of TRL's shape (one
instance per rollout, `reset(**row)`, its tools as methods, `get_reward()`), so that the
Toolbox runs it as any other (docs/tools.md#openenv is the manual).

The tools come from the action type (one tool per Action class, its fields but `metadata` the
parameters, named after the class: EchoAction -> echo) or from an MCP environment's tool list;
a tool's answer is the observation's fields as text; an episode's reward is the last
observation's (as TRL's OpenEnv examples keep it) or their sum; an observation with `done`
ends the episode (`done` is set: the Toolbox runs no further call). A server that stops
answering stops the run in one line (`grpo.errors.Lost`): the loop saves the last completed step.

Nothing here imports openenv until a URL or a client needs it: a user's OpenEnv class was
made with openenv imported, so its base classes are looked up in `sys.modules`.
"""

from __future__ import annotations

import inspect
import json
import re
import sys
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from grpo.errors import Lost, UserError
from grpo.infra.imports import describe, import_object, one_line, spec_of

__all__ = ["REWARDS", "adapt", "is_url", "tool_of_action"]

REWARDS = ("last", "sum")  # rollout.environment_reward
_SCHEMES = ("http://", "https://", "ws://", "wss://")
_ENVIRONMENT = ("openenv.core.env_server.interfaces", "Environment")
_MCP_ENVIRONMENT = ("openenv.core.env_server.mcp_environment", "MCPEnvironment")
_CLIENT = ("openenv.core.env_client", "EnvClient")
_SYNC_CLIENT = ("openenv.core.sync_client", "SyncEnvClient")
_NOT_TOOLS = ("reset", "get_reward")  # the adapter's own methods (tools.environment_tools leaves them out)
_EXTRA = "the openenv extra (pip install 'grpo[openenv]')"


def is_url(spec) -> bool:
    """Whether rollout.environment names a server (http, https, ws or wss)."""
    return isinstance(spec, str) and spec.startswith(_SCHEMES)


def _openenv(where: tuple[str, str]):
    """An openenv class, if openenv is imported (else nothing made with it exists)."""
    module = sys.modules.get(where[0])
    return getattr(module, where[1], None)


def _subclass(value, where) -> bool:
    base = _openenv(where)
    return base is not None and isinstance(value, type) and issubclass(value, base)


def _instance(value, *wheres) -> bool:
    return any((base := _openenv(w)) is not None and isinstance(value, base) for w in wheres)


# ---- tools ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Tool:
    """One tool of an OpenEnv environment: its schema (what the prompt shows) and the payload
    a call sends: an Action class built from the arguments, or (None) the arguments as sent
    (an MCP tool's, or a server's action known from its /schema only)."""

    name: str
    schema: dict
    action: type | None = None
    mcp: bool = False


def _snake(name: str) -> str:
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name).lower()


def _clean(schema: Any) -> Any:
    """A JSON schema without pydantic's 'title' keys (noise in the prompt)."""
    if isinstance(schema, dict):
        return {k: _clean(v) for k, v in schema.items() if not (k == "title" and isinstance(v, str))}
    if isinstance(schema, list):
        return [_clean(v) for v in schema]
    return schema


def _ordered(parameter: dict) -> dict:
    """A parameter's schema with its type first and its description next, as transformers'
    get_json_schema writes a function's (what models saw in training)."""
    first = [k for k in ("type", "description") if k in parameter]
    return {**{k: parameter[k] for k in first}, **{k: v for k, v in parameter.items() if k not in first}}


def _function(name: str, description: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}


def tool_of_action(action: type, name: str | None = None, json_schema: dict | None = None) -> Tool:
    """The tool an Action class (or its JSON schema, as a server's /schema gives it) stands
    for: its fields but `metadata` (every Action's, no tool parameter) the parameters, its
    docstring the description, its name the class's without 'Action', in snake case."""
    schema = json_schema if json_schema is not None else action.model_json_schema()
    properties = {k: _ordered(_clean(v)) for k, v in schema.get("properties", {}).items() if k != "metadata"}
    parameters = {"type": "object", "properties": properties}
    required = [k for k in schema.get("required", []) if k != "metadata"]
    if required:
        parameters["required"] = required
    if "$defs" in schema:
        parameters["$defs"] = _clean(schema["$defs"])
    title = name or (action.__name__ if action is not None else schema.get("title", "Action"))
    tool = _snake(title[: -len("Action")] if title.endswith("Action") and title != "Action" else title)
    doc = inspect.getdoc(action) if action is not None else schema.get("description")
    description = (doc or f"Send a {title} to the environment.").strip().split("\n\n")[0]
    return Tool(tool, _function(tool, " ".join(description.split()), parameters), action)


def _tool_of_mcp(tool) -> Tool:
    """An MCP tool (OpenEnv's Tool, or its dict over the wire) as a tool of ours."""
    data = tool if isinstance(tool, dict) else tool.model_dump()
    parameters = _clean(data.get("input_schema") or data.get("inputSchema") or {"type": "object", "properties": {}})
    name = data["name"]
    return Tool(name, _function(name, " ".join((data.get("description") or name).split()), parameters), mcp=True)


def _actions(annotation) -> list[type]:
    """The Action classes an annotation names (a class, or a union of them)."""
    if isinstance(annotation, type):
        return [annotation]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return [a for a in typing.get_args(annotation) if isinstance(a, type)]
    return []


def _action_classes(environment: type) -> list[type]:
    """The Action classes an Environment class's `step` takes: its annotation, else its
    generic base's first argument (Environment[MyAction, MyObservation, MyState])."""
    base = _openenv(_ENVIRONMENT)
    try:
        hints = typing.get_type_hints(environment.step)
    except Exception:
        hints = {}
    found = _actions(hints.get("action"))
    if not found:
        for klass in environment.__mro__:
            for generic in getattr(klass, "__orig_bases__", ()):
                if typing.get_origin(generic) is base and typing.get_args(generic):
                    found = _actions(typing.get_args(generic)[0])
                    break
            if found:
                break
    action = _openenv(("openenv.core.env_server.types", "Action"))
    return [a for a in found if a is not action]


def _checked(tools: list[Tool], label: str) -> list[Tool]:
    names = [t.name for t in tools]
    for name in names:
        if name in _NOT_TOOLS or name.startswith("_") or not name.isidentifier():
            raise UserError(f"environment {label!r}: a tool named {name!r} cannot be one (rename its action class)")
        if names.count(name) > 1:
            raise UserError(f"environment {label!r}: two tools are named {name!r}")
    if not tools:
        raise UserError(f"environment {label!r}: no tool to give the model (its action type has none)")
    return tools


# ---- observations -----------------------------------------------------------------------------


def _fields(observation) -> dict:
    """An observation's own fields (a model's, or the dict a client returns), without reward,
    done and metadata."""
    if hasattr(observation, "model_dump"):
        observation = observation.model_dump()
    if not isinstance(observation, dict):
        return {"observation": observation}
    return {k: v for k, v in observation.items() if k not in ("reward", "done", "metadata")}


def _mcp_text(fields: dict) -> str:
    """A CallToolObservation's answer: its error as {"error": ...}, else its result's data."""
    error = fields.get("error")
    if error:
        return json.dumps({"error": error.get("message", str(error)) if isinstance(error, dict) else str(error)})
    result = fields.get("result")
    if hasattr(result, "data"):  # fastmcp's CallToolResult, in this process
        result = result.data
    elif isinstance(result, dict) and "data" in result:  # its fields, over the wire
        result = result["data"]
    return result if isinstance(result, str) else json.dumps(result, default=str)


def _text(fields: dict, *, drop_empty: bool = False) -> str | None:
    """Observation fields as a message's text: one field's value as it is (a string) or as
    JSON, several as a JSON object; with `drop_empty` (a reset's), empty fields left out and
    None when none is left."""
    if drop_empty:
        fields = {k: v for k, v in fields.items() if v not in (None, "", [], {}, 0, False)}
        if not fields:
            return None
    if len(fields) == 1:
        (value,) = fields.values()
        return value if isinstance(value, str) else json.dumps(value, default=str)
    return json.dumps(fields, default=str)


@dataclass
class Step:
    fields: dict
    reward: float | None
    done: bool


def _step_of(result) -> Step:
    """A client's StepResult or an Environment's Observation as one Step."""
    if hasattr(result, "observation") and not hasattr(result, "model_dump"):  # a client's StepResult
        observation, reward, done = result.observation, result.reward, result.done
    else:
        observation, reward, done = result, getattr(result, "reward", None), getattr(result, "done", False)
    return Step(_fields(observation), None if reward is None else float(reward), bool(done))


# ---- sessions: one environment instance or server session per rollout -------------------------


class _Local:
    """An Environment instance in this process."""

    def __init__(self, factory: Callable, label: str):
        self.env, self.label = factory(), label

    def reset(self, row: dict) -> Step:
        return _step_of(self.env.reset(**_accepted(self.env.reset, row)))

    def step(self, payload) -> Step:
        return _step_of(self.env.step(payload))

    def close(self) -> None:
        self.env.close()


class _Remote:
    """A session of a server, through OpenEnv's stock client (its sync wrapper)."""

    def __init__(self, client, label: str):
        self.label = label
        self.client = client.sync() if _instance(client, _CLIENT) else client
        self.client.connect()

    def reset(self, row: dict) -> Step:
        return _step_of(self.client.reset(**_jsonable(row)))

    def step(self, payload) -> Step:
        return _step_of(self.client.step(payload))

    def close(self) -> None:
        self.client.close()


def _accepted(method, row: dict) -> dict:
    """The row's columns that `method` takes (all with **kwargs), as OpenEnv's server passes them."""
    parameters = inspect.signature(method).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return dict(row)
    names = {p.name for p in parameters}
    return {k: v for k, v in row.items() if k in names}


def _jsonable(row: dict) -> dict:
    """The row's columns that travel as JSON (a server's reset takes those its signature names)."""
    kept = {}
    for key, value in row.items():
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            continue
        kept[key] = value
    return kept


def _gone(err: BaseException) -> bool:
    """Whether `err` says the server is unreachable (not that the environment refused an action)."""
    module = type(err).__module__ or ""
    return isinstance(err, (ConnectionError, EOFError, TimeoutError, OSError)) or module.startswith(
        ("websockets", "httpx", "requests", "urllib3")
    )


# ---- the environment of TRL's shape -----------------------------------------------------------


class OpenEnvEpisode:
    """One rollout's OpenEnv episode, in TRL's environment shape: `reset(**row)` opens its
    session and returns the first observation's text, each tool steps it, `get_reward()` is
    the episode's reward. `done` is the last observation's; `rewards` every observation's."""

    _label: str = ""
    _open: Callable = None  # () -> a session (_Local or _Remote)
    _reward: str = "last"
    _remote: bool = False

    def __init__(self):
        self.rewards: list[float] = []
        self.done = False
        self.observations: list[dict] = []
        self._session = None

    def reset(self, **row) -> str | None:
        self._close()
        self.rewards, self.done, self.observations = [], False, []
        try:
            self._session = type(self)._open()
            step = self._session.reset(row)
        except UserError:
            raise
        except Exception as err:
            raise (
                self._lost("reset", err)
                if self._remote and _gone(err)
                else UserError(
                    f"environment {self._label!r}: reset failed ({describe(err)})"
                    + (_CAPACITY if "capacity" in str(err).lower() else "")
                )
            ) from None
        self._record(step)
        return _text(step.fields, drop_empty=True)

    def get_reward(self) -> float:
        """The episode's reward (rollout.environment_reward): the last observation's or their
        sum; 0 when none had one. The session closes here: the episode is over."""
        self._close()
        if not self.rewards:
            return 0.0
        return self.rewards[-1] if self._reward == "last" else float(sum(self.rewards))

    def _act(self, tool: Tool, arguments: dict) -> str:
        if self.done:
            raise RuntimeError("the episode is over (the environment said done)")
        if self._session is None:
            raise RuntimeError("the episode has no session (reset was not called)")
        if "metadata" in arguments:
            raise TypeError(f"{tool.name}() got an unexpected keyword argument 'metadata'")
        if tool.mcp:
            call = _openenv(("openenv.core.env_server.mcp_types", "CallToolAction"))
            payload = call(tool_name=tool.name, arguments=arguments)
        elif tool.action is not None:
            payload = tool.action(**arguments)  # a validation error is the model's: the tool's answer
        else:
            payload = dict(arguments)
        try:
            step = self._session.step(payload)
        except Exception as err:
            if self._remote and _gone(err):
                raise self._lost(f"a {tool.name} call", err) from None
            raise
        self._record(step)
        if self.done:
            self._close()
        return _mcp_text(step.fields) if tool.mcp else _text(step.fields)

    def _record(self, step: Step) -> None:
        self.observations.append(step.fields)
        if step.reward is not None:
            self.rewards.append(step.reward)
        self.done = step.done

    def _lost(self, what: str, err: BaseException):
        return Lost(
            f"environment {self._label!r}: the server stopped answering during {what} ({describe(err)}); "
            "restart it and resume the run (grpo train CONFIG --resume)"
        )

    def _close(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            try:
                session.close()
            except Exception:
                pass  # a session the server already dropped

    def __del__(self):
        self._close()

    def __reduce__(self):
        """What crosses a process (rollout.async): the episode's outcome, its session closed."""
        self._close()
        return (Ended, (self._label, self._reward, self.rewards, self.done, self.observations))


class Ended(OpenEnvEpisode):
    """An episode as the trainer gets it from an asynchronous generator: its outcome only."""

    def __init__(self, label, reward, rewards, done, observations):
        self._label, self._reward = label, reward
        self.rewards, self.done, self.observations, self._session = rewards, done, observations, None

    def reset(self, **row):
        raise RuntimeError("an ended episode cannot be reset")


_CAPACITY = (
    "; the server serves fewer sessions than a step's rollouts: give create_app max_concurrent_envs >= "
    "rollout.group_size x rollout.prompts_per_step (and SUPPORTS_CONCURRENT_SESSIONS = True)"
)


def _episode_class(label: str, opener: Callable, tools: list[Tool], reward: str, remote: bool) -> type:
    """A class of TRL's environment shape whose public methods are `tools` (each carrying its
    schema as `tool_schema`, which the Toolbox shows the model as it is)."""

    def method(tool: Tool):
        def call(self, **arguments):
            return self._act(tool, arguments)

        call.__name__ = call.__qualname__ = tool.name
        call.__doc__ = tool.schema["function"]["description"]
        call.tool_schema = tool.schema
        return call

    namespace = {t.name: method(t) for t in _checked(tools, label)}
    namespace.update(_label=label, _open=staticmethod(opener), _reward=reward, _remote=remote)
    # Named as the user named it (its reward's metric, the Toolbox's messages): 'pkg.module:Class', 'openenv:URL'.
    module, _, qualname = label.partition(":") if ":" in label and not is_url(label) else ("openenv", "", label)
    namespace.update(__module__=module, __qualname__=qualname)
    return type(qualname, (OpenEnvEpisode,), namespace)


# ---- what rollout.environment names ------------------------------------------------------------


def adapt(spec, *, action=None, reward: str = "last") -> type | None:
    """`spec` (rollout.environment, or one value of its mapping) as a class of TRL's
    environment shape when it is an OpenEnv one: a server URL, an Environment class, or a
    function that builds an Environment or a client; None for anything else (a TRL-style
    class, left to the Toolbox). `action`: rollout.environment_action."""
    if reward not in REWARDS:
        raise UserError(f"rollout.environment_reward: expected one of {', '.join(REWARDS)}, got {reward!r}")
    if is_url(spec):
        return _of_server(spec, action, reward)
    target = spec
    if isinstance(spec, str):
        target = import_object(spec, kind="environment", form="pkg.module:Class")
    label = spec_of(spec)
    actions = _given_actions(action)
    if _subclass(target, _ENVIRONMENT):
        return _of_class(target, label, actions, reward)
    if _subclass(target, _CLIENT) or _subclass(target, _SYNC_CLIENT):
        raise UserError(
            f"environment {label!r}: an OpenEnv client class needs its server: give a function that builds the "
            "client (lambda: MyEnv(base_url=URL)), or the server's URL as rollout.environment"
        )
    if isinstance(target, type) or not callable(target) or not _openenv(_ENVIRONMENT):
        return None
    built = _build(target, label)  # a function: what it builds says what it is
    if _instance(built, _ENVIRONMENT):
        return _of_class(type(built), label, actions, reward, factory=target)
    if _instance(built, _CLIENT, _SYNC_CLIENT):
        client = built.async_client if _instance(built, _SYNC_CLIENT) else built
        return _of_client(target, client, label, actions, reward)
    return None


def _build(factory: Callable, label: str):
    try:
        return factory()
    except Exception as err:
        raise UserError(f"environment {label!r}: building an instance failed ({describe(err)})") from None


def _given_actions(action) -> list[type]:
    if action is None:
        return []
    target = (
        import_object(action, kind="environment action", form="pkg.module:Class") if isinstance(action, str) else action
    )
    if not (isinstance(target, type) and hasattr(target, "model_json_schema")):
        raise UserError(f"rollout.environment_action {spec_of(action)!r}: not an OpenEnv Action class")
    return [target]


def _is_mcp_action(actions: list[type]) -> bool:
    call = _openenv(("openenv.core.env_server.mcp_types", "CallToolAction"))
    return call is not None and any(a is call for a in actions)


def _of_class(environment: type, label: str, actions: list[type], reward: str, factory=None) -> type:
    """An Environment class run in this process, one instance per rollout."""
    factory = factory or environment
    if _subclass(environment, _MCP_ENVIRONMENT) or _is_mcp_action(actions):
        probe = _build(factory, label)
        try:
            listed = probe.step(_openenv(("openenv.core.env_server.mcp_types", "ListToolsAction"))())
        finally:
            probe.close()
        tools = [_tool_of_mcp(t) for t in listed.tools]
    else:
        actions = actions or _action_classes(environment)
        if not actions:
            raise UserError(
                f"environment {label!r}: cannot tell its Action class from step's annotation or its generic base; "
                "name it in rollout.environment_action"
            )
        tools = [tool_of_action(a) for a in actions]
    return _episode_class(label, lambda: _Local(factory, label), tools, reward, remote=False)


def _of_server(url: str, action, reward: str) -> type:
    """A server at `url`, one WebSocket session per rollout through OpenEnv's GenericEnvClient;
    the tools from rollout.environment_action, else from the server's /schema (or MCP tools)."""
    try:
        from openenv.core.generic_client import GenericEnvClient
    except ImportError:
        raise UserError(f"environment {url!r}: a server URL needs {_EXTRA}") from None
    return _of_client(lambda: GenericEnvClient(base_url=url), None, url, _given_actions(action), reward, url=url)


def _of_client(factory: Callable, client, label: str, actions: list[type], reward: str, url=None) -> type:
    """Sessions of a server through clients `factory` builds (each rollout its own)."""
    url = url or client.base_url
    if not actions and client is not None:
        actions = [
            a
            for generic in getattr(type(client), "__orig_bases__", ())
            for a in _actions(typing.get_args(generic)[0] if typing.get_args(generic) else None)
            if hasattr(a, "model_json_schema")
        ]
    if actions and not _is_mcp_action(actions):
        tools = [tool_of_action(a) for a in actions]
    else:
        schema = _server_schema(url, label)
        if _is_mcp_action(actions) or "tool_name" in schema.get("properties", {}):
            tools = _server_mcp_tools(url, label)
        else:
            tools = [tool_of_action(None, json_schema=schema)]
    return _episode_class(label, lambda: _Remote(factory(), label), tools, reward, remote=True)


def _server_schema(url: str, label: str) -> dict:
    """The server's action schema (its GET /schema)."""
    import requests

    http = "http" + url[len("ws") :] if url.startswith("ws") else url
    try:
        response = requests.get(http.rstrip("/") + "/schema", timeout=30)
        response.raise_for_status()
        return response.json()["action"]
    except Exception as err:
        raise UserError(
            f"environment {label!r}: could not read the server's action schema at /schema ({one_line(describe(err))}); "
            "is it running? (or name its Action class in rollout.environment_action)"
        ) from None


def _server_mcp_tools(url: str, label: str) -> list[Tool]:
    from openenv.core.generic_client import GenericEnvClient

    try:
        with GenericEnvClient(base_url=url).sync() as client:
            listed = client.step({"type": "list_tools"})
    except Exception as err:
        raise UserError(f"environment {label!r}: could not list the server's tools ({describe(err)})") from None
    return [_tool_of_mcp(t) for t in _fields(listed.observation).get("tools", [])]
