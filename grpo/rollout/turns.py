"""Multi-turn rollouts: the model's turns and its tools' answers, one completion per rollout
(`sample_turns`, the Sampler's strategy when it has tools; docs/tools.md is the manual).

A turn is sampled up to its end of turn; its tool calls run, their messages are rendered by
the chat template and tokenized alone, and the next turn is sampled after them, until a turn
without a call, rollout.max_tool_calls or max_new_tokens. Tokens stay as sampled: what the
model wrote is never re-tokenized (it would train on tokens it never drew), tool tokens are
in `completion_mask` but not in `loss_mask`, and their sampler log-probs are 0.
`check_rendering` warns once where the template would render the conversation otherwise.

Each turn is one decoding call per batch of rows on any decoder; the fast loop keeps a row's
KV cache across turns (`KEEP_CACHE`). One random stream runs through every turn, or with
rollout.seed_per_prompt one per prompt and turn (`turn_seed`), so a prompt's rollouts do not
depend on what is sampled beside it nor on the number of processes.
"""

from __future__ import annotations

import dataclasses
import itertools
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from grpo.infra.seed import sampling_seed, turn_seed
from grpo.rollout.batch import Rollout
from grpo.rollout.padding import left_pad
from grpo.rollout.prompts import check_fits, encode_prompts
from grpo.rollout.tools import TOOL_CALL, Call, Episode, answer_turn, with_observation

__all__ = ["Trajectory", "assemble", "check_rendering", "decode_turn", "sample_turns"]


def assistant_content(tokenizer, raw: str, *, calls: bool = True) -> str:
    """A model turn's message content: its text without special tokens, and without its
    tool-call blocks where they are its `calls`."""
    text = TOOL_CALL.sub("", raw) if calls else raw
    for special in tokenizer.all_special_tokens:
        text = text.replace(special, "")
    return text.strip()


@dataclass
class Trajectory:
    """One rollout as it grows: its prompt's tokens, then its completion's, each marked as
    the model's (an action) or a tool's, with the sampler's log-probs (0 on a tool's)."""

    prompt: list[int]
    episode: Episode
    seed: int | None  # its prompt's seed (rollout.seed_per_prompt), or None: one stream for every row
    stream: torch.Generator | None = None  # the random stream this turn draws from (None: the global one)
    tokens: list[int] = field(default_factory=list)
    actions: list[float] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)  # the completion as chat messages
    as_written: list[dict] = field(default_factory=list)  # the same, each model turn as the text it sampled
    rounds: int = 0  # turns whose tool calls ran
    kept: tuple | None = None  # (fast.Kept, its row): the fast loop's cache of its context, from its last turn

    @property
    def context(self) -> list[int]:
        return self.prompt + self.tokens

    def append(self, tokens: list[int], action: bool, logprobs: list[float] | None = None) -> None:
        self.tokens += tokens
        self.actions += [float(action)] * len(tokens)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(tokens)


def _calls(rows: list[Trajectory], size: int, per_prompt: bool) -> list[list[Trajectory]]:
    """The rows of each decoding call: `size` at a time; with a stream per prompt, whole
    prompts' rows (as many as fit, at least one prompt's), as `Sampler._decode` cuts them, so
    that no prompt's stream is drawn from in two calls whose lengths depend on other rows."""
    if not per_prompt:
        return [rows[start : start + size] for start in range(0, len(rows), size)]
    calls: list[list[Trajectory]] = []
    for _, block in itertools.groupby(rows, key=lambda row: row.seed):
        block = list(block)
        if not calls or len(calls[-1]) + len(block) > size:
            calls.append([])
        calls[-1] += block
    return [call for call in calls if call]


# Whether the fast loop keeps each rollout's KV cache from one turn to the next, so that a turn
# runs only its new tokens (the end of the last turn, the tool messages) before it samples;
# False: every turn computes its whole context again, as the other decoders do (the tokens
# drawn are the same, the log-probs within float rounding: tests compare the two).
KEEP_CACHE = True


def _keeps_cache(decoder, params) -> bool:
    """Whether this turn's calls keep their cache: the fast loop's, without the repetition
    penalty (whose seen tokens would be the whole context's)."""
    return KEEP_CACHE and decoder.extends and params.repetition_penalty == 1.0


def _cached(chunk: list[Trajectory]):
    """The fast loop's cache of the chunk's rows, from their last turn, in one (`fast.Kept.join`)."""
    from grpo.rollout.fast import Kept

    parts, run = [], []
    for row in chunk:
        if run and row.kept[0] is not run[0][0]:
            parts.append(run[0][0].select([index for _, index in run]))
            run = []
        run.append(row.kept)
    parts.append(run[0][0].select([index for _, index in run]))
    return Kept.join(parts)


def decode_turn(
    sampler, decoder, rows: list[Trajectory], params, per_prompt: bool, device, goes_on: Callable[[Trajectory], bool]
) -> list[tuple]:
    """Each row's next turn as the decoder draws it: (token ids, their log-probs or None),
    from calls of at most generation_batch_size rows; consecutive rows with the same
    context and stream share one prompt of a call (a prompt's G rows, at the first turn).
    The fast loop keeps each row's cache for its next turn (`KEEP_CACHE`) where `goes_on`
    says a row may have one: a later turn runs only the tokens its cache does not hold.
    Shared by the tools' turns and an agent's requests (`grpo.rollout.agents`)."""
    drawn = []
    for chunk in _calls(rows, sampler.batch_size or len(rows), per_prompt):
        # Kept for a next turn only where one of the chunk's rows may have one.
        keeps = _keeps_cache(decoder, params) and any(goes_on(row) for row in chunk)
        groups: list[list[Trajectory]] = []
        for row in chunk:
            if groups and groups[-1][0].context == row.context and groups[-1][0].stream is row.stream:
                groups[-1].append(row)
            else:
                groups.append([row])
        counts = torch.tensor([len(group) for group in groups], device=device)
        streams = [group[0].stream for group in groups] if per_prompt else [chunk[0].stream]
        if _keeps_cache(decoder, params) and all(row.kept is not None for row in chunk):
            kept = _cached(chunk)
            blocks = [row.context[cached:] for row, cached in zip(chunk, kept.cached.tolist())]
            out, logprobs, kept = decoder.extend(kept, blocks, counts, streams, params=params)
        elif keeps:
            ids, mask = left_pad([group[0].context for group in groups], sampler.params.pad_token_id, device)
            out, logprobs, kept = decoder.decode(ids, mask, counts, streams, params=params, keep=True)
        else:
            ids, mask = left_pad([group[0].context for group in groups], sampler.params.pad_token_id, device)
            out, logprobs = decoder.decode(ids, mask, counts, streams, params=params)
        for k, row in enumerate(chunk):
            row.kept = (kept, k) if keeps else None
        drawn += [(out[k].tolist(), None if logprobs is None else logprobs[k].tolist()) for k in range(len(out))]
    return drawn


def _take_turn(sampler, row: Trajectory, tokens: list[int], logprobs: list[float] | None) -> list[Call]:
    """Add a turn the model sampled to `row` (up to its first EOS, within the budget); the
    tool calls to answer before its next turn (none: the rollout ends here)."""
    tok, budget, limit = sampler.tokenizer, sampler.params.max_new_tokens, sampler.tools.max_calls
    eos = sampler.params.eos_token_ids
    end = next((k + 1 for k, t in enumerate(tokens) if t in eos), len(tokens))
    new = tokens[: min(end, budget - len(row.tokens))]
    row.append(new, True, None if logprobs is None else logprobs[: len(new)])
    raw = tok.decode(new, skip_special_tokens=False)
    finished = bool(new) and new[-1] in eos  # the turn ended; not cut off by the budget
    written = tok.decode(new[:-1] if finished else new)  # the turn's text, without its end of turn
    calls = sampler.format.parse(written) if finished else []
    message = {"role": "assistant", "content": assistant_content(tok, sampler.format.content(raw))}
    if calls:
        message["tool_calls"] = [c.as_message() for c in calls]
    row.messages.append(message)
    row.as_written.append({"role": "assistant", "content": written})
    if not calls or (limit is not None and row.rounds >= limit) or row.episode.done:
        return []
    row.rounds += 1
    return calls


def _add_answers(sampler, row: Trajectory, answers: list[dict]) -> bool:
    """Append the tool messages that answer `row`'s turn (`answer_turn`'s) as the chat
    template writes them; whether the rollout goes on to another model turn."""
    tok, budget = sampler.tokenizer, sampler.params.max_new_tokens
    suffix = tok(sampler.format.suffix(answers), add_special_tokens=False)["input_ids"]
    if len(row.tokens) + len(suffix) >= budget:
        return False  # no room for the model's answer: dropped, the rollout ends at its turn
    row.messages += answers
    row.as_written += answers
    row.append(suffix, False)
    return True


@torch.no_grad()
def sample_turns(sampler, model, rows: list[dict], seeds, *, step: int, version, generator) -> Rollout:
    """`Sampler.sample` for a sampler with tools: G multi-turn rollouts of each row's
    prompt (module doc). Each rollout gets its own episode (`Toolbox.start`): its
    environment's reset text is appended to its prompt's last message, so a prompt's G
    rows may see different prompts (the Rollout's rows hold them so). `sampler` is the
    Sampler, read for its settings and its decoder; what single-turn sampling does alike
    (encoding prompts, checking they fit) is shared through `grpo.rollout.prompts`."""
    tok, group_size, toolbox = sampler.tokenizer, sampler.group_size, sampler.tools
    repeated = [row for row in rows for _ in range(group_size)]
    toolbox.check_prompts(rows, sampler.prompt_column)
    episodes, observations = toolbox.start(repeated)
    prompts = [with_observation(row[sampler.prompt_column], text) for row, text in zip(repeated, observations)]
    schemas = [toolbox.schemas_of(row) for row in repeated]  # with several environments, each row its own
    texts = [sampler.format.render(p, tools, generation=True) for p, tools in zip(prompts, schemas)]
    prompt_ids, prompt_mask, cut, texts = encode_prompts(tok, texts, sampler.max_prompt_length, chat=True)
    check_fits(model, prompt_ids.shape[1], sampler.max_prompt_length, sampler.params.max_new_tokens)
    device = next(model.parameters()).device

    # One random stream for all rows through every turn, or (rollout.seed_per_prompt) one per
    # data row and turn (`turn_seed`), which its G rows share.
    if seeds is None and generator is None and sampler.seed is not None:
        generator = torch.Generator(device=device).manual_seed(sampling_seed(sampler.seed, sampler.rank, step))
    trajectories = [
        Trajectory(ids[mask.bool()].tolist(), episode, None if seeds is None else seeds[i // group_size], generator)
        for i, (ids, mask, episode) in enumerate(zip(prompt_ids, prompt_mask, episodes))
    ]

    decoder = sampler.decoder(model, prompt_ids.shape[1])
    decoder.prepare(model, version)
    with_logprobs, limit = True, toolbox.max_calls

    def goes_on(row: Trajectory) -> bool:  # whether a row may have another turn
        return limit is None or row.rounds < limit

    try:
        active, turn_number = trajectories, 0
        while active:
            if seeds is not None:
                streams = {}
                for row in active:
                    if row.seed not in streams:
                        streams[row.seed] = torch.Generator(device=device).manual_seed(turn_seed(row.seed, turn_number))
                    row.stream = streams[row.seed]
            turn_number += 1
            # This turn's most new tokens: the most any of its rows has left of the budget.
            longest = max(sampler.params.max_new_tokens - len(row.tokens) for row in active)
            turn = dataclasses.replace(sampler.params, max_new_tokens=longest)
            drawn = decode_turn(sampler, decoder, active, turn, seeds is not None, device, goes_on)
            with_logprobs = with_logprobs and all(logprobs is not None for _, logprobs in drawn)
            calling = [
                (row, calls)
                for row, turn_drawn in zip(active, drawn)
                if (calls := _take_turn(sampler, row, *turn_drawn))
            ]
            answered = answer_turn([(row.episode, calls) for row, calls in calling])
            active = [row for (row, _), answers in zip(calling, answered) if _add_answers(sampler, row, answers)]
        exact = decoder.exact_logprobs()  # asked before release drops the prepared weights
    finally:
        if not sampler.hold_prepared:
            decoder.release()

    if not sampler.rendering_checked:
        sampler.rendering_checked = check_rendering(sampler, prompts, trajectories, cut.tolist(), schemas)
    return assemble(
        sampler,
        trajectories,
        prompt_ids.to(device),
        prompt_mask.to(device),
        version,
        with_logprobs=with_logprobs,
        exact=exact,
        prompts=texts,
        # A row whose environment added text holds its prompt as the model saw it: what reward
        # functions get as `prompts` (as TRL gives them) and samples.jsonl shows.
        rows=[
            row if text is None else {**row, sampler.prompt_column: prompt}
            for row, text, prompt in zip(repeated, observations, prompts)
        ],
        prompt_truncated=cut.to(device),
        environments=[e.environment for e in episodes] if toolbox.environments else None,
        tool_calls=torch.tensor([e.calls for e in episodes], dtype=torch.float32),
        tool_failures=torch.tensor([e.failures for e in episodes], dtype=torch.float32),
    )


def assemble(
    sampler,
    trajectories: list[Trajectory],
    prompt_ids,
    prompt_mask,
    version,
    *,
    with_logprobs: bool,
    exact: bool,
    **fields,
) -> Rollout:
    """The Rollout of multi-turn rollouts (the tools' turns, an agent's requests): each row's
    prompt, (N, P) left-padded, then its completion's tokens as sampled and appended, the
    loss mask on the model's own, the sampler's log-probs (0 on the others'; None unless
    every turn had them) and its messages; `fields`: the Rollout's other fields (prompts,
    rows, prompt_truncated, the tools' counts, ...)."""
    tok, device = sampler.tokenizer, prompt_ids.device
    n, pad = len(trajectories), sampler.params.pad_token_id
    width = max(max(len(row.tokens) for row in trajectories), 1)
    completion_ids = torch.full((n, width), pad, dtype=torch.long)
    completion_mask, loss_mask, sampled = torch.zeros((n, width)), torch.zeros((n, width)), torch.zeros((n, width))
    for i, row in enumerate(trajectories):
        length = len(row.tokens)
        completion_ids[i, :length] = torch.tensor(row.tokens, dtype=torch.long)
        completion_mask[i, :length] = 1.0
        loss_mask[i, :length] = torch.tensor(row.actions)
        sampled[i, :length] = torch.tensor(row.logprobs)
    completion_mask, loss_mask = completion_mask.to(device), loss_mask.to(device)
    return Rollout(
        input_ids=torch.cat([prompt_ids, completion_ids.to(device)], 1),
        attention_mask=torch.cat([prompt_mask, completion_mask.long()], 1),
        completion_mask=completion_mask,
        completions=tok.batch_decode(completion_ids, skip_special_tokens=True),
        group_size=sampler.group_size,
        loss_mask=loss_mask,
        sampled_logprobs=sampled.to(device) if with_logprobs else None,
        policy_version=0 if version is None else version,
        logprobs_exact=exact and with_logprobs,
        messages=[row.messages for row in trajectories],
        **fields,
    )


def check_rendering(
    sampler, prompts: list[list[dict]], rows: list[Trajectory], cut: list[bool], schemas: list[list[dict]]
) -> bool:
    """Whether the check was made: the first rollout with a tool message (and a whole
    prompt) rendered by the chat template, each model turn as the text it sampled, and
    tokenized as the sampler tokenizes a prompt, against the prompt's tokens and the
    completion's as sampled and appended. A one-line warning where they differ (training
    uses the tokens as sampled either way)."""
    for prompt, row, was_cut, tools in zip(prompts, rows, cut, schemas):
        if was_cut or not any(m["role"] == "tool" for m in row.as_written):
            continue
        tok = sampler.tokenizer
        text = sampler.format.render(list(prompt) + row.as_written, tools, generation=False)
        rendered = tok(text, add_special_tokens=False)["input_ids"]  # as encode_prompts tokenizes a chat
        ours = row.context
        if rendered[: len(ours)] != ours:
            at = next((k for k, (a, b) in enumerate(zip(rendered, ours)) if a != b), min(len(rendered), len(ours)))
            print(
                f"grpo: warning: rollout.tools: the chat template renders a sampled conversation to other tokens than "
                f"those sampled and appended (from token {at - len(row.prompt)} of the completion on); training uses "
                "the tokens as sampled (docs/tools.md)",
                file=sys.stderr,
            )
        return True
    return False
