"""The OpenAI-compatible endpoint over the policy and agent rollouts (grpo.rollout.endpoint,
grpo.rollout.agents), with plain-Python agents speaking HTTP through urllib.

- An episode's requests are answered in vLLM's dialect (the assistant message, tool calls
  parsed, logprobs.content, prompt_token_ids and token_ids); its turns become one sample:
  the answers' tokens as sampled (in the loss, their log-probs the trainer's), the messages
  a later request adds as the chat template writes them after the end of turn (out of it).
- Requests of concurrent episodes are decoded in one call; the queue gives a batch once every
  live episode waits, or after its window.
- A bad request is an OpenAI error object; a history that is not the episode's ends it with
  one warning line; an agent that raises scores None; the step goes on.
"""

import asyncio
import json
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import get_json_schema

from grpo.rollout.endpoint import ChatRequest, Requests
from grpo.rollout.sampler import Sampler
from grpo.train.layouts import policy_logprobs
from tests.helpers import assert_close_scaled, logprob_scale
from tests.rollout.tool_models import MULTIPLY_PROMPT, async_add, multiply

TOOLS = [get_json_schema(multiply), get_json_schema(async_add)]  # what the tool model learned with
ROW = {"prompt": MULTIPLY_PROMPT, "answer": "12"}


@pytest.fixture(scope="module")
def tool_lm(tool_model):
    return AutoTokenizer.from_pretrained(tool_model), AutoModelForCausalLM.from_pretrained(tool_model).eval()


def agent_sampler(tokenizer, agent, group_size=2, max_new_tokens=250, backend="fast"):
    """A sampler whose rollouts are `agent`'s episodes; at temperature 0.3 the tiny model's
    call of multiply, then its answer, are near certain."""
    return Sampler(
        tokenizer,
        prompt_column="prompt",
        group_size=group_size,
        max_new_tokens=max_new_tokens,
        temperature=0.3,
        backend=backend,
        draw="generate",
        seed=0,
        agent=agent,
    )


def post(url, body, raw: bytes | None = None):
    """(status, JSON answer) of a POST, errors included."""
    data = raw if raw is not None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def get(url):
    try:
        with urllib.request.urlopen(url, timeout=30) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


class MultiplyAgent:
    """An agent loop as users write one: ask, run the tools the model called, ask again, until
    an answer without a call; reward 1 when it is the product. Records every answer."""

    def __init__(self):
        self.answers: dict[str, list[dict]] = {}
        self.lock = threading.Lock()

    def __call__(self, base_url, row, *, model):
        messages, answers = list(row["prompt"]), []
        with self.lock:
            self.answers[base_url] = answers
        for _ in range(4):
            status, body = post(
                f"{base_url}/chat/completions",
                {"model": model, "messages": messages, "tools": TOOLS, "logprobs": True, "temperature": 0.7},
            )
            assert status == 200, body
            answers.append(body)
            message = body["choices"][0]["message"]
            messages.append(message)  # echoed as given: ids, arguments as JSON strings
            if not message["tool_calls"]:
                return {"reward": float(message["content"] == row["answer"]), "metrics": {"turns": len(answers)}}
            for call in message["tool_calls"]:
                arguments = json.loads(call["function"]["arguments"])
                messages.append(
                    {
                        "role": "tool",
                        "tool_call_id": call["id"],
                        "name": "multiply",
                        "content": str(multiply(**arguments)),
                    }
                )
        return 0.0


def spy_calls(sampler, model):
    """The rows of every decoding call (decode or the fast loop's extend)."""
    decoder, calls = sampler.decoder(model, 0), []
    decode, extend = decoder.decode, decoder.extend
    decoder.decode = lambda ids, mask, counts, *a, **k: (
        calls.append(int(counts.sum())) or decode(ids, mask, counts, *a, **k)
    )
    decoder.extend = lambda kept, blocks, *a, **k: calls.append(len(blocks)) or extend(kept, blocks, *a, **k)
    return calls


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_an_agent_s_episode_is_answered_in_vllm_s_dialect_and_becomes_one_sample(tool_lm, kind):
    tok, model = tool_lm
    agent = MultiplyAgent()
    if kind == "async":
        sync = agent

        async def agent(base_url, row, *, model):
            return await asyncio.to_thread(sync, base_url, row, model=model)

        agent.answers = sync.answers
    sampler = agent_sampler(tok, agent, group_size=4)
    calls = spy_calls(sampler, model)
    rollout = sampler.sample(model, [ROW])

    assert calls == [4, 4]  # the 4 episodes' first requests in one call, their second in one call
    assert [r.reward for r in rollout.environments] == [1.0] * 4
    assert all(r.metrics == {"turns": 2} and r.error is None for r in rollout.environments)
    fmt = sampler.format
    for url, answers in agent.answers.items():
        i = int(url.split("/episodes/")[1].split("-")[1])  # the episode's row of the rollout
        first, second = answers
        assert first["object"] == "chat.completion" and first["choices"][0]["finish_reason"] == "tool_calls"
        call = first["choices"][0]["message"]["tool_calls"][0]
        assert call["type"] == "function" and call["function"]["name"] == "multiply"
        assert json.loads(call["function"]["arguments"]) == {"a": 3, "b": 4}
        assert second["choices"][0]["message"]["content"] == "12" and second["choices"][0]["finish_reason"] == "stop"
        # The sample: the prompt, the first answer's tokens, the tool message as the template
        # writes it after the end of turn (tokenized alone), the second answer's tokens.
        t_len = rollout.completion_mask.shape[1]
        prompt = rollout.input_ids[i, :-t_len][rollout.attention_mask[i, :-t_len].bool()].tolist()
        completion = rollout.completion_ids[i][rollout.completion_mask[i].bool()].tolist()
        ids1, ids2 = first["choices"][0]["token_ids"], second["choices"][0]["token_ids"]
        suffix = tok(fmt.suffix([{"role": "tool", "name": "multiply", "content": "12"}]), add_special_tokens=False)[
            "input_ids"
        ]
        assert first["prompt_token_ids"] == prompt
        assert completion == ids1 + suffix + ids2
        assert second["prompt_token_ids"] == prompt + ids1 + suffix
        mask = [1.0] * len(ids1) + [0.0] * len(suffix) + [1.0] * len(ids2)
        assert rollout.loss_mask[i, : len(mask)].tolist() == mask and rollout.loss_mask[i, len(mask) :].sum() == 0
        # The log-probs returned are those recorded, and the trainer's.
        returned = [e["logprob"] for a in answers for e in a["choices"][0]["logprobs"]["content"]]
        recorded = rollout.sampled_logprobs[i][rollout.loss_mask[i].bool()]
        assert torch.equal(torch.tensor(returned, dtype=torch.float32), recorded)
        assert [e["token"] for e in first["choices"][0]["logprobs"]["content"]] == [tok.decode([t]) for t in ids1]
        assert first["usage"] == {
            "prompt_tokens": len(prompt),
            "completion_tokens": len(ids1),
            "total_tokens": len(prompt) + len(ids1),
        }
    assert rollout.messages[0][0]["tool_calls"][0]["function"] == {"name": "multiply", "arguments": {"a": 3, "b": 4}}
    assert rollout.messages[0][1]["role"] == "tool" and rollout.messages[0][-1] == {
        "role": "assistant",
        "content": "12",
    }
    assert rollout.rows[0]["prompt"] == MULTIPLY_PROMPT and rollout.tool_calls.tolist() == [1.0] * 4
    scored = policy_logprobs(model, rollout, 0.3)  # the run's temperature, not the request's 0.7
    actions = rollout.loss_mask.bool()
    assert rollout.logprobs_exact
    assert_close_scaled(rollout.sampled_logprobs[actions], scored[actions], scale=logprob_scale(scored))


def test_generate_s_episodes_are_the_fast_loop_s_without_log_probs(tool_lm):
    tok, model = tool_lm
    fast, hf = (agent_sampler(tok, MultiplyAgent(), backend=b).sample(model, [ROW]) for b in ("fast", "hf"))
    assert torch.equal(fast.input_ids, hf.input_ids) and torch.equal(fast.loss_mask, hf.loss_mask)
    assert hf.sampled_logprobs is None and not hf.logprobs_exact


def test_bad_requests_get_openai_errors_and_the_episode_goes_on(tool_lm):
    tok, model = tool_lm
    seen = {}

    def agent(base_url, row, *, model):
        root = base_url.rsplit("/episodes/", 1)[0]
        url = f"{base_url}/chat/completions"
        seen["not json"] = post(url, None, raw=b"{not json")
        seen["no messages"] = post(url, {"messages": []})
        seen["stream"] = post(url, {"messages": row["prompt"], "stream": True})
        seen["n"] = post(url, {"messages": row["prompt"], "n": 3})
        seen["bad message"] = post(url, {"messages": [{"content": "no role"}]})
        seen["max_tokens"] = post(url, {"messages": row["prompt"], "max_tokens": 0})
        seen["no episode"] = post(f"{root}/episodes/nobody/v1/chat/completions", {"messages": row["prompt"]})
        seen["models"] = get(f"{base_url}/models")
        seen["ok"] = post(url, {"messages": row["prompt"], "max_tokens": 3})
        return 0.5

    rollout = agent_sampler(tok, agent, group_size=1).sample(model, [ROW])
    for name in ("not json", "no messages", "stream", "n", "bad message", "max_tokens", "no episode"):
        status, body = seen[name]
        assert status == (404 if name == "no episode" else 400), (name, body)
        assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, name
        assert body["error"]["code"] == status and "\n" not in body["error"]["message"]
    assert seen["no messages"][1]["error"]["param"] == "messages"
    assert seen["models"][0] == 200 and seen["models"][1]["data"][0]["id"] == "policy"
    status, body = seen["ok"]
    assert (
        status == 200 and body["choices"][0]["finish_reason"] == "length" and len(body["choices"][0]["token_ids"]) == 3
    )
    assert rollout.environments[0].reward == 0.5 and rollout.environments[0].error is None
    assert int(rollout.loss_mask.sum()) == 3


def test_a_history_that_is_not_the_episode_s_ends_it_with_one_warning(tool_lm, capfd):
    tok, model = tool_lm
    seen = {}

    def agent(base_url, row, *, model):
        url = f"{base_url}/chat/completions"
        _, first = post(url, {"messages": row["prompt"], "tools": TOOLS})
        rewritten = [{"role": "user", "content": "What is 5 times 6?"}, first["choices"][0]["message"]]
        seen[base_url] = post(url, {"messages": rewritten + [{"role": "tool", "content": "30"}], "tools": TOOLS})
        return 1.0

    rollout = agent_sampler(tok, agent, group_size=2).sample(model, [ROW])
    warnings = [line for line in capfd.readouterr().err.splitlines() if "rollout.agent" in line]
    assert len(warnings) == 1 and "2 episode(s)" in warnings[0]
    for status, body in seen.values():
        assert status == 400 and "has ended" in body["error"]["message"]
    for i, result in enumerate(rollout.environments):
        assert result.ended and result.reward == 1.0
        assert rollout.loss_mask[i].sum() == rollout.completion_mask[i].sum()  # only the first answer
        assert len(rollout.messages[i]) == 1


def test_an_agent_that_raises_scores_none_and_the_others_go_on(tool_lm):
    tok, model = tool_lm
    count = {"n": 0}
    lock = threading.Lock()

    def agent(base_url, row, *, model):
        with lock:
            count["n"] += 1
            mine = count["n"]
        if mine == 4:
            raise SystemExit(3)  # before it ever asked
        post(f"{base_url}/chat/completions", {"messages": row["prompt"], "max_tokens": 2})
        if mine == 1:
            raise ValueError("the agent's own bug")
        if mine == 2:
            return "not a reward"
        return {"reward": 2.0, "metrics": {"steps": 1}}

    sampler = agent_sampler(tok, agent, group_size=4)
    rollout = sampler.sample(model, [ROW])
    errors = sorted(str(r.error) for r in rollout.environments)
    assert errors == ["None", "called sys.exit(3)", "raised ValueError: the agent's own bug", errors[3]]
    assert "expected a number" in errors[3]
    assert sorted(r.reward is None for r in rollout.environments) == [False, True, True, True]
    assert sorted(r.requests for r in rollout.environments) == [0, 1, 1, 1]
    silent = next(i for i, r in enumerate(rollout.environments) if r.requests == 0)
    assert rollout.completion_mask[silent].sum() == 0  # its row's prompt, an empty completion
    t_len = rollout.completion_mask.shape[1]
    prompt = rollout.input_ids[silent, :-t_len][rollout.attention_mask[silent, :-t_len].bool()].tolist()
    assert rollout.prompts[silent] == tok.apply_chat_template(
        MULTIPLY_PROMPT, add_generation_prompt=True, tokenize=False
    )
    assert prompt == tok(rollout.prompts[silent], add_special_tokens=True)["input_ids"]


# ---- the queue --------------------------------------------------------------------------------


def request(episode):
    return ChatRequest(episode, [{"role": "user", "content": "x"}], None, None, False, "m")


def test_the_queue_batches_once_every_live_episode_waits():
    requests = Requests(["a", "b", "c"], window=60.0)
    threads = [threading.Thread(target=requests.submit, args=(request(e),)) for e in "ab"]
    for t in threads:
        t.start()
    taken = []
    taker = threading.Thread(target=lambda: taken.append(requests.take()))
    taker.start()
    time.sleep(0.3)
    assert not taken  # c is live and not waiting: the batch waits for it (its window is long)
    requests.finish("c")  # c's agent returned: everyone live waits now
    taker.join(10)
    assert sorted(r.episode for r in taken[0]) == ["a", "b"]
    for r in taken[0]:
        r.answer({})
    requests.finish("a")
    requests.finish("b")
    assert requests.take() is None  # nothing live, nothing waiting


def test_the_queue_gives_what_waits_after_its_window():
    requests = Requests(["a", "b"], window=0.2)
    threading.Thread(target=requests.submit, args=(request("a"),), daemon=True).start()
    start = time.monotonic()
    batch = requests.take()
    assert [r.episode for r in batch] == ["a"] and time.monotonic() - start >= 0.15
    second = request("a")
    threading.Thread(target=requests.submit, args=(second,), daemon=True).start()
    time.sleep(0.1)
    conflict = request("a")
    requests.submit(conflict)  # one request at a time per episode: refused at once
    assert conflict.status == 409
    requests.close()
    assert second.done.wait(5) and second.status == 400


def test_a_template_that_writes_the_bos_gets_it_once(tool_lm):
    """A tokenizer that adds <s> with a template that writes it too (as Llama 3's): the
    episode's prompt holds one <s>, as the chat template writes it."""
    import copy

    from tokenizers.processors import TemplateProcessing

    tok, model = tool_lm
    tok = copy.deepcopy(tok)
    bos = tok.bos_token_id
    tok._tokenizer.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    tok.chat_template = "{{ bos_token }}" + tok.chat_template
    answers = []

    def agent(base_url, row, *, model):
        answers.append(post(f"{base_url}/chat/completions", {"messages": row["prompt"], "max_tokens": 4})[1])

    sampler = agent_sampler(tok, agent, group_size=1, max_new_tokens=8)
    rollout = sampler.sample(model, [ROW])
    prompt_ids = answers[0]["prompt_token_ids"]
    assert prompt_ids[0] == bos and bos not in prompt_ids[1:]
    t_len = rollout.completion_mask.shape[1]
    assert rollout.input_ids[0, :-t_len][rollout.attention_mask[0, :-t_len].bool()].tolist() == prompt_ids
