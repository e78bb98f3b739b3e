"""The decoders a Sampler can run, behind one registry (docs/sampling.md, docs/speed.md).

A decoder samples completions of left-padded prompts: `prepare(policy, version)` does a
version's one-time work (the fast loop's fused weights), `decode(prompt_ids, prompt_mask,
counts, generators)` draws counts[i] completions of prompt i and, where it can, the
log-probs of the drawn tokens under the distribution they were drawn from. All take the
same `SamplingParams` and draw the same tokens from the same random numbers: "fast" (our
KV-cache loop, Llama family), "hf" (transformers' `generate`, any causal LM, no log-probs),
"vllm" (`grpo.vllm.decoder`); "auto" takes the first that can run the model among those it
may choose (`in_auto`: not vllm). `generators`: one for the call, or one per prompt.

A decoder declares what it can do beyond that (`Decoder`: `start` builds ahead what its
first sample would, `extends` says whether `extend` continues rows from a kept cache; the
defaults build nothing and refuse to extend) and builds its own options from what a Sampler
knows (`DecoderSettings`: the rollout config, the seed, spare memory; `options_of`). An engine
a decoder builds (vLLM's) is held by an `Engines` its owner gives it (the generator) and shut
down with that owner, never by a module of its own.

The registry holds import paths ('module:Class', `decoder_class`), so that the names are read
without importing torch or vLLM, and decoders -> a decoder's module runs one way. The config
writes the same names (`grpo.config.schema.SAMPLERS`, held equal by a test) and imports no
decoder; `grpo.train.preflight` asks them what they refuse before any model loads. Refusals are rows of `grpo.refusals`.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Protocol

from grpo.errors import UserError
from grpo.infra.imports import import_object
from grpo.refusals import refuse, refusal
from grpo.rollout.params import FAST_ONLY, SamplingParams

if TYPE_CHECKING:
    import torch
    from torch import Tensor


class Engines:
    """The engine its decoders build (vLLM's), owned by whoever made this holder (a generator,
    or a Sampler made alone) and shut down by its `close`: decoders given the same holder
    share the engine built for the same key (training's and iterative RL's samplers), and a
    holder keeps one at a time (another key closes the one held before building its own)."""

    def __init__(self):
        self.key, self.engine = None, None

    def get(self, key, build: Callable[[], object]):
        """The engine held for `key`, else the one `build()` makes (the one held closed first)."""
        if self.engine is None or self.key != key:
            self.close()
            self.engine, self.key = build(), key
        return self.engine

    def close(self) -> None:
        """Shut the engine held down (its memory freed); the next `get` builds one. Again: nothing."""
        engine, self.engine, self.key = self.engine, None, None
        if engine is not None:
            engine.close()
            del engine
            gc.collect()


@dataclasses.dataclass(frozen=True)
class DecoderSettings:
    """What a Sampler knows that a decoder may build its options from (`Decoder.options_of`)."""

    rollout: object | None = None  # a grpo.config.RolloutConfig; None: every decoder's defaults
    seed: int | None = None  # the run's seed (None: none)
    spare_bytes: int = 0  # memory sampling may hold beyond its own (grpo.train.assembly.sampling_room)
    engines: Engines | None = None  # the holder of the engines its decoders build (None: the Sampler's own)


class Decoder(Protocol):
    decodes_lora: bool  # whether it decodes a LoRA (peft-wrapped) policy
    in_auto: bool  # whether rollout.sampler: auto may choose it
    extends: bool = False  # whether `extend` continues rows from the cache a `decode(keep=True)` kept

    @classmethod
    def options_of(cls, settings: DecoderSettings) -> dict:
        """What its constructor takes beyond the params and the compute dtype, from `settings`."""
        return {}

    @staticmethod
    def refuses(model, total_length: int, **options) -> str | None:
        """Why it cannot decode `model` for sequences of `total_length` tokens; None if it can.
        `options`: what it is built with besides the params (`options_of`: a server's address)."""

    def start(self, policy, world=None) -> None:
        """Build now what its first sample would build (an engine, a server admitted), so that
        what it refuses is known before the first step; `world`: the training processes. By
        default there is nothing to build ahead."""
        return None

    def prepare(self, policy, version: int | None) -> None:
        """Decode `policy` from now on, doing its per-version work once for `version` (the
        optimizer steps its weights have taken); None: the weights may have changed since
        the last call, so that work is redone."""

    def release(self) -> None:
        """Drop what `prepare` built (the next `prepare` builds it again)."""

    def exact_logprobs(self) -> bool:
        """Whether the log-probs of the prepared policy's `decode` are the trainer's own up to
        float rounding: the same weights, in float32, and the distribution the loss scores.
        Such log-probs can stand for the old policy's (train.old_logprobs: auto)."""

    def decode(
        self,
        prompt_ids: Tensor,
        prompt_mask: Tensor,
        counts: Tensor,
        generators: Sequence[torch.Generator | None],
        params: SamplingParams | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """(B, P) left-padded prompts, (B,) completions per prompt -> (sum(counts), T) token
        ids, right-padded after EOS, and their (sum(counts), T) float log-probs or None.
        `params`: this call's (a multi-turn rollout's turn asks for fewer new tokens than
        max_new_tokens); None: the ones the decoder was built with."""

    def extend(self, kept, blocks, counts, generators, params=None):
        """Rows whose context `kept` holds the start of go on with `blocks` (only the new tokens
        run); a decoder that keeps no cache (`extends` False) refuses."""
        raise NotImplementedError(f"{type(self).__name__} keeps no cache to extend; decode the whole context")


class FastDecoder(Decoder):
    """`grpo.rollout.fast.decode`: each prompt's prefix computed once for its G completions,
    the tokens `generate` draws, and the log-probs of the tokens drawn."""

    decodes_lora = False
    in_auto = True
    extends = True

    @classmethod
    def options_of(cls, settings: DecoderSettings) -> dict:
        return {"spare_bytes": settings.spare_bytes}

    def __init__(self, params: SamplingParams, autocast: torch.dtype | None = None, spare_bytes: int = 0):
        self.params, self.autocast = params, autocast
        self.policy, self.version, self.weights = None, None, None
        # Memory the sampling may hold beyond its own without holding more than the update does
        # (the gradients the update holds and the sampling does not: `grpo.train.loop`); the
        # fast draw spends it on packed copies of the single matrices (`_pack_within`). 0: none.
        self.spare_bytes = spare_bytes
        self.sized = False  # whether this version's weights have been through `_pack_within`

    @staticmethod
    def refuses(model, total_length: int, **options) -> str | None:
        from grpo.rollout import fast

        return fast.supported(model, total_length)

    def prepare(self, policy, version: int | None) -> None:
        """The policy's fused weights, in the compute dtype: built once per version, and held
        until the next (a version's weights must stay as they are, and where they are, while
        it is sampled: prepare a sharded policy inside the same gathering)."""
        if version is not None and policy is self.policy and version == self.version:
            return
        from grpo.rollout import fast

        self.weights = None  # the previous weights go before the next are built
        dtype = self.autocast or next(policy.parameters()).dtype
        self.weights = fast.fuse_weights(policy, dtype, pack=self.params.fast_draw)
        self.policy, self.version, self.sized = policy, version, False

    def release(self) -> None:
        """The fused weights are a copy of the layers' weights: released, they do not sit in
        memory through the update that follows a sample."""
        self.policy, self.version, self.weights, self.sized = None, None, None, False

    def _pack_within(self, prompt_ids, counts, p, keep: bool) -> None:
        """At a version's first call: pack the single matrices of the fast draw's weights
        (`fast.pack_single_matrices`: the head, the down and output projections) whose copies
        fit in `spare_bytes` less what this call's sampling holds of its own
        (`fast.sampling_bytes`). A decision by sizes alone, the same at every run of a config
        (its draws' rounding depends on it), never by timing."""
        if self.sized or self.weights is None or not self.spare_bytes or not self.weights.packing:
            return
        from grpo.rollout import fast

        self.sized = True
        prompts, prompt_len = prompt_ids.shape
        rows, shared = int(counts.sum()), fast.shares_prompts(self.weights, p, counts, prompt_len, keep)
        own = fast.sampling_bytes(self.weights, prompts, prompt_len, rows, p.max_new_tokens, shared)
        fast.pack_single_matrices(self.weights, self.spare_bytes - own)

    def exact_logprobs(self) -> bool:
        """Float32 fused weights (the policy's own, no autocast) and a distribution that
        top-p/k, min-p and min_new_tokens leave as the loss scores it."""
        import torch

        return self.weights is not None and self.weights.embed.dtype == torch.float32 and not self.params.reshapes

    def decode(self, prompt_ids, prompt_mask, counts, generators, params=None, keep=False):
        """`fast.decode`; with `keep`, also the rows' `fast.Kept` cache, for `extend`."""
        from grpo.rollout import fast

        p = params or self.params
        self._pack_within(prompt_ids, counts, p, keep)
        return fast.decode(
            self.policy, prompt_ids, prompt_mask, counts, p, weights=self.weights, generators=generators, keep=keep
        )

    def extend(self, kept, blocks, counts, generators, params=None):
        """`fast.extend`: rows whose context `kept` holds the start of go on with `blocks`
        (a multi-turn rollout's next turn: only the new tokens are run, not the context again)."""
        from grpo.rollout import fast

        return fast.extend(self.policy, kept, blocks, params or self.params, self.weights, counts, generators)


def generation_config(p: SamplingParams):
    """The GenerationConfig that makes `generate` sample as `p` says, and as nothing else says."""
    from transformers import GenerationConfig

    return GenerationConfig(
        do_sample=True,
        temperature=p.temperature,
        top_p=p.top_p,
        top_k=p.top_k,  # explicit: GenerationConfig's own default is 50, not off
        min_p=float(p.min_p),  # 0, not None: None would be filled from the model's own generation config
        # Explicit too: generate fills values left unset from the model's own
        # generation_config.json, and chat models often set a repetition penalty there
        # (the Qwen2.5-Instruct family does). RL must sample from the distribution it
        # scores: only the run's own rollout.repetition_penalty, which the loss applies too.
        repetition_penalty=float(p.repetition_penalty),
        no_repeat_ngram_size=0,
        max_new_tokens=p.max_new_tokens,
        min_new_tokens=p.min_new_tokens,
        pad_token_id=p.pad_token_id,
        eos_token_id=list(p.eos_token_ids) or None,
        bos_token_id=p.bos_token_id,
    )


@contextmanager
def _global_stream_from(generator: torch.Generator | None, device: torch.device):
    """`generate` draws from the global stream: within this block that stream starts where
    `generator` stands, and `generator` is left where the draws left it (the global state
    is restored after). None: the global stream itself."""
    if generator is None:
        yield
        return
    import torch

    cuda = device.type == "cuda"
    with torch.random.fork_rng(devices=[device] if cuda else []):
        if cuda:
            torch.cuda.set_rng_state(generator.get_state(), device)
        else:
            torch.set_rng_state(generator.get_state())
        yield
        generator.set_state(torch.cuda.get_rng_state(device) if cuda else torch.get_rng_state())


class HFDecoder(Decoder):
    """transformers' `generate`, one row per completion; with a generator per prompt, one
    call per prompt. No log-probs."""

    decodes_lora = True
    in_auto = True

    def __init__(self, params: SamplingParams, autocast: torch.dtype | None = None):
        self.params, self.autocast = params, autocast
        self.config = generation_config(params)
        self.policy = None

    @staticmethod
    def refuses(model, total_length: int, **options) -> str | None:
        return None

    def prepare(self, policy, version: int | None) -> None:
        self.policy = policy

    def release(self) -> None:
        self.policy = None

    def exact_logprobs(self) -> bool:
        return False  # it gives none

    def decode(self, prompt_ids, prompt_mask, counts, generators, params=None):
        import torch

        from grpo.rollout.padding import pad_cat

        if len(generators) > 1:  # one per prompt
            pieces = [
                self.decode(prompt_ids[i : i + 1], prompt_mask[i : i + 1], counts[i : i + 1], [generator], params)[0]
                for i, generator in enumerate(generators)
            ]
            return pad_cat(pieces, self.params.pad_token_id), None
        config = self.config if params is None else generation_config(params)
        ids, mask = prompt_ids.repeat_interleave(counts, 0), prompt_mask.repeat_interleave(counts, 0)
        with (
            _global_stream_from(generators[0], ids.device),
            torch.autocast(ids.device.type, dtype=self.autocast, enabled=self.autocast is not None),
        ):
            out = self.policy.generate(input_ids=ids, attention_mask=mask, generation_config=config)
        return out[:, ids.shape[1] :], None


# ---- choosing ---------------------------------------------------------------------------------

# rollout.sampler -> where its decoder is ('module:class', imported when first asked for: a
# decoder's module may import this one, never the other way); in auto's order of preference
# (among those `in_auto`).
DECODERS: dict[str, str] = {
    "fast": "grpo.rollout.decoders:FastDecoder",
    "hf": "grpo.rollout.decoders:HFDecoder",
    "vllm": "grpo.vllm.decoder:VllmDecoder",
}
AUTO = "auto"
NAMES = (AUTO, *DECODERS)  # rollout.sampler's values


@functools.cache
def decoder_class(name: str) -> type[Decoder]:
    """The decoder class rollout.sampler `name` (not auto) stands for (imported once: auto's
    choice asks at every sample)."""
    return import_object(DECODERS[name], kind="rollout.sampler")


_FAST_ONLY_DEFAULTS = {f.name: f.default for f in dataclasses.fields(SamplingParams) if f.name in FAST_ONLY}


def _either(names: Sequence[str]) -> str:
    return " or ".join([", ".join(names[:-1]), names[-1]] if len(names) > 1 else names)


def check_name(name: str) -> None:
    if name not in NAMES:
        raise UserError(f"rollout.sampler: unknown backend {name!r} ({_either(NAMES)})")


def choose(name: str, model, total_length: int, options: Callable[[str], dict] = lambda name: {}) -> str:
    """The decoder that rollout.sampler `name` runs `model` with, for sequences of
    `total_length` tokens: that one (a one-line error when it cannot), or for auto the first
    of DECODERS that can. `options(name)`: what that decoder is built with (the Sampler's)."""
    if name == AUTO:
        return next(
            n
            for n in DECODERS
            if decoder_class(n).in_auto and decoder_class(n).refuses(model, total_length, **options(n)) is None
        )
    reason = decoder_class(name).refuses(model, total_length, **options(name))
    if reason is not None:
        refuse("sampler+model", sampler=name, why=reason, others=_either([n for n in NAMES if n != name]))
    return name


# The values of a fast-loop option (`params.FAST_ONLY`) that another decoder honours as well:
# `generate` draws generate's own tokens.
_HONOURED = {"hf": {"draw": ("generate",)}}


def fast_only_refusal(options, decoder: str, label: str | None = None) -> str | None:
    """The one-line error for an option only the fast loop reads (`params.FAST_ONLY`) set away
    from its default in `options` (a SamplingParams or a rollout config) when `decoder`
    samples (auto: not known yet); None if it may. `label` names the decoder in the message
    (e.g. "auto (which chose hf)"; default `decoder`)."""
    if decoder in ("fast", AUTO):
        return None
    for name in FAST_ONLY:
        value, default = getattr(options, name), _FAST_ONLY_DEFAULTS[name]
        if value != default and value not in _HONOURED.get(decoder, {}).get(name, ()):
            return refusal("fast-only", name=name, value=value, sampler=label or decoder, default=default)
    return None


def lora_refusal(name: str) -> str | None:
    """The one-line error for rollout.sampler `name` with a LoRA-wrapped policy; None when
    it decodes one (auto falls back to a decoder that does)."""
    if name not in DECODERS or decoder_class(name).decodes_lora:
        return None
    able = [n for n in DECODERS if decoder_class(n).decodes_lora]
    fallback = next(n for n in able if decoder_class(n).in_auto)
    return refusal("lora+sampler", sampler=name, auto=AUTO, fallback=fallback, able=_either(able))
