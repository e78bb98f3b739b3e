"""verifiers' v1 tasksets as rows and an agent program (the `verifiers` extra; docs/tools.md#verifiers-tasksets).

`data.path: "verifiers:ID"` loads the taskset ID (a module exporting its `vf.Taskset` through
`__all__`, as verifiers names tasksets; `data.task_options` are its config's fields): each of
its tasks is a row, its prompt as chat messages, and `rollout.agent: "grpo.rollout.verifiers_env:agent"`
runs a row's task as one episode: verifiers' own rollout (task setup, the task's MCP `Toolset`s,
its interception server, finalize and scoring) with an in-process harness, `InProcessHarness`,
that owns the turn loop and calls the model through the interception server, whose client
config (an `EvalClientConfig`) has the episode's endpoint (`grpo.rollout.agents`) as base_url.
The episode's reward is the trace's, the weighted sum of the task's `@vf.reward`s; its metrics
and each reward's score are logged as agent/<name>.

Not covered: tasks that need a container (docker or Prime sandboxes), tasks without a prompt
(a simulated user opens them), multi-agent envs and group rewards. The task's harness-owned
tools (bash, edit) are the stock harnesses', which install their programs at every start.
"""

from __future__ import annotations

import functools
import importlib
import ipaddress
import json
import socket
import sys
import typing
from contextlib import AsyncExitStack
from urllib.parse import urlsplit

from grpo.errors import UserError
from grpo.infra.imports import describe, one_line

try:
    import verifiers.v1 as vf
    from verifiers.v1.mcp import serve_shared
except ImportError as err:  # the extra is missing: say how to get it, in one line
    raise UserError(
        f"verifiers tasksets need the verifiers extra: pip install 'grpo[verifiers]' ({describe(err)})"
    ) from err

__all__ = ["PREFIX", "InProcessHarness", "agent", "make_rows"]

PREFIX = "verifiers:"  # a data path naming a taskset (registered in grpo.data.SOURCES)
TASKSET_COLUMN, OPTIONS_COLUMN, TASK_COLUMN = "verifiers_taskset", "verifiers_options", "verifiers_task"
# verifiers 0.4.0 resolves a harness id as a top-level module exporting its Harness through
# __all__ (a dotted id is looked up under its own harness package and fails): this module
# answers to that name too.
HARNESS_ID = "grpo_in_process_harness"
API_KEY_VAR = "GRPO_VERIFIERS_API_KEY"  # unset: the endpoint takes any key ("EMPTY")


# ---- the harness ------------------------------------------------------------------------------


class InProcessHarness(vf.Harness[vf.HarnessConfig]):
    """A chat loop in this process: the task's prompt, then the model through the interception
    server at `endpoint` until it answers without tool calls; each call goes to the task's MCP
    tool servers (`mcp_urls`, tools named `<server>_<tool>` as verifiers' chat programs name
    them) and its result goes back as a tool message. Installs nothing."""

    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_MCP = True
    SUPPORTS_RESUME = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, tool_interception_url=None):
        from openai import APIStatusError, AsyncOpenAI

        system, prompt = self.resolve_prompt(data)
        messages = [{"role": "system", "content": system}] if system else []
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        else:
            messages += [m.model_dump(mode="json", exclude_none=True) for m in prompt or []]
        async with AsyncExitStack() as stack:
            tools, servers = await _connect(stack, mcp_urls, self.config.tool_timeout)
            client = await stack.enter_async_context(AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0))
            while True:
                try:
                    kwargs = {"tools": tools} if tools else {}
                    completion = await client.chat.completions.create(model=ctx.model, messages=messages, **kwargs)
                except APIStatusError:
                    if trace.stop_condition is not None:  # a limit or a @stop refused the turn: the run is over
                        break
                    raise
                message = completion.choices[0].message
                messages.append(message.model_dump(mode="json", exclude_none=True))
                if not message.tool_calls:
                    break
                for call in message.tool_calls:
                    content = await _call_tool(servers, call.function.name, call.function.arguments)
                    messages.append(
                        {"role": "tool", "tool_call_id": call.id, "name": call.function.name, "content": content}
                    )
        return vf.ProgramResult(exit_code=0, stdout="", stderr="")


async def _connect(stack: AsyncExitStack, mcp_urls: dict[str, str], timeout: float):
    """The tools of the episode's MCP servers as OpenAI tool schemas, and name -> (client, tool)."""
    from mcp import Client

    tools, servers = [], {}
    for name, url in mcp_urls.items():
        try:
            client = await stack.enter_async_context(Client(url, read_timeout_seconds=timeout))
            listed = await client.list_tools()
        except Exception as err:
            cause = err
            while isinstance(cause, BaseExceptionGroup) and cause.exceptions:  # the MCP client's task group
                cause = cause.exceptions[0]
            said = f"{_NETWORK} ({describe(cause)})" if not _loopback(url) else describe(cause)
            raise vf.HarnessError(f"tool server {name!r} at {url}: {said}") from err
        for tool in listed.tools:
            full = f"{name}_{tool.name}" if name else tool.name
            schema = {"name": full, "description": tool.description or "", "parameters": tool.input_schema}
            tools.append({"type": "function", "function": schema})
            servers[full] = (client, tool.name)
    return tools, servers


async def _call_tool(servers: dict, name: str, arguments: str | None) -> str:
    """One tool call's result as text; a call the model wrote wrong is an error message to it."""
    if name not in servers:
        return f"error: unknown tool {name!r}"
    try:
        parsed = json.loads(arguments or "{}")
    except json.JSONDecodeError as err:
        return f"error: the arguments are not JSON ({err})"
    if not isinstance(parsed, dict):
        return "error: the arguments must be a JSON object"
    client, tool = servers[name]
    result = await client.call_tool(tool, parsed)
    texts = [block.text if getattr(block, "type", None) == "text" else str(block) for block in result.content]
    return "\n".join(texts)


# ---- the taskset ------------------------------------------------------------------------------

_NETWORK = "the taskset needs the network, which this machine cannot reach"
_NETWORK_ERRORS = ("ConnectError", "ConnectTimeout", "LocalEntryNotFoundError", "OfflineModeIsEnabled")
_NETWORK_WORDS = ("name or service not known", "temporary failure in name resolution", "network is unreachable")


def _loopback(url: str) -> bool:
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _needs_network(err: BaseException) -> bool:
    """Whether `err` (or what caused it) is a failed connection or name lookup."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        text = str(err).lower()
        if isinstance(err, (ConnectionError, socket.gaierror)) or type(err).__name__ in _NETWORK_ERRORS:
            return True
        if any(word in text for word in _NETWORK_WORDS):
            return True
        err = err.__cause__ or err.__context__
    return False


def _config_type(cls: type) -> type:
    """The TasksetConfig subclass a Taskset class declares (`Taskset[TaskT, ConfigT]`)."""
    for klass in cls.__mro__:
        for base in getattr(klass, "__orig_bases__", ()):
            for arg in typing.get_args(base):
                if isinstance(arg, type) and issubclass(arg, vf.TasksetConfig):
                    return arg
    return vf.TasksetConfig


def _taskset_class(ident: str, where: str) -> type:
    """The Taskset class `ident` names: 'module' (its __all__ exports one, verifiers' way) or
    'module:Class'."""
    module_name, _, attr = ident.partition(":")
    try:
        # verifiers' own loader also finds its bundled tasksets by a bare name
        module = importlib.import_module(module_name) if "." in module_name else vf.import_taskset(module_name)
    except ImportError as err:
        raise UserError(f"{where}: cannot import the taskset {module_name!r} ({describe(err)})") from err
    names = [attr] if attr else getattr(module, "__all__", [])
    found = [getattr(module, n, None) for n in names]
    found = [c for c in found if isinstance(c, type) and issubclass(c, vf.Taskset) and c is not vf.Taskset]
    if len(found) != 1:
        what = f"no Taskset {attr!r}" if attr else f"{len(found)} Taskset classes in __all__ (name one: module:Class)"
        raise UserError(f"{where}: module {module_name!r} has {what}")
    return found[0]


@functools.cache
def _load(ident: str, options: str) -> tuple:
    """The taskset `ident` with its config's `options` (JSON), and its tasks, loaded once per
    process (make_rows and every episode's agent share them)."""
    where = f"data.path: {PREFIX}{ident}"
    cls = _taskset_class(ident, where)
    try:
        config = _config_type(cls).model_validate({**json.loads(options), "id": ident})
    except Exception as err:
        raise UserError(f"data.task_options: not the taskset's config ({one_line(str(err))})") from None
    taskset = cls(config)
    if not taskset.bounded:
        raise UserError(f"{where}: the taskset is infinite; grpo trains on a bounded one (a Taskset view, take(n))")
    try:
        tasks = list(taskset)
    except Exception as err:
        if _needs_network(err):
            raise UserError(f"{where}: {_NETWORK} to load its tasks ({describe(err)})") from err
        raise UserError(f"{where}: loading its tasks failed ({describe(err)})") from err
    for task in tasks:
        if task.data.prompt is None:
            raise UserError(
                f"{where}: task {task.data.idx} has no prompt (a simulated user opens it), which grpo does not run"
            )
    return taskset, tasks


def _prompt(data) -> list[dict]:
    """A task's prompt as the chat messages the harness sends first."""
    messages = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
    if isinstance(data.prompt, str):
        return messages + [{"role": "user", "content": data.prompt}]
    return messages + [m.model_dump(mode="json", exclude_none=True) for m in data.prompt]


def make_rows(path: str, *, prompt_column: str = "prompt", task_options: dict | None = None) -> list[dict]:
    """The rows a 'verifiers:ID' data path names, one a task: its prompt (under
    `prompt_column`), and for the agent the taskset, its options and the task's index."""
    ident, options = path[len(PREFIX) :], json.dumps(dict(task_options or {}), sort_keys=True)
    if not ident:
        raise UserError(f"data.path: {path!r}: name the taskset, 'verifiers:ID'")
    _, tasks = _load(ident, options)
    return [
        {prompt_column: _prompt(t.data), TASKSET_COLUMN: ident, OPTIONS_COLUMN: options, TASK_COLUMN: i}
        for i, t in enumerate(tasks)
    ]


# ---- the agent --------------------------------------------------------------------------------


async def agent(base_url: str, row: dict, *, model: str) -> dict:
    """rollout.agent for the rows of a 'verifiers:ID' data path: the row's task as one episode
    (module doc), its model calls through `base_url`; the trace's reward and its metrics."""
    if TASK_COLUMN not in row:
        raise UserError(
            f"grpo.rollout.verifiers_env:agent runs the rows of a data.path '{PREFIX}ID', not {sorted(row)}"
        )
    taskset, tasks = _load(row[TASKSET_COLUMN], row[OPTIONS_COLUMN])
    task = tasks[row[TASK_COLUMN]]
    config = vf.AgentConfig(
        harness=vf.HarnessConfig(id=HARNESS_ID),
        runtime=vf.SubprocessConfig(),
        model=model,
        client=vf.EvalClientConfig(base_url=base_url, api_key_var=API_KEY_VAR),
    )
    runner = vf.make_agent(config)
    async with serve_shared(taskset.toolsets(taskset.config)) as shared:
        trace = await runner.run(task, tools=shared)
    if not trace.ok:
        error = trace.last_error
        text = f"{error.type}: {one_line(error.message)}" if error else "failed"
        said = text.lower()
        if _NETWORK not in said and any(word in said for word in _NETWORK_WORDS):  # a name lookup failed
            text = f"{_NETWORK} ({text})"
        raise RuntimeError(f"the episode of task {task.data.idx} failed: {text}")
    metrics = {name: value for name, value in trace.metrics.items() if value is not None}
    metrics |= {name: r.score for name, r in trace.rewards.items() if r is not None}
    return {"reward": trace.reward, "metrics": metrics}


sys.modules.setdefault(HARNESS_ID, sys.modules[__name__])
