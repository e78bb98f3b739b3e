"""Agent programs as rollouts (rollout.agent; docs/tools.md#agent-programs-the-openai-compatible-endpoint).

Each rollout is one call of the user's agent, `agent(base_url, row, *, model)`, sync (on a
thread of its own) or async (on one event loop with the others), all of a step's at once.
The agent owns its loop and drives the policy through the endpoint (`grpo.rollout.endpoint`)
as any OpenAI client would; what it returns is the episode's reward: a number, a dict
`{"reward": number | None, "metrics": {name: number}}`, or None (the run's rewards score
the conversation). It is contained as a tool is: whatever it raises, the episode's reward is
None (`agent/failed`) and the run goes on.

An episode's requests become one training sample, built as the tools' turns build theirs
(`grpo.rollout.turns`: `Trajectory`, `decode_turn`, `assemble`): the first request's prompt,
rendered by the chat template, is the prompt; each answer's sampled tokens are in the loss,
as sampled; the messages a later request adds after the episode's conversation (tool
results, user turns) are rendered after the last answer's end of turn (the chat template's
text from there on) and tokenized alone, out of the loss. A later request must repeat the
episode's conversation (its answers as given); one that does not ends the episode there
(one warning line per step) and is refused. The requests of all live episodes are decoded
together, in one call of the sampler's decoder.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import numbers
import sys
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from grpo.errors import UserError
from grpo.infra import contain
from grpo.infra.imports import import_object, one_line, spec_of
from grpo.infra.seed import sampling_seed
from grpo.rewards.types import WeightedReward
from grpo.rollout.batch import Rollout
from grpo.rollout.endpoint import ChatRequest, Endpoint, EndpointError, Requests, completion_body
from grpo.rollout.padding import left_pad
from grpo.rollout.prompts import check_fits, encode_prompts, prompt_text
from grpo.rollout.tool_formats import tool_format_for
from grpo.rollout.turns import Trajectory, assemble, assistant_content, decode_turn

__all__ = ["MODEL", "AgentResult", "agent_reward", "load_agent", "sample_agents"]

MODEL = "policy"  # the model name the endpoint gives (a request may name any)


def load_agent(spec):
    """The agent program rollout.agent names ('pkg.module:function', or the callable itself)."""
    agent = spec if callable(spec) else import_object(spec, kind="agent", form="pkg.module:function")
    if not callable(agent) or isinstance(agent, type):
        raise UserError(f"rollout.agent {spec_of(spec)!r}: not a function (agent(base_url, row, *, model))")
    return agent


@dataclass
class AgentResult:
    """What one episode came to: the agent's reward (None: none), its metrics, the error it
    raised, how many requests it made, and why the episode ended before the agent did.
    Reward functions get these as `environments` (as an environment's instances)."""

    reward: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    requests: int = 0
    ended: str | None = None


def _result(value: Any, result: AgentResult) -> None:
    """Read what an agent returned into `result` (a wrong type is the agent's error)."""
    if isinstance(value, dict):
        reward, metrics = value.get("reward"), value.get("metrics") or {}
    else:
        reward, metrics = value, {}
    number = isinstance(reward, numbers.Real) and not isinstance(reward, bool)
    valid_metrics = isinstance(metrics, dict) and all(
        isinstance(k, str) and isinstance(v, numbers.Real) and math.isfinite(v) for k, v in metrics.items()
    )
    if (reward is not None and not number) or not valid_metrics:
        result.error = (
            f"returned {one_line(repr(value))[:120]}; expected a number, None, or "
            "{'reward': number | None, 'metrics': {name: number}}"
        )
        return
    result.reward = None if reward is None else float(reward)
    result.metrics = {k: float(v) for k, v in metrics.items()}


@dataclass
class _Episode:
    """One rollout of an agent: its row, its trajectory (from its first request on) and its
    conversation as rendered (the first request's messages, each answer as given, what each
    later request added)."""

    id: str
    row: dict
    result: AgentResult = field(default_factory=AgentResult)
    trajectory: Trajectory | None = None
    history: list[dict] = field(default_factory=list)
    prompt: list[dict] | None = None  # the first request's messages
    text: str = ""  # the prompt as the model sees it
    cut: bool = False  # the prompt lost its start (rollout.max_prompt_length)
    calls: int = 0  # tool calls the model made
    failures: int = 0  # tool calls written badly
    over: bool = False  # no more tokens: the budget is spent


# ---- one request ------------------------------------------------------------------------------


def _format(sampler):
    """The run's tool-call format (rollout.tool_format), built and checked at the first
    request with tools (an agent that sends none needs no tool-call template); a 400 where
    the chat template speaks none."""
    if sampler.format is None:
        rollout = sampler.settings.rollout
        name = getattr(rollout, "tool_format", "auto")
        try:
            sampler.format = tool_format_for(sampler.tokenizer, name, sampler.template_kwargs)
        except UserError as err:
            raise EndpointError(str(err), param="tools") from None
    return sampler.format


def _render(sampler, messages: list[dict], tools, generation: bool) -> str:
    """The chat template's text of `messages` (with `tools`: through the tool-call format),
    or a 400 for the request."""
    try:
        if tools or sampler.format is not None:
            return _format(sampler).render(messages, tools, generation=generation)
        if generation:
            return prompt_text(messages, sampler.tokenizer, template_kwargs=sampler.template_kwargs)
        return sampler.tokenizer.apply_chat_template(messages, tokenize=False, **sampler.template_kwargs)
    except EndpointError:
        raise
    except UserError as err:
        raise EndpointError(str(err)) from None
    except Exception as err:
        raise EndpointError(f"the chat template cannot render this request ({one_line(str(err))})") from None


def _key(message: dict) -> tuple:
    """What a repeated message must keep: its role, its text and its tool calls (not their ids)."""
    calls = [
        (c["function"]["name"], json.dumps(c["function"]["arguments"], sort_keys=True))
        for c in message.get("tool_calls", [])
    ]
    return message["role"], (message.get("content") or "").strip(), calls


class _Ended(Exception):
    """The request's history is not the episode's: the episode ends here."""


def _first(sampler, model, episode: _Episode, request: ChatRequest, stream) -> None:
    """An episode's first request: its rendered messages become the prompt."""
    text = _render(sampler, request.messages, request.tools, True)
    ids, mask, cut, texts = encode_prompts(sampler.tokenizer, [text], sampler.max_prompt_length, chat=True)
    try:
        check_fits(model, ids.shape[1], sampler.max_prompt_length, sampler.params.max_new_tokens)
    except UserError as err:
        raise EndpointError(str(err), param="messages") from None
    episode.trajectory = Trajectory(ids[0][mask[0].bool()].tolist(), None, None, stream)
    episode.prompt, episode.history = request.messages, list(request.messages)
    episode.text, episode.cut = texts[0], bool(cut[0])


def _later(sampler, episode: _Episode, request: ChatRequest) -> None:
    """A later request: it repeats the episode's conversation, and the messages it adds are
    appended, out of the loss, as the chat template writes them after the last answer's
    end of turn (module doc)."""
    history, row, tok = episode.history, episode.trajectory, sampler.tokenizer
    sent = request.messages
    at = next((k for k, (a, b) in enumerate(zip(sent, history)) if _key(a) != _key(b)), None)
    if len(sent) < len(history) or at is not None:
        where = len(sent) if at is None else at
        raise _Ended(f"message {where} is not the episode's conversation as it was answered")
    added = sent[len(history) :]
    before = _render(sampler, history, request.tools, False)
    after = _render(sampler, history + added, request.tools, True)
    eos = tok.eos_token or ""
    end = before.rfind(eos) if eos else -1
    if not after.startswith(before) or end < 0:
        raise _Ended("the chat template renders the conversation's earlier turns otherwise once messages follow")
    ended = bool(row.tokens) and row.tokens[-1] in sampler.params.eos_token_ids
    suffix = after[end + len(eos) :] if ended else after[end:]  # a turn cut short gets its end of turn here
    tokens = tok(suffix, add_special_tokens=False)["input_ids"]
    if len(row.tokens) + len(tokens) >= sampler.params.max_new_tokens:
        episode.over = True  # no room for an answer: the episode ends at its last answer
        return
    episode.history += added
    row.messages += added
    row.append(tokens, False)


def _answer(sampler, episode: _Episode, request: ChatRequest, tokens, logprobs, allowed: int) -> dict:
    """Add what the decoder drew to the episode (up to its first EOS, within `allowed`) and
    the `chat.completion` that answers the request."""
    tok, row, eos = sampler.tokenizer, episode.trajectory, sampler.params.eos_token_ids
    context = list(row.context)
    end = next((k + 1 for k, t in enumerate(tokens) if t in eos), len(tokens))
    new = tokens[: min(end, allowed)]
    if len(new) < end:
        row.kept = None  # the fast loop's cache holds tokens past the kept ones: the next turn recomputes
    drawn = None if logprobs is None else logprobs[: len(new)]
    row.append(new, True, drawn)
    finished = bool(new) and new[-1] in eos
    raw = tok.decode(new, skip_special_tokens=False)
    fmt = _format(sampler) if request.parse_tools else None
    calls = [] if fmt is None else fmt.parse(raw)
    good = [c for c in calls if c.error is None]
    episode.calls += len(calls)
    episode.failures += len(calls) - len(good)
    if len(good) < len(calls):  # a call written badly: no call, the whole text, as vLLM's parser leaves it
        good = []
    content = assistant_content(tok, fmt.content(raw) if good else raw, calls=False)
    ours = {"role": "assistant", "content": content}
    if good:
        ours["tool_calls"] = [c.as_message() for c in good]
    episode.history.append(ours)
    row.messages.append(ours)
    message = {"role": "assistant", "content": content or None, "reasoning": None}
    message["tool_calls"] = [
        {
            "id": f"chatcmpl-tool-{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": c.name, "arguments": json.dumps(c.arguments)},
        }
        for c in good
    ]
    if len(row.tokens) >= sampler.params.max_new_tokens:
        episode.over = True
    reason = "tool_calls" if good else "stop" if finished else "length"
    texts = [tok.decode([t]) for t in new]
    return completion_body(request, message, reason, context, new, drawn, texts)


def _empty(request: ChatRequest, episode: _Episode) -> dict:
    """The answer once the episode's budget (rollout.max_new_tokens) is spent: nothing more."""
    message = {"role": "assistant", "content": None, "reasoning": None, "tool_calls": []}
    return completion_body(request, message, "length", list(episode.trajectory.context), [], [], [])


# ---- the agents -------------------------------------------------------------------------------


def _run_agents(agent, endpoint: Endpoint, episodes: list[_Episode], requests: Requests) -> None:
    """Every episode's agent call at once (module doc), each contained; `requests` hears of
    each one's end as it comes."""
    sync = not contain.is_async(agent)
    pool = ThreadPoolExecutor(max_workers=len(episodes), thread_name_prefix="grpo agent") if sync else None

    def call(episode: _Episode):
        async def one():
            url, row = endpoint.base_url(episode.id), dict(episode.row)
            try:
                if pool is None:
                    return await agent(url, row, model=MODEL)
                loop = asyncio.get_running_loop()
                thunk = lambda: agent(url, row, model=MODEL)  # noqa: E731
                return await loop.run_in_executor(pool, contain.call_function, thunk, {}, None)
            finally:
                requests.finish(episode.id)

        return one

    try:
        outcomes = contain.call_functions_concurrently([(call(e), {}, None) for e in episodes])
        for episode, outcome in zip(episodes, outcomes):
            try:
                _result(outcome.get(), episode.result)
            except (contain.Failed, UserError) as err:
                episode.result.error = getattr(err, "description", None) or f"raised {one_line(str(err))}"
    finally:
        for episode in episodes:
            requests.finish(episode.id)
        if pool is not None:
            pool.shutdown(wait=False)


@torch.no_grad()
def sample_agents(sampler, model, rows: list[dict], seeds, *, step: int, version, generator) -> Rollout:
    """`Sampler.sample` for a sampler with an agent: G episodes of each row, each one call
    of the agent against the endpoint (module doc). One random stream for all: which
    requests share a decoding call depends on when they come, so rollout.seed_per_prompt's
    per-prompt streams (`seeds`) are not drawn from."""
    tok, device = sampler.tokenizer, next(model.parameters()).device
    if generator is None and sampler.seed is not None:
        generator = torch.Generator(device=device).manual_seed(sampling_seed(sampler.seed, sampler.rank, step))
    repeated = [row for row in rows for _ in range(sampler.group_size)]
    episodes = [_Episode(f"{step}-{i}-{uuid.uuid4().hex[:8]}", row) for i, row in enumerate(repeated)]
    by_id = {e.id: e for e in episodes}
    requests = Requests(list(by_id))
    budget = sampler.params.max_new_tokens
    decoder = sampler.decoder(model, sampler.max_prompt_length)
    decoder.prepare(model, version)
    with_logprobs, warned = True, []
    try:
        with Endpoint(requests, MODEL) as endpoint:
            runner = threading.Thread(
                target=_run_agents, args=(sampler.agent, endpoint, episodes, requests), name="grpo agents", daemon=True
            )
            runner.start()
            while (batch := requests.take()) is not None:
                ready = []  # (episode, request, tokens it may sample)
                for request in batch:
                    episode = by_id[request.episode]
                    episode.result.requests += 1
                    try:
                        if episode.result.ended:
                            raise EndpointError(f"episode {episode.id!r} has ended: {episode.result.ended}")
                        if episode.trajectory is None:
                            _first(sampler, model, episode, request, generator)
                        elif not episode.over:
                            _later(sampler, episode, request)
                    except EndpointError as err:
                        request.refuse(err)
                        continue
                    except _Ended as err:
                        episode.result.ended = str(err)
                        warned.append(episode)
                        request.refuse(EndpointError(f"episode {episode.id!r} has ended: {err} (docs/tools.md)"))
                        continue
                    allowed = budget - len(episode.trajectory.tokens)
                    allowed = allowed if request.max_tokens is None else min(allowed, request.max_tokens)
                    if episode.over or allowed <= 0:
                        episode.over = True
                        request.answer(_empty(request, episode))
                    else:
                        ready.append((episode, request, allowed))
                if not ready:
                    continue
                params = dataclasses.replace(sampler.params, max_new_tokens=max(a for _, _, a in ready))
                trajectories = [e.trajectory for e, _, _ in ready]
                drawn = decode_turn(sampler, decoder, trajectories, params, False, device, lambda row: True)
                with_logprobs = with_logprobs and all(lp is not None for _, lp in drawn)
                for (episode, request, allowed), (tokens, logprobs) in zip(ready, drawn):
                    request.answer(_answer(sampler, episode, request, tokens, logprobs, allowed))
            runner.join()
        exact = decoder.exact_logprobs()  # asked before release drops the prepared weights
    finally:
        requests.close()
        if not sampler.hold_prepared:
            decoder.release()
    if warned:
        print(
            f"grpo: warning: rollout.agent: {len(warned)} episode(s) sent a conversation that is not their own "
            f"(episode {warned[0].id}: {warned[0].result.ended}); each ended there (docs/tools.md)",
            file=sys.stderr,
        )
    failed = [e for e in episodes if e.result.error is not None]
    if failed:
        print(
            f"grpo: warning: rollout.agent: {len(failed)} episode(s) failed, their reward None "
            f"(episode {failed[0].id}: the agent {failed[0].result.error})",
            file=sys.stderr,
        )
    for episode in episodes:  # an agent that never asked: its row's prompt, an empty completion
        if episode.trajectory is None:
            text = _row_prompt(sampler, episode.row)
            chat = isinstance(episode.row.get(sampler.prompt_column), list)  # rendered by the template
            ids, mask, cut, texts = encode_prompts(tok, [text], sampler.max_prompt_length, chat=chat)
            episode.trajectory = Trajectory(ids[0][mask[0].bool()].tolist(), None, None)
            episode.text, episode.cut = texts[0], bool(cut[0])
    trajectories = [e.trajectory for e in episodes]
    prompt_ids, prompt_mask = left_pad([t.prompt for t in trajectories], sampler.params.pad_token_id, device)
    return assemble(
        sampler,
        trajectories,
        prompt_ids,
        prompt_mask,
        version,
        with_logprobs=with_logprobs,
        exact=exact,
        prompts=[e.text for e in episodes],
        # The prompt as the agent sent it: what reward functions get as `prompts`.
        rows=[e.row if e.prompt is None else {**e.row, sampler.prompt_column: e.prompt} for e in episodes],
        prompt_truncated=torch.tensor([e.cut for e in episodes], device=device),
        environments=[e.result for e in episodes],
        tool_calls=torch.tensor([e.calls for e in episodes], dtype=torch.float32),
        tool_failures=torch.tensor([e.failures for e in episodes], dtype=torch.float32),
    )


def _row_prompt(sampler, row: dict) -> str:
    """The prompt of an episode whose agent never asked: its row's, as a sampler renders it
    (the tokenizer's EOS where the row has none the template can render)."""
    prompt = row.get(sampler.prompt_column)
    try:
        if prompt:
            return prompt_text(prompt, sampler.tokenizer, template_kwargs=sampler.template_kwargs)
    except Exception:
        pass
    return sampler.tokenizer.eos_token or " "


def agent_reward() -> WeightedReward:
    """The agents' rewards as a reward of weight 1 (as an environment's get_reward), reading
    each episode's `AgentResult` from `environments`; it logs the agents' metrics
    (agent/<name>: their mean over the episodes that gave one) and agent/failed (the share
    of episodes whose agent raised)."""

    def agent(environments, log_metric=None, **kwargs):
        for result in environments if log_metric is not None else ():
            log_metric("agent/failed", float(result.error is not None))
            for name, value in result.metrics.items():
                log_metric(f"agent/{name}", value)
        return [result.reward for result in environments]

    return WeightedReward(name="agent", fn=agent, weight=1.0)
