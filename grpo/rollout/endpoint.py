"""An OpenAI-compatible chat-completions endpoint over the policy, for agent programs
(rollout.agent; docs/tools.md#agent-programs-the-openai-compatible-endpoint).

While a step's agent rollouts run (`grpo.rollout.agents`), `Endpoint` serves HTTP on
127.0.0.1 at a port the system picks, each episode under a base URL of its own,
`/episodes/<id>/v1`: `POST .../chat/completions` and `GET .../models`, in vLLM's dialect of
OpenAI's API (the assistant message with its `tool_calls`, `logprobs.content`, and vLLM's
`prompt_token_ids` and `choices[].token_ids`, which its `return_token_ids` asks for; here
they are always there). The server parses and answers, nothing more: a request waits in
`Requests` until the thread that holds the model takes it with the others waiting (all the
live episodes' requests, or those that came within `WINDOW` seconds of the first) and
decodes them in one call. Whatever goes wrong with a request is answered as OpenAI answers
it, `{"error": {"message", "type", "param", "code"}}`, never by a crash of the run.
"""

from __future__ import annotations

import json
import re
import threading
import time
import uuid
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

__all__ = ["WINDOW", "ChatRequest", "Endpoint", "EndpointError", "Requests", "completion_body", "parse_chat"]

# Seconds a request waits for others to join its decoding call while some live episode has none
# waiting (its agent is busy elsewhere: a tool, a sandbox); once every live episode waits, at once.
WINDOW = 0.2
MAX_BODY = 64 * 2**20  # bytes of one request's JSON
_ROUTE = re.compile(r"^/episodes/([A-Za-z0-9_.-]+)/v1/(chat/completions|models)/?$")


class EndpointError(Exception):
    """A request the endpoint refuses: its HTTP status and OpenAI's error object."""

    def __init__(self, message: str, status: int = HTTPStatus.BAD_REQUEST, param: str | None = None):
        super().__init__(message)
        self.message, self.status, self.param = message, int(status), param

    def body(self) -> dict:
        kind = {400: "BadRequestError", 404: "NotFoundError", 409: "ConflictError"}.get(
            self.status, "InternalServerError"
        )
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.status}}


# ---- the request ------------------------------------------------------------------------------


@dataclass
class ChatRequest:
    """One `chat/completions` request of one episode, parsed (`parse_chat`), and its answer
    once the model's thread has given it (`answer`; `wait` blocks the server's thread)."""

    episode: str
    messages: list[dict]  # normalised: content a string, tool-call arguments objects
    tools: list[dict] | None
    max_tokens: int | None
    parse_tools: bool  # tool_choice is not "none": the model's tool calls are parsed
    model: str
    arrived: float = field(default_factory=time.monotonic)
    status: int = 0
    response: dict | None = None
    done: threading.Event = field(default_factory=threading.Event)

    def answer(self, response: dict, status: int = HTTPStatus.OK) -> None:
        self.response, self.status = response, int(status)
        self.done.set()

    def refuse(self, error: EndpointError) -> None:
        self.answer(error.body(), error.status)


def _text(content, where: str) -> str:
    """A message's content as one string: a string, None, or OpenAI's list of text parts."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    raise EndpointError(f"{where}.content: a string or a list of text parts (no images or audio here)", param=where)


def _tool_calls(calls, where: str) -> list[dict]:
    """An assistant message's tool calls as the chat template takes them: arguments an object."""
    if not isinstance(calls, list):
        raise EndpointError(f"{where}.tool_calls: must be a list", param=where)
    out = []
    for k, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        arguments = function.get("arguments", {}) if isinstance(function, dict) else None
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError:
                pass
        if not isinstance(name, str) or not isinstance(arguments, dict):
            raise EndpointError(
                f'{where}.tool_calls[{k}]: expected {{"function": {{"name": str, "arguments": JSON object}}}}',
                param=where,
            )
        entry = {"type": "function", "function": {"name": name, "arguments": arguments}}
        if isinstance(call.get("id"), str):
            entry["id"] = call["id"]
        out.append(entry)
    return out


def normalise(message, where: str) -> dict:
    """One chat message as the chat template renders it (`_text`, `_tool_calls`)."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise EndpointError(f'{where}: a message is {{"role": str, "content": ...}}', param=where)
    out = {key: value for key, value in message.items() if value is not None}
    out["content"] = _text(message.get("content"), where)
    if message.get("tool_calls"):
        out["tool_calls"] = _tool_calls(message["tool_calls"], where)
    else:
        out.pop("tool_calls", None)
    return out


def parse_chat(episode: str, body) -> ChatRequest:
    """A `chat/completions` body checked and read. The run's sampling settings win over the
    request's: temperature, top_p, top_k, min_p, penalties, seed and stop are not read (the
    loss scores the run's distribution); max_tokens (or max_completion_tokens) is, within
    the episode's budget."""
    if not isinstance(body, dict):
        raise EndpointError("the request body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise EndpointError("messages: a non-empty list of chat messages is required", param="messages")
    if body.get("stream"):
        raise EndpointError("stream: streaming is not supported by this endpoint; send stream: false", param="stream")
    if body.get("n", 1) not in (1, None):
        raise EndpointError("n: an episode samples one completion per request (n: 1)", param="n")
    tools = body.get("tools") or None
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise EndpointError("tools: a list of tool objects", param="tools")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
        raise EndpointError("max_tokens: must be an integer >= 1", param="max_tokens")
    return ChatRequest(
        episode=episode,
        messages=[normalise(m, f"messages[{i}]") for i, m in enumerate(messages)],
        tools=tools,
        max_tokens=max_tokens,
        parse_tools=tools is not None and body.get("tool_choice") != "none",
        model=str(body.get("model") or ""),
    )


def completion_body(
    request: ChatRequest,
    message: dict,
    finish_reason: str,
    prompt_ids: list[int],
    token_ids: list[int],
    logprobs: list[float] | None,
    tokens: list[str],
) -> dict:
    """The `chat.completion` object of one answer, as vLLM writes it (`tokens`: each sampled
    token's text, for `logprobs.content`; `logprobs` None: the decoder gives none)."""
    content = None
    if logprobs is not None:
        content = [
            {"token": text, "logprob": lp, "bytes": list(text.encode()), "top_logprobs": []}
            for text, lp in zip(tokens, logprobs)
        ]
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": request.model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "logprobs": None if content is None else {"content": content},
                "finish_reason": finish_reason,
                "stop_reason": None,
                "token_ids": token_ids,
            }
        ],
        "usage": {
            "prompt_tokens": len(prompt_ids),
            "completion_tokens": len(token_ids),
            "total_tokens": len(prompt_ids) + len(token_ids),
        },
        "prompt_token_ids": prompt_ids,
    }


# ---- the queue between the server's threads and the model's -----------------------------------


class Requests:
    """The requests waiting for the model, one at most per episode, and which episodes are
    live (their agent has not returned). `submit` (a server thread) waits for the answer;
    `take` (the model's thread) gives the next batch to decode."""

    def __init__(self, episodes: list[str], window: float = WINDOW):
        self.live, self.window = set(episodes), window
        self.known = set(episodes)
        self.waiting: dict[str, ChatRequest] = {}
        self.closed = False
        self.changed = threading.Condition()

    def submit(self, request: ChatRequest) -> None:
        """Queue `request` and wait until it is answered (or refused here)."""
        with self.changed:
            error = None
            if request.episode not in self.known:
                error = EndpointError(f"no episode {request.episode!r} on this endpoint", HTTPStatus.NOT_FOUND)
            elif self.closed or request.episode not in self.live:
                error = EndpointError(f"episode {request.episode!r} is over (its rollout step has ended)")
            elif request.episode in self.waiting:
                error = EndpointError(
                    f"episode {request.episode!r} has a request under way; an episode sends one at a time",
                    HTTPStatus.CONFLICT,
                )
            if error is not None:
                request.refuse(error)
                return
            self.waiting[request.episode] = request
            self.changed.notify_all()
        request.done.wait()

    def finish(self, episode: str) -> None:
        """`episode`'s agent has returned: the batch no longer waits for it."""
        with self.changed:
            self.live.discard(episode)
            self.changed.notify_all()

    def take(self) -> list[ChatRequest] | None:
        """The next batch: every waiting request once each live episode has one waiting, or
        once the first has waited `window` seconds; None when no episode is live (or after
        `close`) and nothing waits."""
        with self.changed:
            while True:
                if self.waiting and (len(self.waiting) >= len(self.live) or self._oldest() >= self.window):
                    batch, self.waiting = list(self.waiting.values()), {}
                    return batch
                if not self.waiting and (self.closed or not self.live):
                    return None
                self.changed.wait(None if not self.waiting else max(self.window - self._oldest(), 0.0) + 1e-3)

    def _oldest(self) -> float:
        return time.monotonic() - min(r.arrived for r in self.waiting.values())

    def close(self, reason: str = "the rollout step has ended") -> None:
        """Refuse what waits and whatever comes next."""
        with self.changed:
            self.closed = True
            for request in self.waiting.values():
                request.refuse(EndpointError(f"episode {request.episode!r} is over ({reason})"))
            self.waiting = {}
            self.changed.notify_all()


# ---- the server -------------------------------------------------------------------------------


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as OpenAI's clients use it
    server: _Server

    def log_message(self, format, *args) -> None:  # no line per request on the run's stderr
        pass

    def _send(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except OSError:  # the client has gone (its own timeout): nothing to tell it
            self.close_connection = True

    def _route(self, kind: str) -> str:
        found = _ROUTE.match(self.path.split("?", 1)[0])
        if found is None or found.group(2) != kind:
            raise EndpointError(
                f"no route {self.command} {self.path}; an episode's base URL is /episodes/<id>/v1 "
                "(POST /chat/completions, GET /models)",
                HTTPStatus.NOT_FOUND,
            )
        return found.group(1)

    def do_GET(self) -> None:
        try:
            episode = self._route("models")
            if episode not in self.server.requests.known:
                raise EndpointError(f"no episode {episode!r} on this endpoint", HTTPStatus.NOT_FOUND)
            card = {"id": self.server.model, "object": "model", "created": int(time.time()), "owned_by": "grpo"}
            self._send(HTTPStatus.OK, {"object": "list", "data": [card]})
        except EndpointError as err:
            self._send(err.status, err.body())

    def do_POST(self) -> None:
        try:
            episode = self._route("chat/completions")
            length = int(self.headers.get("Content-Length") or -1)
            if not 0 <= length <= MAX_BODY:
                raise EndpointError(f"the request needs a Content-Length of at most {MAX_BODY} bytes of JSON")
            raw = self.rfile.read(length)
            try:
                body = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as err:
                raise EndpointError(f"the request body is not JSON ({err})") from None
            request = parse_chat(episode, body)
            request.model = request.model or self.server.model
            self.server.requests.submit(request)
            self._send(request.status, request.response)
        except EndpointError as err:
            self._send(err.status, err.body())
        except Exception as err:  # a bug of ours: the request fails, the run goes on
            self._send(500, EndpointError(f"internal error: {type(err).__name__}: {err}", 500).body())


class _Server(ThreadingHTTPServer):
    daemon_threads = True  # a client that hangs on never holds the run
    block_on_close = False

    def __init__(self, requests: Requests, model: str):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.requests, self.model = requests, model


class Endpoint:
    """The HTTP server of one step's episodes (module doc), serving from a thread of its own
    until `close` (or the end of its `with` block)."""

    def __init__(self, requests: Requests, model: str):
        self.requests = requests
        self.server = _Server(requests, model)
        # A short poll: `close` waits for the serving loop to see it, at the end of every step.
        self.thread = threading.Thread(
            target=self.server.serve_forever, args=(0.05,), name="grpo endpoint", daemon=True
        )
        self.thread.start()

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def base_url(self, episode: str) -> str:
        """The OpenAI API root of `episode`: what a client takes as its base_url."""
        return f"{self.url}/episodes/{episode}/v1"

    def close(self) -> None:
        self.requests.close()
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self) -> Endpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
