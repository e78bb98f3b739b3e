"""Multi-turn rollouts: the model's turns and its tools' answers, one completion per rollout.

A rollout runs turn by turn. The model samples a turn (up to and including its EOS, the
chat template's end of turn); if the turn calls tools (`grpo.rollout.tools.parse_calls`),
the calls run, their tool messages are rendered by the chat template and tokenized alone,
the tokens are appended, and the model samples its next turn after them. A rollout ends at
a turn without a call, at a turn past rollout.max_tool_calls, or when the whole completion
(model and tool tokens together) reaches max_new_tokens; a turn's tool messages that would
leave no room for one more model token are dropped and the rollout ends at that turn (as
TRL drops them), though its calls have run.

Tokens stay as sampled. The completion is the model's sampled tokens and the tool messages'
tokens, concatenated; what the model wrote is never re-tokenized (a text that decodes and
encodes back to other tokens would train the policy on tokens it never sampled). The
Rollout's `completion_mask` holds every one of them (attended to, counted in the lengths);
its `loss_mask` only the model's: tool tokens are no action of the policy, and the step
leaves them out of every loss and statistic through that one mask. The sampler's log-probs
are 0 on them. Once per sampler, `check_rendering` compares a conversation with the tokens
the chat template renders it to, and warns in one line where they differ.

A first version, on every decoder behind the seam (`Decoder.decode`): each turn is one
decoding call per batch of rows, its prompt the row's prompt and completion so far; the
fast loop's KV cache is not kept across turns (each turn computes its prefix again). Rows
with the same context and random stream (a prompt's G rows at the first turn) share one
prompt in a call. A turn asks for at most the most tokens any of its rows has left; each
row keeps what fits its own budget (a sample's prefix is a sample). Sampling options apply
per turn (min_new_tokens holds back each turn's EOS, as TRL's loop asks each turn again).
"""

from __future__ import annotations

import dataclasses
import sys

import torch

from grpo.errors import UserError
from grpo.infra.seed import sampling_seed
from grpo.rollout.batch import Rollout
from grpo.rollout.tools import parse_calls, with_observation

__all__ = ["check_rendering", "sample_turns"]


def _left_pad(contexts: list[list[int]], pad: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(c) for c in contexts)
    ids = torch.full((len(contexts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(contexts), width), dtype=torch.long)
    for k, context in enumerate(contexts):
        ids[k, width - len(context) :] = torch.tensor(context, dtype=torch.long)
        mask[k, width - len(context) :] = 1
    return ids.to(device), mask.to(device)


def _content(tokenizer, raw: str) -> str:
    """A model turn's message content: its text without tool-call blocks or special tokens."""
    from grpo.rollout.tools import _CALL

    text = _CALL.sub("", raw)
    for special in tokenizer.all_special_tokens:
        text = text.replace(special, "")
    return text.strip()


@torch.no_grad()
def sample_turns(sampler, model, rows: list[dict], seeds, *, step: int, version, generator) -> Rollout:
    """`Sampler.sample` for a sampler with tools: G multi-turn rollouts of each row's
    prompt (module doc). Each rollout gets its own episode (`Toolbox.start`): its
    environment's reset text is appended to its prompt's last message, so a prompt's G
    rows may see different prompts."""
    tok, group_size, toolbox = sampler.tokenizer, sampler.group_size, sampler.tools
    params, pad = sampler.params, sampler.params.pad_token_id
    eos = set(params.eos_token_ids)
    repeated = [row for row in rows for _ in range(group_size)]
    prompts = []
    for row in repeated:
        prompt = row[sampler.prompt_column]
        if isinstance(prompt, str):
            raise UserError(
                "rollout.tools / rollout.environment: the prompts must be chat messages (a list of "
                "{'role': ..., 'content': ...}), not plain text: the tools reach the model through the chat template"
            )
        prompts.append(prompt)
    episodes, observations = toolbox.start(repeated)
    prompts = [with_observation(p, text) for p, text in zip(prompts, observations)]
    texts = [sampler.format.render(p, toolbox.schemas, generation=True) for p in prompts]
    encoded = tok(texts, padding=True, return_tensors="pt", add_special_tokens=True)
    from grpo.rollout.sampler import keep_last_tokens

    prompt_ids, prompt_mask, cut = keep_last_tokens(
        encoded["input_ids"], encoded["attention_mask"], sampler.max_prompt_length
    )
    sampler._check_fits(model, prompt_ids.shape[1])
    texts = [
        tok.decode(ids[mask.bool()], skip_special_tokens=False, clean_up_tokenization_spaces=False) if was_cut else text
        for text, ids, mask, was_cut in zip(texts, prompt_ids, prompt_mask, cut.tolist())
    ]
    device = next(model.parameters()).device
    contexts = [ids[mask.bool()].tolist() for ids, mask in zip(prompt_ids, prompt_mask)]

    # One random stream per data row (rollout.seed_per_prompt), or one for all rows.
    if seeds is not None:
        streams = [torch.Generator(device=device).manual_seed(s) for s in seeds]
        stream_of = [streams[i // group_size] for i in range(len(repeated))]
    else:
        if generator is None and sampler.seed is not None:
            generator = torch.Generator(device=device).manual_seed(sampling_seed(sampler.seed, sampler.rank, step))
        stream_of = [generator] * len(repeated)

    n, budget = len(repeated), params.max_new_tokens
    completion: list[list[int]] = [[] for _ in range(n)]
    actions: list[list[float]] = [[] for _ in range(n)]
    logprobs: list[list[float]] = [[] for _ in range(n)]
    messages: list[list[dict]] = [[] for _ in range(n)]  # the completion as chat messages
    as_written: list[list[dict]] = [[] for _ in range(n)]  # the same, each turn's text as sampled
    rounds = [0] * n
    with_logprobs = True
    decoder = sampler.decoder(model, prompt_ids.shape[1])
    decoder.prepare(model, version)
    try:
        active = list(range(n))
        while active:
            left = {i: budget - len(completion[i]) for i in active}
            turn = dataclasses.replace(params, max_new_tokens=max(left.values()))
            drawn = {}
            size = sampler.batch_size or len(active)
            for start in range(0, len(active), size):
                chunk = active[start : start + size]
                groups: list[tuple[list[int], list[int]]] = []  # (context, its rows)
                for i in chunk:
                    context = contexts[i] + completion[i]
                    last = groups[-1] if groups else None
                    if last is not None and last[0] == context and stream_of[last[1][0]] is stream_of[i]:
                        last[1].append(i)
                    else:
                        groups.append((context, [i]))
                ids, mask = _left_pad([context for context, _ in groups], pad, device)
                counts = torch.tensor([len(r) for _, r in groups], device=device)
                streams_used = [stream_of[r[0]] for _, r in groups] if seeds is not None else [stream_of[chunk[0]]]
                out, out_logprobs = decoder.decode(ids, mask, counts, streams_used, params=turn)
                with_logprobs = with_logprobs and out_logprobs is not None
                for k, i in enumerate(i for _, r in groups for i in r):
                    drawn[i] = (out[k].tolist(), None if out_logprobs is None else out_logprobs[k].tolist())
            going_on = []
            for i in active:
                tokens, token_logprobs = drawn[i]
                end = next((k + 1 for k, t in enumerate(tokens) if t in eos), len(tokens))
                new = tokens[: min(end, left[i])]
                completion[i] += new
                actions[i] += [1.0] * len(new)
                logprobs[i] += token_logprobs[: len(new)] if token_logprobs is not None else [0.0] * len(new)
                raw = tok.decode(new, skip_special_tokens=False)
                finished = bool(new) and new[-1] in eos  # the turn ended; not cut off by the budget
                calls = parse_calls(raw) if finished else []
                message = {"role": "assistant", "content": _content(tok, raw)}
                written = {"role": "assistant", "content": tok.decode(new[:-1] if finished else new)}
                if calls:
                    message["tool_calls"] = [c.as_message() for c in calls]
                messages[i].append(message)
                as_written[i].append(written)
                limit = toolbox.max_calls
                if not calls or (limit is not None and rounds[i] >= limit):
                    continue
                rounds[i] += 1
                answers = [episodes[i].run(call) for call in calls]
                suffix = tok(sampler.format.suffix(answers), add_special_tokens=False)["input_ids"]
                if len(completion[i]) + len(suffix) >= budget:
                    continue  # no room for the model's answer: dropped, the rollout ends here
                messages[i] += answers
                as_written[i] += answers
                completion[i] += suffix
                actions[i] += [0.0] * len(suffix)
                logprobs[i] += [0.0] * len(suffix)
                going_on.append(i)
            active = going_on
        exact = decoder.exact_logprobs()  # asked before release drops the prepared weights
    finally:
        if not sampler.hold_prepared:
            decoder.release()

    width = max(max(len(c) for c in completion), 1)
    completion_ids = torch.full((n, width), pad, dtype=torch.long)
    completion_mask = torch.zeros((n, width))
    loss_mask = torch.zeros((n, width))
    sampled = torch.zeros((n, width))
    for i in range(n):
        length = len(completion[i])
        completion_ids[i, :length] = torch.tensor(completion[i], dtype=torch.long)
        completion_mask[i, :length] = 1.0
        loss_mask[i, :length] = torch.tensor(actions[i])
        sampled[i, :length] = torch.tensor(logprobs[i])
    if not sampler.rendering_checked:
        sampler.rendering_checked = check_rendering(
            sampler, prompts, as_written, contexts, completion, cut.tolist(), toolbox.schemas
        )
    completion_mask, loss_mask = completion_mask.to(device), loss_mask.to(device)
    return Rollout(
        input_ids=torch.cat([prompt_ids.to(device), completion_ids.to(device)], 1),
        attention_mask=torch.cat([prompt_mask.to(device), completion_mask.long()], 1),
        completion_mask=completion_mask,
        prompts=texts,
        completions=tok.batch_decode(completion_ids, skip_special_tokens=True),
        rows=repeated,
        group_size=group_size,
        prompt_truncated=cut.to(device),
        loss_mask=loss_mask,
        sampled_logprobs=sampled.to(device) if with_logprobs else None,
        policy_version=0 if version is None else version,
        logprobs_exact=exact and with_logprobs,
        messages=messages,
        environments=[e.environment for e in episodes] if toolbox.environment is not None else None,
        tool_calls=torch.tensor([e.calls for e in episodes], dtype=torch.float32),
        tool_failures=torch.tensor([e.failures for e in episodes], dtype=torch.float32),
    )


def check_rendering(sampler, prompts, as_written, contexts, completion, cut, schemas) -> bool:
    """Whether the check was made: the first rollout with a tool message (and a whole
    prompt) rendered by the chat template, each model turn as the text it sampled, and
    tokenized as the sampler tokenizes a prompt, against the prompt's tokens and the
    completion's as sampled and appended. A one-line warning where they differ (training
    uses the tokens as sampled either way)."""
    for i, turns in enumerate(as_written):
        if cut[i] or not any(m["role"] == "tool" for m in turns):
            continue
        tok = sampler.tokenizer
        text = sampler.format.render(list(prompts[i]) + turns, schemas, generation=False)
        rendered = tok(text, add_special_tokens=True)["input_ids"]
        ours = contexts[i] + completion[i]
        if rendered[: len(ours)] != ours:
            at = next((k for k, (a, b) in enumerate(zip(rendered, ours)) if a != b), min(len(rendered), len(ours)))
            print(
                f"grpo: warning: rollout.tools: the chat template renders a sampled conversation to other tokens than "
                f"those sampled and appended (from token {at - len(contexts[i])} of the completion on); training uses "
                "the tokens as sampled (docs/tools.md)",
                file=sys.stderr,
            )
        return True
    return False
