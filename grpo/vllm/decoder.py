"""`rollout.sampler: vllm`: the Decoder (grpo.rollout.decoders) that samples with a vLLM engine,
in the training process (`grpo.vllm.engine.LocalEngine`) or a `grpo vllm-serve` server's
(`grpo.vllm.client.RemoteEngine`, the same methods over HTTP).

The engine is built at the first `start` or `prepare` into the holder the Sampler gives
(`grpo.rollout.decoders.Engines`: the generator's, shared by its samplers when they ask for
the same model and options, and shut down by the generator's `close`; one engine per process
at a time, as vLLM allows); `prepare(policy, version)` syncs and checks the weights when the
version differs, and `release` frees its memory (CUDA sleep mode) without destroying it. A
prompt's G completions are one request with `n = G` and an int seed drawn from the Sampler's
generator, so a seeded run draws the same tokens again (vLLM's own, not those `fast` or `hf`
draw). Nothing at import time needs torch or vLLM.
"""

from __future__ import annotations

import dataclasses
import json
import weakref
from dataclasses import dataclass

from grpo.rollout.decoders import Decoder, DecoderSettings, Engines
from grpo.rollout.params import SamplingParams


@dataclass(frozen=True)
class EngineOptions:
    """What the engine is built with, besides the policy (the rollout.vllm section's fields,
    and what the Sampler derives): see `grpo.config.VllmConfig` for each."""

    max_model_len: int | None = None  # None: the model's positions
    max_num_seqs: int = 256
    dtype: str = "auto"  # auto: the Sampler's compute dtype, else the policy's
    gpu_memory_utilization: float = 0.3
    sleep: bool = False
    kv_cache_gb: int = 1
    check_sync: bool = True
    check_tolerance: float | None = None  # None: 1e-3 in float32, 5e-2 in 16 bits
    seed: int = 0
    server: str = ""  # HOST:PORT of a `grpo vllm-serve` (grpo.vllm.client); '': the engine in this process
    transport: str = "file"
    timeout: float = 600.0

    @classmethod
    def of(cls, section, *, max_model_len: int | None, seed: int) -> EngineOptions:
        """From rollout.vllm (`section`, a `grpo.config.VllmConfig`): its fields of the same names."""
        names = {f.name for f in dataclasses.fields(cls)} - {"max_model_len", "seed"}
        return cls(max_model_len=max_model_len, seed=seed, **{name: getattr(section, name) for name in names})


BUILT = {"engines": 0}  # engines built in this process (tests: one per run)


def _dtype(options: EngineOptions, autocast, policy):
    import torch

    if options.dtype != "auto":
        return getattr(torch, options.dtype)
    return autocast or next(policy.parameters()).dtype


def engine_key(policy, options: EngineOptions, autocast=None) -> tuple:
    """What an engine for `policy` is built for: its architecture, device, dtype and the
    options that shape it (not the seed: every request brings its own, so samplers with
    other seeds share it)."""
    from grpo.vllm.engine import base_model

    device = next(policy.parameters()).device
    key = (json.dumps(base_model(policy).config.to_dict(), sort_keys=True, default=str), str(device))
    key += (str(_dtype(options, autocast, policy)), options.max_model_len, options.max_num_seqs)
    return key + (options.gpu_memory_utilization, options.sleep, options.kv_cache_gb)


def local_engine(policy, options: EngineOptions, autocast=None):
    """A new engine in this process for `policy`'s architecture and `options`
    (`grpo.vllm.engine.LocalEngine`); its owner shuts it down (`Engines.close`)."""
    from grpo.vllm.engine import LocalEngine

    engine = LocalEngine(
        policy,
        device=next(policy.parameters()).device,
        max_model_len=options.max_model_len,
        max_num_seqs=options.max_num_seqs,
        dtype=_dtype(options, autocast, policy),
        seed=options.seed,
        gpu_memory_utilization=options.gpu_memory_utilization,
        sleep=options.sleep,
        kv_cache_gb=options.kv_cache_gb,
    )
    BUILT["engines"] += 1
    return engine


class VllmDecoder(Decoder):
    """Samples with this process's vLLM engine, or a server's (module doc). Never chosen by
    rollout.sampler: auto (`in_auto`): vLLM is a dependency to install and an engine to build."""

    decodes_lora = True  # the merged weights (`grpo.vllm.engine.policy_weights`)
    in_auto = False

    @classmethod
    def options_of(cls, settings: DecoderSettings) -> dict:
        """The engine's options: rollout.vllm's, with the longest sequence it holds
        (max_prompt_length + max_new_tokens; the model's positions without a prompt limit);
        and the holder the engine is built into (the Sampler's owner's)."""
        held = {} if settings.engines is None else {"engines": settings.engines}
        r = settings.rollout
        if r is None:
            return held
        longest = r.max_prompt_length + r.max_new_tokens if r.max_prompt_length else None
        return {"options": EngineOptions.of(r.vllm, max_model_len=longest, seed=settings.seed or 0), **held}

    def __init__(
        self,
        params: SamplingParams,
        autocast=None,
        options: EngineOptions | None = None,
        engines: Engines | None = None,
    ):
        from grpo.vllm.engine import unsupported
        from grpo.errors import UserError

        reason = unsupported(params)
        if reason is not None:
            raise UserError(reason)
        self.params, self.autocast = params, autocast
        self.options = options or EngineOptions()
        # The holder its engine is built into: the Sampler's (its owner's). None (a decoder made
        # alone): one of its own, which nothing closes; its maker closes `self.engine`.
        self.engines = Engines() if engines is None else engines
        self.engine = None

    @staticmethod
    def refuses(model, total_length: int, options: EngineOptions | None = None, engines=None) -> str | None:
        """Why this process cannot run an engine for `model` (nothing to say with a server:
        it built its own; the client admits it at `start`). `engines`: its holder, no matter."""
        from grpo.vllm.engine import refusal

        if options is not None and options.server:
            return None
        return refusal(model, next(model.parameters()).device)

    def start(self, policy, world=None):
        """Build the engine now, or reach the server and admit it (before the first step:
        what vLLM refuses, or a server that is not up or holds another model, is known there).
        `world` (a grpo.infra.distributed World): the training processes that share a server."""
        if self.engine is None:
            if self.options.server:
                from grpo.vllm.client import remote_engine

                key = ("server", self.options.server)
                self.engine = self.engines.get(key, lambda: remote_engine(policy, self.options, world))
            else:
                key = engine_key(policy, self.options, self.autocast)
                self.engine = self.engines.get(key, lambda: local_engine(policy, self.options, self.autocast))
        return self.engine

    def tolerance(self) -> float:
        import torch

        if self.options.check_tolerance is not None:
            return self.options.check_tolerance
        return 1e-3 if self.engine.dtype == torch.float32 else 5e-2

    def prepare(self, policy, version: int | None) -> None:
        """The policy's weights into the engine, unless it holds this version of this policy
        already (None: always), then checked (rollout.vllm.check_sync). Called inside
        `world.gathered(policy)` under FSDP2, so the weights read are whole."""
        engine = self.start(policy)
        held = engine.holds
        if version is None or engine.asleep or held is None or held[0]() is not policy or held[1] != version:
            engine.sync(policy, check=self.options.check_sync, tolerance=self.tolerance())
            engine.holds = (weakref.ref(policy), version)

    def release(self) -> None:
        """Keep the engine (one per run); with sleep mode (CUDA), free its memory for the update."""
        if self.engine is not None:
            self.engine.sleep()

    def exact_logprobs(self) -> bool:
        return False  # another engine's kernels (and, on a GPU, dtype): the mismatch is measured, not assumed away

    def seeds(self, counts, generators) -> list[int]:
        """One int seed per prompt: from its own generator, or drawn in order from the call's
        one (None: the global stream)."""
        import torch

        def draw(generator, n):
            device = generator.device if generator is not None else "cpu"
            return torch.randint(2**31 - 1, (n,), generator=generator, device=device).tolist()

        if len(generators) == 1:
            return draw(generators[0], len(counts))
        return [draw(g, 1)[0] for g in generators]

    def decode(self, prompt_ids, prompt_mask, counts, generators, params=None):
        import torch

        from grpo.rollout.padding import pad_cat

        prompts = [ids[mask.bool()].tolist() for ids, mask in zip(prompt_ids, prompt_mask)]  # no left padding
        counts = counts.tolist()
        drawn = self.engine.sample(prompts, params or self.params, counts, self.seeds(counts, generators))
        rows = [row for per_prompt in drawn for row in per_prompt]
        ids = pad_cat([torch.tensor([row_ids], dtype=torch.long) for row_ids, _ in rows], self.params.pad_token_id)
        logprobs = pad_cat([torch.tensor([row_logprobs], dtype=torch.float32) for _, row_logprobs in rows], 0.0)
        return ids.to(prompt_ids.device), logprobs.to(prompt_ids.device)
