"""The Sampler: from prompts to a Rollout of G completions each (docs/sampling.md).

One class for training, iterative RL and evaluation (`Sampler.from_config`), its decoders
behind one registry (`grpo.rollout.decoders`: fast, hf, vllm; auto picks), all drawing by
the same `SamplingParams`. Two strategies: `sample_single`, and with tools
`grpo.rollout.turns.sample_turns`; prompts are encoded the same way for both
(`grpo.rollout.prompts`).

Random numbers: built with the run's seed, the sampler draws each step from a generator of
its own (seed, rank, step), not from the global stream the update's permutations use, so
neither changes the other; with rollout.seed_per_prompt each prompt draws from its own.
Built without a seed (evaluation, the demo, iterative RL's comparisons) it draws from the
global stream, as `generate` does. It works on its own copy of the tokenizer (padding on the
left), so the caller's, and the one saved with a trained model, never changes.
"""

from __future__ import annotations

import copy
import dataclasses

import torch

from grpo.errors import UserError
from grpo.infra.seed import sampling_seed
from grpo.rollout import decoders
from grpo.rollout.agents import load_agent, sample_agents
from grpo.rollout.batch import Rollout
from grpo.rollout.decoders import Decoder
from grpo.rollout.padding import pad_cat
from grpo.rollout.params import SamplingParams
from grpo.rollout.prompts import check_fits, encode_prompts, prompt_text
from grpo.rollout.tool_formats import tool_format_for
from grpo.rollout.tools import Toolbox
from grpo.rollout.turns import sample_turns


def completion_mask(completion_ids: torch.Tensor, eos_token_id: int | None) -> torch.Tensor:
    """(N, T) float: 1 up to and including the first EOS of each row, 0 after it."""
    n, t_len = completion_ids.shape
    if eos_token_id is None:
        return torch.ones(n, t_len)
    is_eos = completion_ids == eos_token_id
    first_eos = torch.where(is_eos.any(1), is_eos.float().argmax(1), torch.full((n,), t_len))
    return (torch.arange(t_len).unsqueeze(0) <= first_eos.unsqueeze(1)).float()


class Sampler:
    """G completions per prompt, a prompt's G in contiguous rows, sampled by `params` (a
    `SamplingParams`; or given as its fields, `sampling`, with the tokenizer's EOS and
    padding): temperature, top-p, top-k, min-p, repetition penalty, min/max new tokens;
    decoded by the decoder `backend` names (see the module doc)."""

    def __init__(
        self,
        tokenizer,
        *,
        prompt_column: str,
        group_size: int,
        params: SamplingParams | None = None,
        batch_size: int = 0,
        backend: str = decoders.AUTO,
        autocast: torch.dtype | None = None,
        max_prompt_length: int = 0,
        seed: int | None = None,
        rank: int = 0,
        hold_prepared: bool = False,
        settings: decoders.DecoderSettings | None = None,
        decoder_options: dict[str, dict] | None = None,
        tools: Toolbox | None = None,
        chat_template_kwargs: dict | None = None,
        tool_format: str = "auto",
        agent=None,
        **sampling,
    ):
        decoders.check_name(backend)
        if (params is None) == (not sampling):
            raise TypeError("Sampler takes either params or the sampling options (SamplingParams' fields)")
        self.tokenizer = copy.deepcopy(tokenizer)  # ours to set up; the caller's stays as it was
        self.tokenizer.padding_side = "left"  # prompts end where generation starts
        self.prompt_column = prompt_column
        self.group_size = group_size
        self.batch_size = batch_size  # completions per decoding call (0 = all): bounds the KV cache
        self.backend = backend
        self.autocast = autocast  # compute dtype for decoding (None = the model's)
        self.max_prompt_length = max_prompt_length  # longer prompts keep their last tokens (0 = no limit)
        self.params = params if params is not None else SamplingParams.of(tokenizer, **sampling)
        self.seed, self.rank = seed, rank  # the run's seed (None: the global stream) and this process's rank
        self.decoders: dict[str, Decoder] = {}  # built as they are first chosen, kept for their per-version work
        # What each decoder builds its own options from (`Decoder.options_of`); `decoder_options`:
        # decoder name -> constructor arguments that replace those (a test's engine, a server's address).
        self.settings = settings or decoders.DecoderSettings(seed=seed)
        # The engines its decoders build (vLLM's): its owner's (a generator's), else its own, shut down by `close`.
        self.owns_engines = self.settings.engines is None
        if self.owns_engines:
            self.settings = dataclasses.replace(self.settings, engines=decoders.Engines())
        self.decoder_options = decoder_options or {}
        # Whether a decoder keeps its per-version work (the fast loop's fused copy of the
        # weights) after `sample` returns, for the next sample of the same version. Off: the
        # copy is dropped at once, so it never sits in memory through an update; in a
        # synchronous loop every sample has a new version, so there is nothing to reuse.
        self.hold_prepared = hold_prepared
        # Multi-turn rollouts with tools (grpo.rollout.turns), in the tool-call format rollout.tool_format
        # names (auto: the chat template's), the template checked to speak it.
        self.tools = tools
        self.template_kwargs = dict(chat_template_kwargs or {})  # the chat template's own variables
        self.format = None if tools is None else tool_format_for(self.tokenizer, tool_format, self.template_kwargs)
        self.rendering_checked = False  # whether turns.check_rendering has compared a conversation's tokens
        # An agent program drives each rollout through the endpoint (grpo.rollout.agents); None: our own loop.
        self.agent = None if agent is None else load_agent(agent)

    @classmethod
    def from_config(
        cls,
        tokenizer,
        rollout,
        *,
        prompt_column: str,
        autocast: torch.dtype | None = None,
        group_size: int | None = None,
        seed: int | None = None,
        rank: int = 0,
        tools: Toolbox | None = None,
        spare_bytes: int = 0,
        hold_prepared: bool = False,
        engines: decoders.Engines | None = None,
    ) -> Sampler:
        """The sampler that `rollout` (a `grpo.config.RolloutConfig`) describes; `group_size`
        overrides the config's (iterative RL samples its own number per prompt). With the
        run's `seed` (and the process's `rank`), it draws from its own stream (module doc).
        rollout.vllm's options go to the vllm decoder, with the longest sequence its engine
        holds (max_prompt_length + max_new_tokens; the model's positions without a prompt limit).
        `tools` (a `grpo.rollout.tools.Toolbox`): multi-turn rollouts with them.
        `spare_bytes`: memory the fast loop may spend on packed weights (`FastDecoder`).
        `hold_prepared`: whether a decoder keeps a version's work between samples (`__init__`).
        `engines`: the holder of its decoders' engines, its owner's (a generator's, shared by its
        samplers); None: its own (`close`)."""
        return cls(
            tokenizer,
            prompt_column=prompt_column,
            group_size=rollout.group_size if group_size is None else group_size,
            params=SamplingParams.from_config(rollout, tokenizer),
            batch_size=rollout.generation_batch_size,
            backend=rollout.sampler,
            autocast=autocast,
            max_prompt_length=rollout.max_prompt_length,
            seed=seed,
            rank=rank,
            hold_prepared=hold_prepared,
            settings=decoders.DecoderSettings(rollout, seed, spare_bytes, engines),
            tools=tools,
            chat_template_kwargs=rollout.chat_template_kwargs,
            tool_format=rollout.tool_format,
            agent=rollout.agent,
        )

    def decoder_name(self, model, prompt_length: int) -> str:
        """The decoder that samples `model` for prompts of `prompt_length` tokens (raises when
        the one asked for cannot)."""
        return decoders.choose(self.backend, model, prompt_length + self.params.max_new_tokens, self.options)

    def options(self, name: str) -> dict:
        """What decoder `name` is built with besides the params: its own from the settings,
        replaced by `decoder_options`' where given."""
        return {**decoders.decoder_class(name).options_of(self.settings), **self.decoder_options.get(name, {})}

    def decoder(self, model, prompt_length: int) -> Decoder:
        name = self.decoder_name(model, prompt_length)
        if name not in self.decoders:
            chosen = name if self.backend == name else f"{self.backend} (which chose {name} for this policy)"
            refused = decoders.fast_only_refusal(self.params, name, chosen)
            if refused is not None:
                raise UserError(refused)
            self.decoders[name] = decoders.decoder_class(name)(self.params, self.autocast, **self.options(name))
        return self.decoders[name]

    def start(self, model, world=None) -> None:
        """Build now what the decoder rollout.sampler names builds at its first sample (vLLM's
        engine), so that what it refuses is known before the first step. Nothing for the
        others (auto's choice depends on each batch's prompts). `world`: the training
        processes (a vLLM server is theirs together)."""
        if self.backend == decoders.AUTO:
            return
        self.decoder(model, self.max_prompt_length).start(model, world)

    def close(self) -> None:
        """Shut down the engine its decoders built, when the holder is its own (a generator
        closes the one it gave)."""
        if self.owns_engines:
            self.settings.engines.close()

    @torch.no_grad()
    def _decode(self, decoder: Decoder, unique_ids, unique_mask, seeds, generator, step: int):
        """Every row's completion ids (N, T), from decoding calls of `batch_size` rows each (a
        call holds each of its distinct prompts once), and each call's log-probs (or Nones)."""
        device = unique_ids.device
        prompt_of_row = torch.arange(len(unique_ids), device=device).repeat_interleave(self.group_size)  # (N,)
        if generator is None and self.seed is not None:
            generator = torch.Generator(device=device).manual_seed(sampling_seed(self.seed, self.rank, step))
        pieces, logprob_pieces = [], []
        size = self.batch_size or len(prompt_of_row)
        if seeds is not None:  # whole prompts per call: a prompt's generator draws all its rows
            size = max(size // self.group_size, 1) * self.group_size
        for chunk in prompt_of_row.split(size):
            which, counts = torch.unique_consecutive(chunk, return_counts=True)
            generators = (
                [generator]  # one stream for every row (None: the global one)
                if seeds is None
                else [torch.Generator(device=device).manual_seed(seeds[i]) for i in which.tolist()]
            )
            ids, logprobs = decoder.decode(unique_ids[which], unique_mask[which], counts, generators)
            pieces.append(ids)
            logprob_pieces.append(logprobs)
        return pad_cat(pieces, self.params.pad_token_id), logprob_pieces

    def sample(
        self,
        model,
        rows: list[dict],
        seeds: list[int] | None = None,
        *,
        step: int = 0,
        version: int | None = None,
        generator: torch.Generator | None = None,
    ) -> Rollout:
        """G completions of each row's prompt. With `seeds` (one per row), row i's completions
        are drawn from their own generator seeded with seeds[i]: they do not depend on the
        other rows sampled beside them (nor on how many processes share a step), given the
        same generation_batch_size. Without, every row draws from one stream: `generator`
        when given, else this sampler's own for `step` (the steps done before this one) when
        it was built with a seed, else the global stream (see the module doc).
        `version`: the optimizer steps `model`'s weights have taken (the Rollout's
        policy_version), so that a decoder does its per-version work once; None: redone.
        Prompts longer than max_prompt_length keep their last tokens (see the module doc).
        Three strategies: `sample_single`, with tools `grpo.rollout.turns.sample_turns`
        (each completion a multi-turn rollout), with an agent `grpo.rollout.agents.sample_agents`
        (each completion an episode of the agent program)."""
        strategy = (
            sample_agents if self.agent is not None else sample_turns if self.tools is not None else sample_single
        )
        return strategy(self, model, rows, seeds, step=step, version=version, generator=generator)


@torch.no_grad()
def sample_single(sampler: Sampler, model, rows: list[dict], seeds, *, step: int, version, generator) -> Rollout:
    """`Sampler.sample` for a sampler without tools: G single-turn completions of each row's
    prompt, decoded in one call per generation batch (`Sampler._decode`); the multi-turn
    strategy beside it is `grpo.rollout.turns.sample_turns`."""
    tok = sampler.tokenizer
    prompts = [row[sampler.prompt_column] for row in rows]
    texts = [prompt_text(prompt, tok, template_kwargs=sampler.template_kwargs) for prompt in prompts]
    chat = [not isinstance(prompt, str) for prompt in prompts]
    unique_ids, unique_mask, cut, texts = encode_prompts(tok, texts, sampler.max_prompt_length, chat=chat)  # (B, P)
    check_fits(model, unique_ids.shape[1], sampler.max_prompt_length, sampler.params.max_new_tokens)
    device = next(model.parameters()).device
    unique_ids, unique_mask = unique_ids.to(device), unique_mask.to(device)
    prompt_ids = unique_ids.repeat_interleave(sampler.group_size, 0)  # (N, P)
    prompt_mask = unique_mask.repeat_interleave(sampler.group_size, 0)
    decoder = sampler.decoder(model, prompt_ids.shape[1])
    decoder.prepare(model, version)
    try:
        completion_ids, logprob_pieces = sampler._decode(decoder, unique_ids, unique_mask, seeds, generator, step)
        exact = decoder.exact_logprobs()  # asked before release drops the prepared weights
    finally:
        if not sampler.hold_prepared:
            decoder.release()
    pad = sampler.params.pad_token_id  # the tokenizer's (0 when it has none)
    mask = completion_mask(completion_ids.cpu(), tok.eos_token_id).to(device)  # (N, T)
    # Tokens after EOS become padding, so they can never be mistaken for content.
    completion_ids = torch.where(mask.bool(), completion_ids, torch.full_like(completion_ids, pad))
    sampled_logprobs = None
    if all(logprobs is not None for logprobs in logprob_pieces):
        sampled_logprobs = torch.where(mask.bool(), pad_cat(logprob_pieces, 0.0), 0.0)  # (N, T), 0 past the end
    completions = tok.batch_decode(completion_ids, skip_special_tokens=True)
    repeated_rows = [row for row in rows for _ in range(sampler.group_size)]
    return Rollout(
        input_ids=torch.cat([prompt_ids, completion_ids], 1),
        attention_mask=torch.cat([prompt_mask, mask.long()], 1),
        completion_mask=mask,
        prompts=[t for t in texts for _ in range(sampler.group_size)],
        completions=completions,
        rows=repeated_rows,
        group_size=sampler.group_size,
        prompt_truncated=cut.repeat_interleave(sampler.group_size).to(device),
        sampled_logprobs=sampled_logprobs,
        policy_version=0 if version is None else version,
        logprobs_exact=exact and sampled_logprobs is not None,
    )
