"""A `grpo vllm-serve` without vLLM, for the trainer's side of server mode in .venv: the
server's own HTTP handler (grpo.vllm.server.handler) in front of a transformers model that
answers its four routes as the engine would (the pushed weights loaded, the check's log-probs
computed, completions sampled with temperature and min/max new tokens), on a thread of this
process. `die_at` (`die_at_push`): the generate request (the push) that finds the server gone,
as if killed: the connection closes without an answer, and the port refuses every request after it.
`drop_at`: the generate request left unanswered (its connection closed), the server serving on. As the real
server, it refuses a request whose push token is not that of the weights it holds (HTTP 409);
`log` lists what it did (pushes and generate requests, in order), for a test to read."""

from __future__ import annotations

import inspect
import os
import threading
import uuid
from http.server import ThreadingHTTPServer

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from grpo.vllm.client import API, fingerprint, identity
from grpo.vllm.server import Served, handler


class FakeServed:
    """What the handler calls (grpo.vllm.server.Served's methods), on a transformers model."""

    def __init__(
        self,
        model: str,
        die: callable,
        die_at: int | None = None,
        die_at_push: int | None = None,
        drop_at: int | None = None,
    ):
        self.model = AutoModelForCausalLM.from_pretrained(model, torch_dtype=torch.float32).eval()
        self.identity = identity(self.model.config)
        self.die, self.die_at, self.die_at_push, self.drop_at = die, die_at, die_at_push, drop_at
        self.lock = threading.Lock()
        self.token, self.pushes, self.generated = None, 0, 0
        # ("push", token, the weights' sum) and ("generate", counts, pushes, token): what it served, in order
        self.log: list[tuple] = []
        self.info = {
            "api": API,
            "model": model,
            "identity": self.identity,
            "fingerprint": fingerprint(self.identity),
            "dtype": "float32",
            "max_model_len": self.model.config.max_position_embeddings,
            "grpo": "test",
            "vllm": "none",
            "boot": uuid.uuid4().hex,
        }

    def health(self, _body=None) -> dict:
        return {**self.info, "pushes": self.pushes}

    _holds = Served._holds  # the real server's refusal of weights it no longer holds

    def weights(self, body: dict) -> dict:
        if "probe" in body:
            return {"readable": os.path.isdir(body["probe"])}
        from safetensors.torch import load_file

        if self.pushes + 1 == self.die_at_push:
            self.die()
        with self.lock:
            weights = load_file(body["path"])
            self.model.load_state_dict(weights, strict=False)
            self.token = body.get("token")
            self.pushes += 1
            self.log.append(("push", self.token, sum(float(t.double().sum()) for t in weights.values())))
        return {"seconds": 0.0, "pushes": self.pushes}

    def prompt_logprobs(self, body: dict) -> dict:
        ids = list(body["ids"])
        with self.lock, torch.no_grad():
            self._holds(body)
            logits = self.model(input_ids=torch.tensor([ids])).logits[0, :-1]
        picked = logits.log_softmax(-1).gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)
        return {"logprobs": picked.tolist()}

    def generate(self, body: dict) -> dict:
        self.generated += 1
        if self.generated == self.die_at:
            self.die()
        if self.generated == self.drop_at:
            raise _Gone
        params = body["params"]
        outputs = []
        with self.lock, torch.no_grad():
            self._holds(body)
            self.log.append(("generate", list(body["counts"]), self.pushes, body.get("weights")))
            for prompt, count, seed in zip(body["prompts"], body["counts"], body["seeds"]):
                generator = torch.Generator().manual_seed(seed)
                outputs.append(self._group(prompt, count, params, generator))
        return {"outputs": outputs}

    def _group(self, prompt: list[int], count: int, params: dict, generator: torch.Generator) -> list:
        """`count` completions of `prompt`, decoded side by side on one KV cache."""
        eos = list(params["eos_token_ids"])
        cache = DynamicCache()  # the forward's argument is `cache` in recent transformers, `past_key_values` before
        name = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"
        out = self.model(input_ids=torch.tensor([prompt] * count), use_cache=True, **{name: cache})
        completions = [[[], []] for _ in range(count)]
        done = [False] * count
        for t in range(params["max_new_tokens"]):
            logits = out.logits[:, -1] / params["temperature"]  # (count, V)
            if t < params["min_new_tokens"]:
                logits[:, eos] = -float("inf")
            distribution = logits.log_softmax(-1)
            tokens = torch.multinomial(distribution.exp(), 1, generator=generator)  # (count, 1)
            for i, token in enumerate(tokens[:, 0].tolist()):
                if not done[i]:
                    completions[i][0].append(token)
                    completions[i][1].append(float(distribution[i, token]))
                    done[i] = token in eos
            if all(done):
                break
            out = self.model(input_ids=tokens, use_cache=True, **{name: cache})
        return completions


class _Gone(BaseException):
    """Raised through the handler's error answers: the request is left unanswered."""


class FakeServer:
    """A FakeServed behind the real handler on 127.0.0.1 (`address`), until `close` (or its death)."""

    def __init__(self, model: str, **faults):
        """`faults`: FakeServed's die_at, die_at_push and drop_at."""
        self.http = ThreadingHTTPServer(("127.0.0.1", 0), None)
        self.http.daemon_threads = True
        self.served = FakeServed(model, self._die, **faults)

        class Dying(handler(self.served)):
            def do_POST(self):
                try:
                    super().do_POST()
                except _Gone:
                    self.close_connection = True  # closed, no answer: as a killed server's socket

        self.http.RequestHandlerClass = Dying
        self.address = "{}:{}".format(*self.http.server_address[:2])
        self.thread = threading.Thread(target=self.http.serve_forever, daemon=True)
        self.thread.start()
        self.gone = False

    def _die(self):
        """Stop listening (on a thread of its own: `shutdown` waits for the serving loop), and
        leave this request unanswered."""
        self.gone = True
        threading.Thread(target=self.close, daemon=True).start()
        raise _Gone

    def close(self):
        self.http.shutdown()
        self.http.server_close()
