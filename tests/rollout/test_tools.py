"""Multi-turn rollouts with tools and environments (grpo.rollout.tools, grpo.rollout.turns).

- Tokens stay as sampled: every completion is the model's sampled turns (as the decoder gave
  them, cut at EOS) and the tool messages' tokens (each turn's rendered alone), end to end,
  on the fast loop and on generate; the loss mask is 1 exactly on the sampled tokens.
- Tools are contained: one that raises, hangs, calls sys.exit or os._exit or is called badly
  answers the model with an error and counts as a failure, and the rollout goes on; with
  rollout.tool_isolate, one that crashes its worker process (a segfault) too, and one that
  hangs is killed; a non-string result goes back as JSON, one without JSON is refused in one
  line.
- rollout.max_tool_calls and the token budget end a rollout; an environment's reset adds
  text to the prompt and gets the row's columns.
- The chat template: a template without the <tool_call> format is refused in one line; a
  conversation the template renders to other tokens than those sampled warns once.
"""

import asyncio
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpo.config import config_from_dict, config_to_dict
from grpo.errors import UserError
from grpo.infra import contain
from grpo.rollout import turns
from grpo.rollout.decoders import Decoder
from grpo.rollout.sampler import Sampler
from grpo.rollout.tools import Call, Episode, HermesFormat, Toolbox, answer_turn, parse_calls
from grpo.tasks.tiny import tool_chat_tokenizer
from grpo.train.layouts import policy_logprobs
from tests.helpers import assert_close_scaled, logprob_scale
from tests.rollout.tool_models import (
    INCREMENT_PROMPT,
    MULTIPLY_PROMPT,
    DatasetIncrementEnv,
    MultiplyEnv,
    async_add,
    multiply,
)

# ---- parsing and the chat template ------------------------------------------------------------


def test_calls_are_read_from_tool_call_blocks():
    text = (
        'I will compute.\n<tool_call>\n{"name": "multiply", "arguments": {"a": 3, "b": 4}}\n</tool_call>\n'
        '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call>'
        "<tool_call>{not json}</tool_call><tool_call>[1, 2]</tool_call>"
    )
    calls = parse_calls(text)
    assert [(c.name, c.arguments, c.error is None) for c in calls[:2]] == [
        ("multiply", {"a": 3, "b": 4}, True),
        ("add", {"a": 1}, True),  # arguments as a JSON string, as some models write them
    ]
    assert "not JSON" in calls[2].error and "name" in calls[3].error
    assert parse_calls("no call here <tool_call> unclosed") == []


def test_a_template_without_the_tool_call_format_is_refused_in_one_line():
    tok = tool_chat_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    with pytest.raises(UserError, match="Qwen2.5/Hermes") as err:
        HermesFormat(tok)
    assert "\n" not in str(err.value)
    tok.chat_template = None
    with pytest.raises(UserError, match="no chat template"):
        HermesFormat(tok)


def test_a_template_that_rewrites_earlier_turns_is_refused_in_one_line():
    """Not prefix-preserving: the assistant's turn renders differently once a tool message
    follows it (as Qwen3's stock template drops the reasoning of turns before the last)."""
    tok = tool_chat_tokenizer()
    tok.chat_template = tok.chat_template.replace(
        "{% for call in m.tool_calls or [] %}",
        "{% if loop.last %}(last){% endif %}{% for call in m.tool_calls or [] %}",
    )
    with pytest.raises(UserError, match="not prefix-preserving") as err:
        HermesFormat(tok)
    assert "\n" not in str(err.value)


def test_a_tool_message_is_rendered_alone_after_the_end_of_turn():
    fmt = HermesFormat(tool_chat_tokenizer())
    suffix = fmt.suffix([{"role": "tool", "name": "multiply", "content": "12"}])
    assert suffix == "\n<|im_start|>user\n<tool_response>\n12\n</tool_response><|im_end|>\n<|im_start|>assistant\n"


# ---- one call, contained ----------------------------------------------------------------------


def raises(a: int, b: int) -> int:
    raise ValueError("no multiplying today")


def hangs(a: int, b: int) -> int:
    time.sleep(5)
    return a * b


def exits(a: int, b: int) -> int:
    sys.exit(3)


def returns_a_dict(a: int, b: int) -> dict:
    return {"product": a * b}


def returns_an_object(a: int, b: int) -> object:
    return object()


def as_multiply(body):
    """`body` under multiply's name and docstring: the prompt the tool model learned."""

    def called(a: int, b: int) -> int:
        return body(a, b)

    called.__name__, called.__doc__ = "multiply", multiply.__doc__
    return called


def answer(episode, name, **arguments):
    return json.loads(episode.run(Call(name, arguments))["content"])


def test_a_failing_call_answers_the_model_with_its_error_and_counts():
    episode = Episode({"raises": raises, "hangs": hangs, "exits": exits, "multiply": multiply}, timeout=0.2)
    assert "ValueError: no multiplying today" in answer(episode, "raises", a=1, b=2)["error"]
    start = time.monotonic()
    assert "longer than 0.2 s" in answer(episode, "hangs", a=1, b=2)["error"]
    assert time.monotonic() - start < 2  # abandoned at the limit
    assert "sys.exit(3)" in answer(episode, "exits", a=1, b=2)["error"]
    assert "unknown tool 'divide'" in answer(episode, "divide", a=1, b=2)["error"]
    assert "TypeError" in answer(episode, "multiply", a=1)["error"]  # an argument missing
    bad = Call("", error="the tool call is not JSON")
    assert json.loads(episode.run(bad)["content"]) == {"error": "the tool call is not JSON"}
    assert (episode.calls, episode.failures) == (6, 6)
    assert episode.run(Call("multiply", {"a": 3, "b": 4})) == {"role": "tool", "name": "multiply", "content": "12"}
    assert (episode.calls, episode.failures) == (7, 6)


class InFlight:
    """Async tools that count how many of their calls are under way at once."""

    def __init__(self):
        self.now = self.most = 0

    def tool(self, sleep: float = 0.01, fail: bool = False):
        async def multiply(a: int, b: int) -> int:
            self.now += 1
            self.most = max(self.most, self.now)
            try:
                await asyncio.sleep(sleep)
                if fail:
                    raise ValueError("no multiplying today")
                return a * b
            finally:
                self.now -= 1

        multiply.__doc__ = globals()["multiply"].__doc__
        return multiply


def test_a_turns_async_calls_of_every_rollout_run_together():
    """Three rollouts' async calls in one turn are under way at once (TRL awaits them
    together); a sync call beside them answers in its place; a slow one is cut at its
    rollout's timeout and a failing one answers its error, the others unharmed."""
    flight = InFlight()
    quick = {"multiply": flight.tool()}
    episodes = [Episode(dict(quick), timeout=5.0) for _ in range(3)]
    slow = Episode({"multiply": flight.tool(sleep=30.0)}, timeout=0.3)
    failing = Episode({"multiply": flight.tool(fail=True), "add": lambda a, b: a + b}, timeout=5.0)
    turn = [
        (e, [Call("multiply", {"a": k, "b": 2}), Call("multiply", {"a": k, "b": 3})]) for k, e in enumerate(episodes)
    ]
    turn += [
        (slow, [Call("multiply", {"a": 1, "b": 1})]),
        (failing, [Call("add", {"a": 1, "b": 2}), Call("multiply", {"a": 1, "b": 1})]),
    ]
    start = time.monotonic()
    answers = answer_turn(turn)
    assert time.monotonic() - start < 10  # the slow call abandoned at its 0.3 s
    assert flight.most == 8  # 6 quick, the slow one and the failing one: all at once
    assert [[m["content"] for m in row] for row in answers[:3]] == [["0", "0"], ["2", "3"], ["4", "6"]]
    assert "longer than 0.3 s" in json.loads(answers[3][0]["content"])["error"]
    assert answers[4][0]["content"] == "3" and "ValueError: no multiplying today" in answers[4][1]["content"]
    assert [(e.calls, e.failures) for e in [*episodes, slow, failing]] == [(2, 0)] * 3 + [(1, 1), (2, 1)]


def test_rollouts_run_their_async_calls_together(tool_lm):
    """On the tool model, G = 4 rollouts whose turn calls an async multiply: the calls are
    under way at once, and answer as the sync tool does."""
    tokenizer, model = tool_lm
    flight = InFlight()
    rollout = sampler_for(tokenizer, [flight.tool(), async_add], group_size=4).sample(
        model, [{"prompt": MULTIPLY_PROMPT}]
    )
    assert rollout.tool_calls.tolist() == [1.0] * 4 and flight.most == 4
    assert all(m[1] == {"role": "tool", "name": "multiply", "content": "12"} for m in rollout.messages)


@pytest.mark.slow
def test_a_tool_that_calls_os_exit_answers_with_an_error_and_the_process_lives_on():
    """Not isolated: os._exit on the call's thread raises there, with and without a timeout
    (the call on a thread of its own, or on this one), and os._exit is put back after it; a
    forked child's os._exit still ends the child. In a process of its own, where a guard that
    fails ends that process, not the tests."""
    code = (
        "import json, os\n"
        "from grpo.rollout.tools import Call, Episode\n"
        "from tests.rollout.tools_that_fail import exits, forks\n"
        "real = os._exit\n"
        "call = Call('multiply', {'a': 1, 'b': 2})\n"
        "answers = [Episode({'multiply': tool}, timeout=t).run(call)['content']"
        " for tool in (exits, forks) for t in (None, 5.0)]\n"
        "print(json.dumps({'answers': answers, 'put back': os._exit is real}))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2]), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.splitlines()[-1])
    error = json.dumps({"error": "the tool called os._exit(3)"})
    assert result == {"answers": [error, error, "5", "5"], "put back": True}


def test_an_isolated_tool_runs_in_a_worker_process_and_an_environment_here():
    spec = "tests.rollout.tools_that_fail:where"
    box = Toolbox([spec], DatasetIncrementEnv, timeout=30.0, isolate=True)
    assert box.isolated == {"multiply": spec}  # the environment's increment is not isolated
    (episode,), _ = box.start([{"target": 2}])
    pid = int(episode.run(Call("multiply", {"a": 3, "b": 4}))["content"])
    assert pid != os.getpid() and contain._workers[("tool", spec)].process.pid == pid
    assert episode.run(Call("increment", {"step": 2}))["content"] == "2"
    with pytest.raises(UserError, match=r"^tool '.*as_multiply.<locals>.called': rollout.tool_isolate imports"):
        Toolbox([as_multiply(raises)], isolate=True)


@pytest.mark.parametrize(
    "tool, error",
    [
        ("exits", "the tool ended its worker process (exit code 3)"),
        ("crashes", "the tool ended its worker process (killed by SIGSEGV)"),
        ("hangs", "the tool took longer than 0.5 s"),
    ],
)
def test_an_isolated_tool_that_ends_or_hangs_its_process_answers_with_an_error(tool, error):
    """Each call after such a one gets a fresh worker; a hung one is killed at the limit."""
    spec = f"tests.rollout.tools_that_fail:{tool}"
    (episode,), _ = Toolbox([spec], timeout=0.5, isolate=True).start([{}])
    for _ in range(2):
        start = time.monotonic()
        assert answer(episode, "multiply", a=3, b=4) == {"error": error}
        assert time.monotonic() - start < 30
        assert ("tool", spec) not in contain._workers  # gone: killed, or found dead
    assert (episode.calls, episode.failures) == (2, 2)


def test_an_async_tool_is_awaited():
    assert Episode({"async_add": async_add}).run(Call("async_add", {"a": 2, "b": 5}))["content"] == "7"


def test_a_non_string_result_goes_as_json_or_is_refused_in_one_line():
    episode = Episode({"returns_a_dict": returns_a_dict, "returns_an_object": returns_an_object})
    assert answer(episode, "returns_a_dict", a=3, b=4) == {"product": 12}
    with pytest.raises(UserError, match="tool 'returns_an_object' returned a object, which is neither") as err:
        episode.run(Call("returns_an_object", {"a": 1, "b": 2}))
    assert "\n" not in str(err.value)


# ---- the toolbox ------------------------------------------------------------------------------


def no_docstring(a: int) -> int:
    return a


class NoReset:
    def step(self, x: int) -> int:
        """Step.

        Args:
            x: How far.
        """
        return x


def test_the_toolbox_checks_tools_and_environments_up_front():
    with pytest.raises(UserError, match="tool 'no_docstring': no JSON schema"):
        Toolbox([no_docstring])
    with pytest.raises(UserError, match="has no reset method"):
        Toolbox(environment=NoReset)
    with pytest.raises(UserError, match="cannot import|no module|not found"):
        Toolbox(["tests.rollout.no_such_module:fn"])
    box = Toolbox(["tests.rollout.tool_models:multiply"], DatasetIncrementEnv)
    # The environment's public methods are its tools; reset and get_reward are not.
    assert [s["function"]["name"] for s in box.schemas] == ["multiply", "increment"]
    assert box.owns_reward and [r.name for r in box.rewards()] == [
        "tests.rollout.tool_models:DatasetIncrementEnv.get_reward"
    ]
    episodes, texts = box.start([{"prompt": [], "target": 2}, {"prompt": [], "target": 5}])
    assert texts == [None, None] and [e.environment.target for e in episodes] == [2, 5]
    assert episodes[0].environment is not episodes[1].environment  # one instance per rollout


SEVERAL = {"counter": DatasetIncrementEnv, "product": MultiplyEnv}
COUNTER_ROW = {"prompt": INCREMENT_PROMPT, "target": 2, "environment": "counter"}
PRODUCT_ROW = {"prompt": MULTIPLY_PROMPT, "environment": "product"}


def tool_names(schemas):
    return [s["function"]["name"] for s in schemas]


def test_several_environments_each_row_its_own():
    """TRL's environment_factory as a mapping: a row's `environment` field picks its class; its
    prompt shows that class's tools (and the standalone ones) only; reset gets the row but
    that field; each get_reward scores its own rows, None the others'."""
    box = Toolbox([async_add], SEVERAL)
    assert box.environment is None and box.owns_reward
    assert tool_names(box.schemas_of(COUNTER_ROW)) == ["async_add", "increment"]
    assert tool_names(box.schemas_of(PRODUCT_ROW)) == ["async_add", "multiply"]
    episodes, texts = box.start([COUNTER_ROW, PRODUCT_ROW, PRODUCT_ROW])
    assert texts == [None] * 3
    assert [type(e.environment) for e in episodes] == [DatasetIncrementEnv, MultiplyEnv, MultiplyEnv]
    assert episodes[0].environment.target == 2 and episodes[1].environment.columns == ["prompt"]
    assert sorted(episodes[1].functions) == ["async_add", "multiply"]
    episodes[1].environment.calls = 1
    environments = [e.environment for e in episodes]
    scored = {
        r.name: r.fn(environments=environments, environment=["counter", "product", "product"]) for r in box.rewards()
    }
    assert scored == {
        "counter:tests.rollout.tool_models:DatasetIncrementEnv.get_reward": [0.0, None, None],
        "product:tests.rollout.tool_models:MultiplyEnv.get_reward": [None, 1.0, 0.0],
    }


@pytest.mark.parametrize(
    "rows, message",
    [
        ([COUNTER_ROW, {"prompt": MULTIPLY_PROMPT}], r"row 1 has no 'environment' field; with several environments"),
        ([{**COUNTER_ROW, "environment": "count"}], r"row 0 names 'count'; .* names one of 'counter', 'product'$"),
    ],
)
def test_a_row_without_one_of_several_environments_is_one_line(rows, message):
    with pytest.raises(UserError, match=rf"^rollout.environment: {message}"):
        Toolbox([], SEVERAL).check_prompts(rows, "prompt")


def test_an_empty_mapping_of_environments_is_one_line():
    with pytest.raises(UserError, match=r"^rollout.environment: an empty mapping"):
        Toolbox([multiply], {})


def test_the_config_records_several_environments_by_spec(make_config):
    c = config_from_dict(make_config(rollout={"environment": {"counter": DatasetIncrementEnv, "product": "a.b:C"}}))
    assert c.rollout.environment == {"counter": DatasetIncrementEnv, "product": "a.b:C"}
    written = config_to_dict(c)["rollout"]["environment"]
    assert written == {"counter": "tests.rollout.tool_models:DatasetIncrementEnv", "product": "a.b:C"}


def test_the_config_takes_tools_and_an_environment_and_records_their_specs(make_config):
    c = config_from_dict(
        make_config(rollout={"tools": [multiply], "environment": DatasetIncrementEnv, "max_tool_calls": 2})
    )
    assert c.rollout.tools == [multiply] and c.rollout.environment is DatasetIncrementEnv
    written = config_to_dict(c)["rollout"]
    assert written["tools"] == ["tests.rollout.tool_models:multiply"]
    assert written["environment"] == "tests.rollout.tool_models:DatasetIncrementEnv"
    for bad, message in (
        ({"max_tool_calls": -1}, "rollout.max_tool_calls: must be >= 0"),
        ({"tool_timeout": 0}, "rollout.tool_timeout: must be > 0"),
    ):
        with pytest.raises(UserError, match=message):
            config_from_dict(make_config(rollout=bad))
    with pytest.raises(UserError, match="process supervision of multi-turn"):
        config_from_dict(make_config(rollout={"tools": [multiply]}, loss={"supervision": "process"}))


# ---- rollouts on a model that calls the tools -------------------------------------------------


@pytest.fixture(scope="module")
def tool_lm(tool_model):
    return AutoTokenizer.from_pretrained(tool_model), AutoModelForCausalLM.from_pretrained(tool_model).eval()


def sampler_for(tokenizer, tools, backend="fast", group_size=2, max_new_tokens=250, environment=None, **toolbox):
    """A sampler with these tools; at temperature 0.3 the tiny model's calls are near certain."""
    box = Toolbox(tools, environment, timeout=toolbox.pop("timeout", 5.0), **toolbox)
    return Sampler(
        tokenizer,
        prompt_column="prompt",
        group_size=group_size,
        max_new_tokens=max_new_tokens,
        temperature=0.3,
        backend=backend,
        draw="generate",
        seed=0,
        tools=box,
    )


def spy_on(sampler, model):
    """Record what the decoder is given and returns: (context, sampled tokens up to and
    including EOS) per row of every call. Every turn is a whole-context call: the fast loop's
    kept cache is off for this decoder (its `extend` gets no context to record; a test below
    checks that it samples what these calls sample)."""
    decoder = sampler.decoder(model, 1)
    decoder.extends = False
    real, records = decoder.decode, []
    eos = sampler.tokenizer.eos_token_id

    def decode(ids, mask, counts, generators, params=None):
        out, logprobs = real(ids, mask, counts, generators, params=params)
        contexts = [row[m.bool()].tolist() for row, m, c in zip(ids, mask, counts.tolist()) for _ in range(c)]
        for context, row in zip(contexts, out.tolist()):
            end = row.index(eos) + 1 if eos in row else len(row)
            records.append((context, row[:end]))
        return out, logprobs

    decoder.decode = decode
    return records


def tool_turns(messages):
    """The tool messages of each turn that had them, in order."""
    turns, current = [], []
    for m in messages:
        if m["role"] == "tool":
            current.append(m)
        elif current:
            turns.append(current)
            current = []
    return turns + ([current] if current else [])


def sampled_and_appended(rollout, records, sampler, i):
    """Row i's completion split into its sampled turns and its tool messages, each checked
    against what the decoder returned and what the template renders for the turn's tool
    messages (tokenized alone). Returns the mask of sampled tokens (1) and tool tokens (0)."""
    tok, t_len = sampler.tokenizer, rollout.completion_mask.shape[1]
    p_len = rollout.input_ids.shape[1] - t_len
    prompt = rollout.input_ids[i, :p_len][rollout.attention_mask[i, :p_len].bool()].tolist()
    completion = rollout.completion_ids[i][rollout.completion_mask[i].bool()].tolist()
    answers = iter(tool_turns(rollout.messages[i]))
    pos, mask = 0, []
    while pos < len(completion):
        left = len(completion) - pos
        drawn = [s for c, s in records if c == prompt + completion[:pos] and completion[pos : pos + len(s)] == s[:left]]
        assert drawn, f"row {i}: tokens at {pos} were never sampled there"
        sampled = drawn[0][:left]
        mask += [1.0] * len(sampled)
        pos += len(sampled)
        if pos == len(completion):
            break
        suffix = tok(sampler.format.suffix(next(answers)), add_special_tokens=False)["input_ids"]
        assert completion[pos : pos + len(suffix)] == suffix, f"row {i}: the tool message's tokens at {pos}"
        mask += [0.0] * len(suffix)
        pos += len(suffix)
    assert next(answers, None) is None  # every answered turn is in the tokens
    return torch.tensor(mask)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["fast", "hf"])
def test_completion_tokens_are_the_sampled_ones_and_the_tool_messages(tool_lm, backend):
    tok, model = tool_lm
    sampler = sampler_for(tok, [multiply, async_add], backend)
    records = spy_on(sampler, model)
    rollout = sampler.sample(model, [{"prompt": MULTIPLY_PROMPT}, {"prompt": MULTIPLY_PROMPT}])
    assert rollout.tool_calls.tolist() == [1.0] * 4  # the model called multiply in every rollout
    for i in range(len(rollout)):
        mask = sampled_and_appended(rollout, records, sampler, i)
        assert torch.equal(rollout.loss_mask[i, : len(mask)], mask)
        assert rollout.loss_mask[i, len(mask) :].sum() == 0
        assert rollout.messages[i][1] == {"role": "tool", "name": "multiply", "content": "12"}
    assert rollout.messages[0][-1] == {"role": "assistant", "content": "12"}
    assert 0 < rollout.loss_mask.sum() < rollout.completion_mask.sum()
    if backend == "fast":  # the sampler's log-probs: the model's tokens', as the trainer scores them; 0 on the tools'
        assert (rollout.sampled_logprobs[rollout.completion_mask.bool() & (rollout.loss_mask == 0)] == 0).all()
        scored = policy_logprobs(model, rollout, 0.3)
        actions = rollout.loss_mask.bool()
        assert_close_scaled(rollout.sampled_logprobs[actions], scored[actions], scale=logprob_scale(scored))
    else:
        assert rollout.sampled_logprobs is None


@pytest.mark.parametrize("batch_size, seeds", [(0, None), (4, None), (3, [11, 12])])
def test_the_fast_loop_s_kept_cache_samples_what_recomputing_each_turn_samples(tool_lm, monkeypatch, batch_size, seeds):
    """With its cache kept across turns (turns.KEEP_CACHE), a later turn runs only its new
    tokens: the same tokens drawn as when every turn computes its whole context again (the
    path of the other decoders), the log-probs within float rounding; in calls of all rows,
    of a few (rows of several calls joined in the next turn), and with a seed per prompt."""
    tok, model = tool_lm
    rows = [{"prompt": MULTIPLY_PROMPT}, {"prompt": [{"role": "user", "content": "What is 6 times 7?"}]}]
    extended = []

    def sample(keep: bool):
        monkeypatch.setattr(turns, "KEEP_CACHE", keep)
        sampler = sampler_for(tok, [multiply, async_add], group_size=3, max_new_tokens=200)
        sampler.batch_size, sampler.params = batch_size, dataclasses.replace(sampler.params, temperature=1.5)
        decoder = sampler.decoder(model, 1)
        real = decoder.extend
        decoder.extend = lambda *args, **kwargs: extended.append(len(args[1])) or real(*args, **kwargs)
        return sampler.sample(model, rows, seeds=seeds)

    kept = sample(True)
    assert extended and sum(extended) >= 2  # later turns ran on the kept cache
    count = len(extended)
    recomputed = sample(False)
    assert len(extended) == count  # and not with it off
    assert len({tuple(r) for r in kept.loss_mask.tolist()}) > 1  # the rows differ: a real test
    assert torch.equal(kept.completion_ids, recomputed.completion_ids)
    assert torch.equal(kept.loss_mask, recomputed.loss_mask) and kept.messages == recomputed.messages
    assert_close_scaled(
        kept.sampled_logprobs, recomputed.sampled_logprobs, scale=logprob_scale(recomputed.sampled_logprobs)
    )
    actions = kept.loss_mask.bool()  # and they are the trainer's, as the recomputing path's are
    scored = policy_logprobs(model, kept, 1.5)
    assert_close_scaled(kept.sampled_logprobs[actions], scored[actions], scale=logprob_scale(scored))


def test_fast_and_generate_sample_the_same_multi_turn_rollouts(tool_lm):
    tok, model = tool_lm
    rows = [{"prompt": MULTIPLY_PROMPT}]
    fast, hf = (sampler_for(tok, [multiply, async_add], b).sample(model, rows) for b in ("fast", "hf"))
    assert torch.equal(fast.input_ids, hf.input_ids) and torch.equal(fast.loss_mask, hf.loss_mask)


@pytest.mark.parametrize(
    "tool, error",
    [(raises, "ValueError: no multiplying today"), (hangs, "longer than 0.5 s"), (exits, "sys.exit(3)")],
)
def test_a_failing_tool_in_a_rollout_answers_with_its_error_and_the_rollout_goes_on(tool_lm, tool, error):
    tok, model = tool_lm
    tools = [as_multiply(tool), async_add]
    rollout = sampler_for(tok, tools, timeout=0.5).sample(model, [{"prompt": MULTIPLY_PROMPT}])
    for messages in rollout.messages:
        assert messages[1]["role"] == "tool" and error in json.loads(messages[1]["content"])["error"]
        assert messages[2]["role"] == "assistant"  # the model's turn after the error
    assert rollout.tool_failures.tolist() == rollout.tool_calls.tolist() == [1.0, 1.0]


def test_max_tool_calls_zero_ends_the_rollout_at_the_first_call(tool_lm):
    tok, model = tool_lm
    rollout = sampler_for(tok, [multiply, async_add], max_calls=0).sample(model, [{"prompt": MULTIPLY_PROMPT}])
    assert rollout.tool_calls.tolist() == [0.0, 0.0]
    assert [len(m) for m in rollout.messages] == [1, 1] and "tool_calls" in rollout.messages[0][0]
    assert torch.equal(rollout.loss_mask, rollout.completion_mask)  # nothing but the model's turn


# ---- the loop's bounds, on a scripted decoder -------------------------------------------------


class Scripted(Decoder):
    """A decoder that writes the same turn every time (up to the turn's token budget)."""

    decodes_lora, in_auto = True, True

    def __init__(self, ids):
        self.ids = ids

    def prepare(self, policy, version):
        pass

    def release(self):
        pass

    def exact_logprobs(self):
        return False

    def decode(self, prompt_ids, prompt_mask, counts, generators, params=None):
        out = self.ids[: params.max_new_tokens]
        return torch.tensor([out] * int(counts.sum())), None


CALL = '<tool_call>\n{"name": "multiply", "arguments": {"a": 3, "b": 4}}\n</tool_call>'


def scripted_rollout(tool_lm, text, max_new_tokens, **toolbox):
    tok, model = tool_lm
    sampler = sampler_for(tok, [multiply], group_size=1, max_new_tokens=max_new_tokens, **toolbox)
    sampler.decoders["fast"] = Scripted(tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id])
    return sampler.sample(model, [{"prompt": MULTIPLY_PROMPT}]), sampler


@pytest.mark.parametrize("limit", [1, 2])
def test_max_tool_calls_bounds_the_turns_that_call(tool_lm, limit):
    rollout, _ = scripted_rollout(tool_lm, CALL, 1000, max_calls=limit)
    roles = [m["role"] for m in rollout.messages[0]]
    assert roles == ["assistant", "tool"] * limit + ["assistant"]  # the last call is not run
    assert rollout.tool_calls.tolist() == [float(limit)]


def test_the_token_budget_bounds_the_whole_completion(tool_lm):
    tok = tool_lm[0]
    turn = len(tok(CALL, add_special_tokens=False)["input_ids"]) + 1  # with its EOS
    answer = {"role": "tool", "name": "multiply", "content": "12"}
    _, sampler = scripted_rollout(tool_lm, CALL, 1000, max_calls=0)
    suffix = len(tok(sampler.format.suffix([answer]), add_special_tokens=False)["input_ids"])
    # Room for two turns and one tool message: the second turn's tool message would leave no
    # room for a model token, so it is dropped (its call ran) and the rollout ends there.
    rollout, _ = scripted_rollout(tool_lm, CALL, 2 * turn + suffix + 5)
    assert [m["role"] for m in rollout.messages[0]] == ["assistant", "tool", "assistant"]
    assert int(rollout.completion_mask.sum()) == 2 * turn + suffix and rollout.tool_calls.tolist() == [2.0]
    # Room for 3 tokens of the second turn: it is cut there, without its EOS.
    rollout, _ = scripted_rollout(tool_lm, CALL, turn + suffix + 3)
    assert int(rollout.completion_mask.sum()) == turn + suffix + 3
    assert rollout.completion_ids[0, -1] != tok.eos_token_id and rollout.tool_calls.tolist() == [1.0]
    assert int(rollout.loss_mask.sum()) == turn + 3


def test_a_sampled_text_the_template_would_tokenize_otherwise_warns_once(tool_lm, capsys):
    tok = tool_lm[0]
    # "<tool_call>" spelt character by character: the text is a call, but the template's
    # rendering tokenizes the tag as one token.
    spelt = "".join(f"{c}" for c in "<tool_call>")
    ids = [tok.convert_tokens_to_ids(c) for c in spelt]
    rest = tok(CALL.removeprefix("<tool_call>"), add_special_tokens=False)["input_ids"]
    tokenizer, model = tool_lm
    sampler = sampler_for(tokenizer, [multiply], group_size=1, max_new_tokens=400, max_calls=1)
    sampler.decoders["fast"] = Scripted(ids + rest + [tok.eos_token_id])
    rollout = sampler.sample(model, [{"prompt": MULTIPLY_PROMPT}])
    assert rollout.tool_calls.tolist() == [1.0]
    assert rollout.completion_ids[0, : len(ids)].tolist() == ids  # kept as sampled
    err = capsys.readouterr().err
    assert err.count("grpo: warning: rollout.tools: the chat template renders") == 1
    sampler.sample(model, [{"prompt": MULTIPLY_PROMPT}])
    assert "warning" not in capsys.readouterr().err  # once per sampler


def test_the_model_s_own_rendering_matches_and_does_not_warn(tool_lm, capsys):
    tok, model = tool_lm
    sampler_for(tok, [multiply, async_add]).sample(model, [{"prompt": MULTIPLY_PROMPT}])
    assert "warning" not in capsys.readouterr().err


# ---- environments -----------------------------------------------------------------------------


class Announcing(DatasetIncrementEnv):
    """reset reads the row's columns and adds the task to the prompt."""

    def reset(self, target, **kwargs) -> str:
        super().reset(target)
        self.row = kwargs
        return f" Reach {target}."


def test_an_environment_s_reset_adds_text_to_the_prompt_and_gets_the_row(tool_lm):
    tok, model = tool_lm
    rows = [{"prompt": [{"role": "user", "content": "Count."}], "target": 4, "tag": "x"}]
    sampler = sampler_for(tok, [], environment=Announcing, group_size=2, max_new_tokens=30)
    rollout = sampler.sample(model, rows)
    assert all("Count. Reach 4.<|im_end|>" in p for p in rollout.prompts)
    assert [e.target for e in rollout.environments] == [4, 4]
    assert rollout.environments[0] is not rollout.environments[1]
    assert rollout.environments[0].row == {"prompt": rows[0]["prompt"], "tag": "x"}
    assert rows[0]["prompt"] == [{"role": "user", "content": "Count."}]  # the data row is unchanged
    # The rollout's rows hold the prompt as the model saw it (what rewards get as `prompts`, as in TRL).
    assert rollout.rows[0] == {"prompt": [{"role": "user", "content": "Count. Reach 4."}], "target": 4, "tag": "x"}
    assert '"name": "increment"' in rollout.prompts[0]  # its method is a tool in the prompt


def test_plain_text_prompts_are_refused_in_one_line(tool_lm):
    tok, model = tool_lm
    with pytest.raises(UserError, match="must be chat messages"):
        sampler_for(tok, [multiply]).sample(model, [{"prompt": "What is 3 times 4?"}])


@pytest.mark.parametrize("batch_size", [0, 3])
def test_with_a_seed_per_prompt_a_prompt_s_rollouts_do_not_depend_on_the_others(tool_lm, batch_size):
    """Each prompt's turns draw from a stream of its own seed and turn (grpo.infra.seed.turn_seed),
    in calls that hold whole prompts: sampled beside another prompt or alone, the same rollouts."""
    tok, model = tool_lm
    rows = [{"prompt": MULTIPLY_PROMPT}, {"prompt": [{"role": "user", "content": "What is 6 times 7?"}]}]
    sampler = sampler_for(tok, [multiply, async_add], group_size=3)
    sampler.batch_size, sampler.params = batch_size, dataclasses.replace(sampler.params, temperature=1.5)
    both = sampler.sample(model, rows, seeds=[11, 12])
    alone = sampler.sample(model, rows[1:], seeds=[12])
    assert len({tuple(r) for r in both.loss_mask.tolist()}) > 1  # the rows differ: a real test
    width = alone.completion_mask.shape[1]
    assert torch.equal(both.completion_ids[3:, :width], alone.completion_ids)
    assert both.completion_mask[3:, width:].sum() == 0
    assert both.messages[3:] == alone.messages


def test_rollouts_of_several_environments_show_and_run_each_row_its_own(tool_lm):
    """On the tool model: each row's rendered prompt holds its own environment's tool only,
    and its calls run on its own instance."""
    tokenizer, model = tool_lm
    rollout = sampler_for(tokenizer, [], environment=SEVERAL).sample(model, [COUNTER_ROW, PRODUCT_ROW])
    for i, (own, other) in enumerate([("increment", "multiply")] * 2 + [("multiply", "increment")] * 2):
        assert f'"name": "{own}"' in rollout.prompts[i] and f'"name": "{other}"' not in rollout.prompts[i], i
    assert [type(e) for e in rollout.environments] == [DatasetIncrementEnv] * 2 + [MultiplyEnv] * 2
    assert [r["environment"] for r in rollout.rows] == ["counter"] * 2 + ["product"] * 2
    # The counter rows' increment(step=2) ran on their own instances. (The product rows' calls
    # are not asked for: the tiny model learned its multiply call beside async_add's schema.)
    assert [e.counter for e in rollout.environments[:2]] == [2, 2]
