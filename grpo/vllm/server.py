"""`grpo vllm-serve`: one vLLM engine in its own process, for a trainer elsewhere (server mode,
`rollout.vllm.server: HOST:PORT`; the client is grpo.vllm.client).

The process holds one `LocalEngine`, built from a model directory as a trainer's colocated
engine is, and answers a small JSON API over HTTP (`handler`: health, generate, weights by
file push, prompt log-probs), one request at a time. Every request names the weights it
expects (the token of the trainer's last push), and a server that holds others since (another
trainer's push, a restart) refuses it. The user's guide: docs/vllm-server.md.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Literal

from grpo.config.fields import REQUIRED, opt
from grpo.errors import UserError
from grpo.refusals import refusal
from grpo.vllm.client import API, TRANSPORTS, fingerprint, identity


@dataclass
class ServeConfig:
    """What `grpo vllm-serve` builds and where it listens."""

    model: str = opt(REQUIRED, "The model's Hugging Face directory (or hub id): the trainer's rollout model.")
    host: str = opt("127.0.0.1", "The address to listen on (0.0.0.0: every interface; the API has no authentication).")
    port: int = opt(8000, "The port to listen on (0: any free one, printed when it is ready).")
    dtype: Literal["float32", "bfloat16", "float16"] = opt(
        "float32",
        "The engine's dtype: the trainer's rollout.vllm.dtype must be this or auto (the check's tolerance follows it).",
    )
    max_model_len: int | None = opt(None, "The longest prompt + completion, in tokens. Default: the model's positions.")
    max_num_seqs: int = opt(256, "Sequences the engine decodes at once (vLLM's max_num_seqs).")
    gpu_memory_utilization: float = opt(
        0.9, "CUDA: the share of the GPU's memory the engine takes (a server has its GPU to itself)."
    )
    kv_cache_gb: int = opt(
        1, "CPU: the engine's KV cache, in GiB (VLLM_CPU_KVCACHE_SPACE; an environment value set wins)."
    )
    seed: int = opt(0, "The engine's seed (each generate request also seeds its own prompts).")


# ServeConfig's fields that are LocalEngine's keywords of the same names.
ENGINE_FLAGS = ("max_model_len", "max_num_seqs", "seed", "gpu_memory_utilization", "kv_cache_gb")


class Served:
    """The engine and what it holds; every engine call under one lock."""

    def __init__(self, config: ServeConfig, device):
        from grpo.infra.hf import load_causal_lm
        from grpo.vllm.engine import LocalEngine

        model = load_causal_lm(config.model, config.dtype, key="--model")
        self.identity = identity(model.config)
        engine = {name: getattr(config, name) for name in ENGINE_FLAGS}
        self.engine = LocalEngine(model, device=device, dtype=model.dtype, **engine)
        self.engine.sync(
            model, check=True, tolerance=1e-3 if config.dtype == "float32" else 5e-2
        )  # the directory's weights
        vllm_config = self.engine.llm.llm_engine.vllm_config
        del model
        self.lock = threading.Lock()
        self.token = None  # the last push's (None: the directory's weights)
        self.pushes = 0
        self.info = self._info(config, vllm_config.model_config.max_model_len)

    def _info(self, config: ServeConfig, max_model_len: int) -> dict:
        import vllm

        from grpo import __version__

        return {
            "api": API,
            "model": config.model,
            "identity": self.identity,
            "fingerprint": fingerprint(self.identity),
            "dtype": str(self.engine.dtype).removeprefix("torch."),
            "max_model_len": max_model_len,
            "grpo": __version__,
            "vllm": vllm.__version__,
            "boot": uuid.uuid4().hex,
        }

    def health(self, _body=None) -> dict:
        return {**self.info, "pushes": self.pushes}

    def _holds(self, body: dict) -> None:
        token = body.get("weights")
        if token is not None and token != self.token:
            raise Conflict(
                "it holds other weights than this trainer pushed (another trainer pushed since, or the server "
                "restarted): one trainer per server"
            )

    def generate(self, body: dict) -> dict:
        from grpo.rollout.params import SamplingParams

        params = dict(body["params"])
        params["eos_token_ids"] = tuple(params.get("eos_token_ids", ()))
        params = SamplingParams(**params)
        prompts, counts, seeds = body["prompts"], body["counts"], body["seeds"]
        if not len(prompts) == len(counts) == len(seeds):
            raise UserError("prompts, counts and seeds must be lists of one length")
        with self.lock:
            self._holds(body)
            outputs = self.engine.sample(prompts, params, counts, seeds)
        return {"outputs": [[[ids, logprobs] for ids, logprobs in rows] for rows in outputs]}

    def prompt_logprobs(self, body: dict) -> dict:
        with self.lock:
            self._holds(body)
            return {"logprobs": self.engine.prompt_logprobs(list(body["ids"]))}

    def weights(self, body: dict) -> dict:
        transport = body.get("transport")
        if transport not in TRANSPORTS:
            raise UserError(refusal("transport-nccl", transport=repr(transport)))
        if "probe" in body:
            return {"readable": os.path.isdir(body["probe"]) and os.access(body["probe"], os.R_OK)}
        path = body["path"]
        if not os.path.isfile(path):
            raise UserError(f"no file {path} here (transport file needs the trainer and the server on one machine)")
        from safetensors import safe_open

        with self.lock:
            start = time.perf_counter()
            self.token = None  # half-loaded weights are nobody's
            with safe_open(path, framework="pt") as f:
                self.engine.load_weights((name, f.get_tensor(name)) for name in f.keys())
            self.token = body.get("token")
            self.pushes += 1
            seconds = time.perf_counter() - start
        return {"seconds": seconds, "pushes": self.pushes}


class Conflict(UserError):
    """A request for weights the server no longer holds (HTTP 409)."""


ROUTES = {
    ("GET", "/health"): "health",
    ("POST", "/generate"): "generate",
    ("POST", "/weights"): "weights",
    ("POST", "/prompt_logprobs"): "prompt_logprobs",
}


def handler(served: Served) -> type[BaseHTTPRequestHandler]:
    """The HTTP API (the standard library's server, one thread per connection), as
    docs/vllm-server.md tables it: GET /health, POST /generate (`LocalEngine.sample`), POST
    /weights (a file push, or `probe: FOLDER`: whether this process sees it; any other
    transport is refused), POST /prompt_logprobs. A refusal is HTTP 400 (409 for weights no
    longer held) with {error: one line}; an engine failure is 500, and serving goes on."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _answer(self, status: int, payload: dict) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _route(self, method: str) -> None:
            name = ROUTES.get((method, self.path))
            if name is None:
                return self._answer(
                    404, {"error": f"no {method} {self.path} (routes: {', '.join(p for _, p in ROUTES)})"}
                )
            try:
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else {}
                return self._answer(200, getattr(served, name)(body))
            except Conflict as err:
                return self._answer(409, {"error": str(err)})
            except (UserError, ValueError, KeyError, TypeError) as err:  # a request we cannot take
                return self._answer(400, {"error": _one_line(err)})
            except Exception as err:  # the engine's: said, and the server goes on
                print(f"grpo vllm-serve: {self.path}: {_one_line(err)}", file=sys.stderr, flush=True)
                return self._answer(500, {"error": _one_line(err)})

        def do_GET(self):
            self._route("GET")

        def do_POST(self):
            self._route("POST")

        def log_message(self, format, *args):  # no line per request: a run makes several per step
            pass

    return Handler


def _one_line(err: BaseException) -> str:
    from grpo.infra.imports import describe

    return str(err) if isinstance(err, UserError) else describe(err)


def serve(config: ServeConfig, device: str = "auto", ready=None) -> None:
    """Take the port (a busy one fails at once), build the engine, then answer requests until
    interrupted; `ready(address, info)` is called once it answers (the command prints a line).
    A trainer that asks meanwhile waits in the listen queue (and gives up after its health
    timeout)."""
    from grpo.infra.devices import resolve_device

    try:
        server = ThreadingHTTPServer((config.host, config.port), None, bind_and_activate=True)
    except OSError as err:
        raise UserError(f"cannot listen on {config.host}:{config.port} ({err.strerror or err})") from None
    try:
        served = Served(config, resolve_device(device, "--device"))
        server.RequestHandlerClass = handler(served)
        server.daemon_threads = True
        host, port = server.server_address[:2]
        if ready is not None:
            ready(f"{host}:{port}", served.info)
        try:
            server.serve_forever()
        finally:
            served.engine.close()
    finally:
        server.server_close()
