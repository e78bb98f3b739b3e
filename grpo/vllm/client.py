"""The trainer's side of server mode (`rollout.vllm.server: HOST:PORT`; docs/vllm-server.md):
`RemoteEngine`, a `grpo vllm-serve` server behind the `LocalEngine` methods `VllmDecoder`
calls, so that one decoder runs both. Nothing here imports vLLM.

Before the first step (`remote_engine`) the server must answer, hold the policy's model
(`identity`: the architecture's shapes and options) in the run's dtype and length, and read
the trainer's files; each refusal, and a server gone mid-run, is one line. A push writes
`policy_weights` (the tied head as its own copy: safetensors refuses shared memory) into one
safetensors file, in /dev/shm where there is one, that the server loads and the trainer then
deletes (transport `file`: one machine; `nccl` is a refused row); the colocated engine's
check follows. Each push's token rides on every later generate request, so a server that
restarted or took other weights refuses rather than sample from them. Under torchrun process
0 pushes and checks each version, the others wait and take its token (`RemoteEngine.sync`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import http.client
import json
import os
import shutil
import time
import urllib.error
import urllib.request
import uuid

from grpo.config.checks import split_address
from grpo.errors import UserError
from grpo.infra.distributed import SingleProcess, World
from grpo.refusals import refuse
from grpo.rollout.weights import weights_folder
from grpo.rollout.weights import base_model
from grpo.vllm.engine import LocalEngine, head_dim

API = 1  # the HTTP API's version: a trainer and a server of different ones refuse each other
HEALTH_TIMEOUT = 10.0  # seconds: a server that is up answers at once (its engine is built before it listens)
TRANSPORTS = ("file",)  # how weights reach the server in this version (rollout.vllm.transport)

# What fixes the layout of a model's weights and what its forward computes: two models that
# agree on these take each other's weights. Compared where both configs have the key.
ARCHITECTURE = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "tie_word_embeddings",
    "hidden_act",
    "rms_norm_eps",
    "rope_theta",
    "rope_parameters",
    "attention_bias",
    "mlp_bias",
    "sliding_window",
    "use_sliding_window",
)


def identity(config) -> dict:
    """The architecture of a transformers config (`ARCHITECTURE`, head_dim derived), as plain
    JSON values: what a server and a trainer compare."""
    text = getattr(config, "get_text_config", None)
    values = (text() if text is not None else config).to_dict()
    found = {key: values[key] for key in ARCHITECTURE if key in values}
    found["head_dim"] = head_dim(config)
    return json.loads(json.dumps(found, sort_keys=True, default=str))


def fingerprint(ident: dict) -> str:
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:12]


def differences(server: dict, trainer: dict, shown: int = 3) -> str:
    """The keys on which two identities disagree, as 'key: A there, B here; ...'."""
    keys = sorted(k for k in server.keys() & trainer.keys() if server[k] != trainer[k])
    parts = [f"{k}: {server[k]} there, {trainer[k]} here" for k in keys[:shown]]
    return "; ".join(parts + ([f"{len(keys) - shown} more"] if len(keys) > shown else []))


def state_dict(weights) -> dict:
    """(name, tensor) pairs -> a dict safetensors writes: on the CPU, contiguous, and a copy
    of any tensor whose memory an earlier one holds (the tied head is the embedding)."""
    tensors, held = {}, set()
    for name, tensor in weights:
        tensor = tensor.detach().cpu().contiguous()
        where = tensor.untyped_storage().data_ptr()
        if where in held:
            tensor = tensor.clone()
        held.add(tensor.untyped_storage().data_ptr())
        tensors[name] = tensor
    return tensors


class ServerGone(UserError):
    """The server did not answer (not started, stopped, unreachable, or past the timeout)."""


class RemoteEngine:
    """A `grpo vllm-serve` server, with the methods of `LocalEngine` that `VllmDecoder` calls
    (module doc). `timeout`: the seconds a generate request or a push may take."""

    # The check is the colocated engine's: it reads only `vocab`, `longest` and
    # `prompt_logprobs`, which this class answers over HTTP.
    check = LocalEngine.check

    def __init__(
        self, address: str, *, timeout: float = 600.0, transport: str = "file", world: World = SingleProcess()
    ):
        host, port = split_address(address)
        if transport not in TRANSPORTS:
            refuse("transport-nccl", transport=transport)
        self.address, self.port = address, port
        self.url = f"http://{'[' + host + ']' if ':' in host else host}:{port}"
        self.timeout, self.transport = timeout, transport
        self.world = world  # the training processes that share the server (torchrun)
        self.info = self.health()
        import torch

        self.dtype = getattr(torch, self.info["dtype"])
        self.vocab = int(self.info["identity"]["vocab_size"])
        self.longest = self.info.get("max_model_len")  # the server's; the weight check's sequence fits it
        self.asleep = False  # the server's memory is its own: nothing to free here
        self.holds = None  # (weakref to the policy, its version) whose weights it holds; the decoder's
        self.token = None  # the last push's: the server's weights are those while it holds it
        self.syncs, self.sync_seconds, self.check_seconds = 0, 0.0, 0.0  # for the report
        self.write_seconds = self.load_seconds = 0.0  # of the pushes: the file written, the server's load

    # ---- the wire ---------------------------------------------------------------------------

    def _restart(self) -> str:
        return f"grpo vllm-serve --model DIR --port {self.port}"

    def _call(self, path: str, body: dict | None = None, *, timeout: float, during: str) -> dict:
        """One request (GET without a body, else a JSON POST) -> the JSON answer. The server's
        own refusal is a UserError with its one line; no answer is a ServerGone."""
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self.url + path,
            data=data,
            headers={"Content-Type": "application/json"},
            method="GET" if data is None else "POST",
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout) as answer:
                return json.loads(answer.read())
        except urllib.error.HTTPError as err:  # it answered, with an error of its own
            try:
                said = json.loads(err.read()).get("error") or err.reason
            except ValueError:
                said = err.reason
            raise UserError(f"the vLLM server at {self.address} refused {during}: {said}") from err
        except (urllib.error.URLError, OSError, http.client.HTTPException) as err:
            reason = getattr(err, "reason", None) or err
            if isinstance(reason, TimeoutError):  # up, perhaps, but slower than the run allows
                raise ServerGone(
                    f"the vLLM server at {self.address} gave no answer within {timeout:g} s during {during}; "
                    "raise rollout.vllm.timeout, or check the server"
                ) from err
            raise ServerGone(
                f"the vLLM server at {self.address} stopped answering during {during} ({reason}); "
                f"start it again: {self._restart()}"
            ) from err
        except ValueError as err:  # not JSON: something else listens there
            raise UserError(f"the server at {self.address} is not a grpo vllm-serve (its answer is not JSON)") from err

    def health(self) -> dict:
        """The server's identity; a one-line UserError when none answers or it speaks another API."""
        try:
            info = self._call("/health", timeout=HEALTH_TIMEOUT, during="the health check")
        except ServerGone as err:
            raise UserError(
                f"no vLLM server answers at {self.address} (start one with: {self._restart()})"
            ) from err.__cause__
        if info.get("api") != API:
            raise UserError(
                f"the server at {self.address} speaks API {info.get('api')!r} (grpo {info.get('grpo')}), this trainer "
                f"API {API}: run the same grpo version on both"
            )
        return info

    # ---- what VllmDecoder calls -------------------------------------------------------------

    def admit(self, policy, options) -> None:
        """Refuse, in one line, a server whose model, dtype, length or files do not fit this
        run (`options`: the decoder's EngineOptions)."""
        differ = differences(self.info["identity"], identity(base_model(policy).config))
        if differ:
            raise UserError(
                f"the vLLM server at {self.address} holds another model ({self.info['model']}: "
                f"{differ}); start it with --model set to this run's model"
            )
        if options.dtype not in ("auto", self.info["dtype"]):
            raise UserError(
                f"the vLLM server at {self.address} runs in {self.info['dtype']}, rollout.vllm.dtype says "
                f"{options.dtype}: start it with --dtype {options.dtype}, or set rollout.vllm.dtype: auto"
            )
        longest = self.info["max_model_len"]
        if options.max_model_len is not None and longest < options.max_model_len:
            raise UserError(
                f"the vLLM server at {self.address} holds sequences of at most {longest} tokens; this run's prompts "
                f"and completions take {options.max_model_len}: start it with --max-model-len {options.max_model_len}"
            )
        folder = weights_folder()  # the file transport needs one file system: known now, not at the first push
        try:
            seen = self._call(
                "/weights", {"transport": "file", "probe": folder}, timeout=HEALTH_TIMEOUT, during="a probe"
            )
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        if not seen.get("readable"):
            raise UserError(
                f"the vLLM server at {self.address} cannot read the trainer's files ({folder}): rollout.vllm.transport "
                "file needs the trainer and the server on one machine"
            )

    def sample(self, prompts: list[list[int]], params, counts: list[int], seeds: list[int]):
        body = {
            "prompts": prompts,
            "params": dataclasses.asdict(params),
            "counts": counts,
            "seeds": seeds,
            "weights": self.token,
        }
        answer = self._call("/generate", body, timeout=self.timeout, during="generation")
        return [[(ids, logprobs) for ids, logprobs in rows] for rows in answer["outputs"]]

    def prompt_logprobs(self, ids: list[int]) -> list[float]:
        body = {"ids": ids, "weights": self.token}
        return self._call("/prompt_logprobs", body, timeout=self.timeout, during="the weight check")["logprobs"]

    def load_weights(self, weights) -> None:
        """The weights into the server through one file (module doc), deleted once it answers."""
        from safetensors.torch import save_file

        start = time.perf_counter()
        tensors = state_dict(weights)
        need = sum(t.numel() * t.element_size() for t in tensors.values())
        folder = weights_folder(need, "rollout.vllm.transport")  # /dev/shm, or the temp folder where it is too small
        try:
            path = os.path.join(folder, "model.safetensors")
            try:
                save_file(tensors, path)
            except OSError as err:
                raise UserError(f"could not write the weights for the vLLM server into {folder}: {err}") from err
            written = time.perf_counter()
            token = uuid.uuid4().hex
            body = {"transport": self.transport, "path": path, "token": token}
            answer = self._call("/weights", body, timeout=self.timeout, during="the weight push")
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        self.token = token
        self.write_seconds += written - start
        self.load_seconds += float(answer.get("seconds", 0.0))

    def sync(self, policy, *, check: bool, tolerance: float) -> None:
        """The policy's weights pushed, then checked (`LocalEngine.sync`). Under torchrun the
        server is every process's: process 0 alone pushes and checks (the weights are whole
        in every process: `world.gathered`), the others wait for it and take its push's
        token, so each version is pushed once, and a push that fails fails every process."""

        def push() -> str:
            LocalEngine.sync(self, policy, check=check, tolerance=tolerance)
            return self.token

        self.token = self.world.from_main(push)

    def sleep(self) -> None:
        """Nothing: the server's memory is not the trainer's."""

    def wake(self) -> None:
        """Nothing (see `sleep`)."""

    def close(self) -> None:
        """Nothing: the server outlives the run (another run may use it)."""


def remote_engine(policy, options, world: World | None = None) -> RemoteEngine:
    """A client of the server at options.server, admitted for `policy` (one line before the
    first step when it is not up or does not fit); the generator's `Engines` holds it, so that
    every Sampler of the run shares what it holds. `world`: the training processes that share
    the server (process 0 pushes for all: `RemoteEngine.sync`; None: this one alone)."""
    world = world or SingleProcess()
    engine = RemoteEngine(options.server, timeout=options.timeout, transport=options.transport, world=world)
    engine.admit(policy, options)
    return engine
