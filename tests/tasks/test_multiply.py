"""The multi-turn task: its rows, its verifier (the model's last turn, never a tool's), how a
sample used the tool, its SFT conversations, and a chat template the tool loop speaks."""

import pytest

from grpo.errors import UserError
from grpo.rollout.tools import HermesFormat, Toolbox, parse_calls
from grpo.tasks import load_task
from grpo.tasks.multiply import (
    chat_tokenizer,
    conversations,
    correctness_reward,
    extract_answer,
    make_rows,
    multiply,
    parse_prompt,
    task,
    tool_use,
)
from grpo.train.sft import IGNORE_INDEX, conversation_pieces, encode_pieces

PROMPT = [{"role": "user", "content": "37*58"}]


def called(a, b, name="multiply"):
    return {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": name, "arguments": {"a": a, "b": b}}}],
    }


def tool(content):
    return {"role": "tool", "name": "multiply", "content": content}


def answer(text):
    return {"role": "assistant", "content": text}


def test_rows_are_products_of_two_digit_numbers_and_the_same_for_a_seed():
    rows = make_rows(50, seed=3)
    assert rows == make_rows(50, seed=3) and rows != make_rows(50, seed=4)
    for row in rows:
        a, b = parse_prompt(row["prompt"])
        assert 10 <= a <= 99 and 10 <= b <= 99 and row["answer"] == str(a * b)
        assert row["prompt"] == [{"role": "user", "content": f"{a}*{b}"}]
    assert all(len(str(parse_prompt(r["prompt"])[0])) == 3 for r in make_rows(5, seed=0, digits=3))
    with pytest.raises(UserError, match="digits must be between 1 and 6"):
        make_rows(1, seed=0, digits=0)


def test_the_verifier_reads_the_models_last_turn_and_never_a_tools():
    with_tool = [called(37, 58), tool("2146"), answer("2146")]
    copied_wrong = [called(37, 58), tool("2146"), answer("2416")]
    ended_on_the_tool = [called(37, 58), tool("2146")]  # the tool's answer is not the model's
    scores = correctness_reward(
        [PROMPT] * 6,
        [with_tool, copied_wrong, ended_on_the_tool, [answer("2146")], [answer("2146 and more")], "2146"],
        answer=["2146"] * 6,
    )
    assert scores == [1.0, 0.0, 0.0, 1.0, 0.0, 1.0]
    # Without an answer column the product is read from the prompt; an unreadable prompt cannot be scored.
    assert correctness_reward([PROMPT, [{"role": "user", "content": "hi"}]], [[answer("2146")]] * 2) == [1.0, None]
    assert extract_answer([answer(" 2146 ")]) == "2146" and extract_answer(ended_on_the_tool) is None


def test_tool_use_tells_right_calls_from_wrong_ones_and_none():
    assert tool_use(PROMPT, [answer("2146")]) == "none"
    assert tool_use(PROMPT, [called(37, 58), tool("2146"), answer("2146")]) == "right"
    assert tool_use(PROMPT, [called(58, 37), tool("2146"), answer("2146")]) == "right"  # a product commutes
    assert tool_use(PROMPT, [called(37, 85), tool("3145"), answer("3145")]) == "wrong"
    assert tool_use(PROMPT, [called(37, 58, name="add"), tool("{}"), answer("95")]) == "wrong"
    assert tool_use(PROMPT, [called("37", 58), tool("2146"), answer("2146")]) == "wrong"
    assert tool_use(PROMPT, "2146") == "none"


def test_the_sft_conversations_call_the_tool_in_the_share_asked_and_only_where_it_is_shown():
    rows = conversations(2000, seed=0, tool_share=0.5, shown_share=0.75)
    calls = [row for row in rows if any(m.get("tool_calls") for m in row["messages"])]
    assert all(row["tools"] is not None for row in calls)
    assert 0.75 * 0.5 - 0.04 < len(calls) / len(rows) < 0.75 * 0.5 + 0.04
    assert 0.75 - 0.04 < sum(row["tools"] is not None for row in rows) / len(rows) < 0.75 + 0.04
    for row in rows:
        prompt, *turns = row["messages"]
        product = str(multiply(*parse_prompt([prompt])))
        assert turns[-1] == answer(product)  # every conversation ends with the right product
        if len(turns) == 3:
            assert tool_use([prompt], turns) == "right" and turns[1] == tool(product)
    assert conversations(1, seed=0, tool_share=0.0)[0]["messages"][1]["role"] == "assistant"
    with pytest.raises(UserError, match="tool_share and shown_share must be in"):
        conversations(1, seed=0, tool_share=1.5)


def test_the_chat_template_speaks_the_tool_loops_format_and_sft_learns_the_call():
    tok = chat_tokenizer()
    HermesFormat(tok)  # the rollout's checks: tools shown, a <tool_call> block, prefix-preserving
    row = next(r for r in conversations(50, seed=1) if len(r["messages"]) == 4)
    pieces, every_turn = conversation_pieces(tok, row["messages"], row["tools"])
    assert every_turn and [learned for _, learned in pieces] == [False, True, False, True]
    (prompt, _), (call, _), (response, _), (final, _) = pieces
    assert "tools: multiply" in prompt and [c.name for c in parse_calls(call)] == ["multiply"]
    assert response == HermesFormat(tok).suffix([row["messages"][2]])  # as the sampler appends it
    ids, labels = encode_pieces(tok, pieces)
    assert tok.decode([i for i, label in zip(ids, labels) if label != IGNORE_INDEX]) == (
        call + tok.eos_token + final + tok.eos_token
    )
    # The tool as the sampler offers it has the schema the conversations show.
    assert Toolbox(["grpo.tasks.multiply:multiply"]).schemas == [row["tools"][0]]


def test_the_task_is_registered_as_a_users_would_be():
    assert load_task("multiply") is task is load_task("grpo.tasks.multiply:task")
    assert task.make_rows(3, seed=0) == make_rows(3, seed=0)
