"""Tool-call formats (grpo.rollout.tool_formats): Hermes, Qwen3 and Llama 3.1/3.2, on character
tokenizers that carry the stock templates' text (tests/rollout/chat_template_fixtures.py).

- auto reads the format off the chat template; a template of none is one line naming them.
- grpo's Qwen3 template renders every prompt as Qwen3's stock one does, and stays
  prefix-preserving where the stock one is not.
- Each format's round trip, through the multi-turn rollout's own steps: a model turn written
  in the format is parsed into its call (arguments and all), the tool's answer is appended
  as the template writes it, out of the loss, and the whole conversation rendered by the
  template is the prompt and the completion's tokens, one for one.
- A tiny model taught each new format calls its tool in rollouts and trains.
"""

import json

import pytest
import torch

import grpo
from grpo.config import config_from_dict
from grpo.errors import UserError
from grpo.rollout import turns
from grpo.rollout.chat_templates import QWEN3_TEMPLATE
from grpo.rollout.sampler import Sampler
from grpo.rollout.tool_formats import (
    Call,
    HermesFormat,
    Llama3Format,
    Qwen3Format,
    detect,
    parse_llama3,
    tool_format_for,
)
from grpo.rollout.tools import Toolbox, answer_turn
from grpo.tasks.tiny import tool_chat_tokenizer
from tests.rollout.chat_template_fixtures import llama3_tokenizer, qwen3_tokenizer
from tests.rollout.test_tools import sampled_and_appended, sampler_for, spy_on
from tests.rollout.tool_models import CONVERSATIONS, MULTIPLY_PROMPT, multiply

OFF = {"enable_thinking": False}
CALL = '{"name": "multiply", "arguments": {"a": 3, "b": 4}}'
LLAMA_CALL = '{"name": "multiply", "parameters": {"a": 3, "b": 4}}'
TOKENIZERS = {"hermes": tool_chat_tokenizer, "qwen3": qwen3_tokenizer, "llama3": llama3_tokenizer}

# ---- choosing a format ------------------------------------------------------------------------


def test_auto_reads_the_format_off_the_chat_template():
    assert [detect(make()) for make in TOKENIZERS.values()] == list(TOKENIZERS)
    assert type(tool_format_for(qwen3_tokenizer(), "auto", OFF)) is Qwen3Format
    assert type(tool_format_for(llama3_tokenizer())) is Llama3Format
    # Qwen3's template made prefix-preserving by hand (as TRL's training template is) speaks Hermes as it is.
    assert detect(qwen3_tokenizer(QWEN3_TEMPLATE)) == "hermes"


def test_a_template_of_no_format_is_one_line_naming_them():
    tok = tool_chat_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    for name in ("auto", "llama3"):
        with pytest.raises(UserError, match="hermes .*qwen3 .*llama3") as err:
            tool_format_for(tok, name)
        assert "\n" not in str(err.value)
    with pytest.raises(UserError, match="not prefix-preserving"):
        HermesFormat(qwen3_tokenizer())  # Qwen3's stock template, as Hermes: refused, as before


def test_the_config_names_a_format_or_auto(make_config):
    assert config_from_dict(make_config()).rollout.tool_format == "auto"
    assert config_from_dict(make_config(rollout={"tool_format": "llama3"})).rollout.tool_format == "llama3"
    with pytest.raises(UserError, match="rollout.tool_format") as err:
        config_from_dict(make_config(rollout={"tool_format": "mistral"}))
    assert "\n" not in str(err.value)


# ---- the Qwen3 template -----------------------------------------------------------------------

TOOLS = [
    {
        "type": "function",
        "function": {"name": "multiply", "description": "M.", "parameters": {"type": "object", "properties": {}}},
    }
]
ASKED = [{"role": "user", "content": "What is 3 times 4?"}]
CALLED = {"role": "assistant", "content": "", "tool_calls": [Call("multiply", {"a": 3, "b": 4}).as_message()]}
HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "<think>\nA greeting.\n</think>\n\nhello"},
    CALLED,
    {"role": "tool", "name": "multiply", "content": "12"},
    {"role": "tool", "name": "multiply", "content": "12"},
    {"role": "assistant", "content": "12", "reasoning_content": "Done."},
    *ASKED,
]


@pytest.mark.parametrize("kwargs", [{}, OFF])
@pytest.mark.parametrize("tools", [None, TOOLS])
@pytest.mark.parametrize("messages", [ASKED, [{"role": "system", "content": "Be brief."}, *ASKED], HISTORY])
def test_grpo_s_qwen3_template_renders_prompts_as_the_stock_one(kwargs, tools, messages):
    tok = qwen3_tokenizer()
    stock = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False, **kwargs)
    assert Qwen3Format(tok, kwargs).render(messages, tools, generation=True) == stock


@pytest.mark.parametrize("reasoning", ["", "I will multiply."])
def test_grpo_s_qwen3_template_keeps_a_turn_as_it_was_once_its_answer_follows(reasoning):
    fmt, tok = Qwen3Format(qwen3_tokenizer()), qwen3_tokenizer()
    called = {**CALLED, "reasoning_content": reasoning}
    answered = [*ASKED, called, {"role": "tool", "name": "multiply", "content": "12"}]
    ours = [fmt.render(m, TOOLS, generation=False) for m in ([*ASKED, called], answered)]
    assert ours[1].startswith(ours[0])
    if not reasoning:  # the stock template drops the empty think block once the tool message follows
        stock_before = tok.apply_chat_template([*ASKED, called], tokenize=False)
        assert not tok.apply_chat_template(answered, tokenize=False).startswith(stock_before)


# ---- parsing ----------------------------------------------------------------------------------


def test_llama3_calls_are_the_turn_s_json_bare_or_after_the_python_tag():
    three_four = [("multiply", {"a": 3, "b": 4})]
    for text in (LLAMA_CALL, f"<|python_tag|>{LLAMA_CALL}<|eom_id|>", f" {LLAMA_CALL}<|eot_id|>"):
        assert [(c.name, c.arguments, c.error) for c in parse_llama3(text)] == [(*three_four[0], None)]
    several = parse_llama3(f'{LLAMA_CALL}; {{"name": "add", "parameters": "{{\\"a\\": 1}}"}}')
    assert [(c.name, c.arguments) for c in several] == [*three_four, ("add", {"a": 1})]
    # A bare turn that is no call is the model's answer; after the tag, a call written badly is an error.
    assert parse_llama3("12") == [] and parse_llama3('{"answer": 12}') == [] and parse_llama3("{12") == []
    bad = parse_llama3("<|python_tag|>{not json}")
    assert len(bad) == 1 and "not JSON" in bad[0].error
    assert "parameters" in parse_llama3('{"name": "multiply", "parameters": [3, 4]}')[0].error
    assert Llama3Format(llama3_tokenizer()).content(LLAMA_CALL) == ""


def test_qwen3_reads_calls_after_the_think_block_only():
    text = f"<think>\nNot <tool_call>{CALL}</tool_call> yet.\n</think>\n\n<tool_call>\n{CALL}\n</tool_call>"
    assert [(c.name, c.arguments) for c in Qwen3Format.parse(text)] == [("multiply", {"a": 3, "b": 4})]
    assert len(HermesFormat.parse(text)) == 2


# ---- the round trip ---------------------------------------------------------------------------

# (format, template kwargs, the model's first turn as it writes it, its last turn)
TURNS = [
    ("hermes", {}, f"<tool_call>\n{CALL}\n</tool_call>", "12"),
    (
        "qwen3",
        {},
        f"<think>\nThree times four.\n</think>\n\n<tool_call>\n{CALL}\n</tool_call>",
        "<think>\n\n</think>\n\n12",
    ),
    ("qwen3", OFF, f"<tool_call>\n{CALL}\n</tool_call>", "12"),
    ("llama3", {}, LLAMA_CALL, "12"),
]


@pytest.mark.parametrize("name, kwargs, first, last", TURNS)
def test_a_turn_is_parsed_answered_and_masked_as_the_template_renders_it(name, kwargs, first, last, capsys):
    tok = TOKENIZERS[name]()
    sampler = Sampler(
        tok,
        prompt_column="prompt",
        group_size=1,
        max_new_tokens=400,
        tools=Toolbox([multiply]),
        tool_format=name,
        chat_template_kwargs=kwargs,
    )
    assert sampler.format.name == name
    schemas = sampler.tools.schemas
    prompt = tok(sampler.format.render(ASKED, schemas, generation=True))["input_ids"]
    (episode,), _ = sampler.tools.start([{"prompt": ASKED}])
    row = turns.Trajectory(prompt, episode, None)

    def sample(text):  # the model writes `text` and ends its turn
        return tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]

    drawn = sample(first)
    calls = turns._take_turn(sampler, row, drawn, None)
    assert [(c.name, c.arguments, c.error) for c in calls] == [("multiply", {"a": 3, "b": 4}, None)]
    (answers,) = answer_turn([(episode, calls)])
    assert answers == [{"role": "tool", "name": "multiply", "content": "12"}]
    assert turns._add_answers(sampler, row, answers)
    appended = len(row.tokens) - len(drawn)
    final = sample(last)
    assert turns._take_turn(sampler, row, final, None) == []

    # Out of the loss: the tool's answer as the template writes it, up to the next turn's start.
    assert row.actions == [1.0] * len(drawn) + [0.0] * appended + [1.0] * len(final)
    tool_text = tok.decode(row.tokens[len(drawn) : len(drawn) + appended])
    assert "12" in tool_text and "multiply" not in tool_text
    # The conversation the template renders is the prompt and the completion, token for token.
    rendered = tok(sampler.format.render(ASKED + row.as_written, schemas, generation=False))["input_ids"]
    assert rendered[: len(row.context)] == row.context
    assert tok.decode(rendered[len(row.context) :]).strip() == ""
    assert row.messages[0]["tool_calls"] == [Call("multiply", {"a": 3, "b": 4}).as_message()]
    assert "multiply" not in row.messages[0]["content"]  # a turn's content is its text without its calls
    assert row.messages[1] == answers[0] and row.messages[2]["content"].endswith("12")
    assert turns.check_rendering(sampler, [ASKED], [row], [False], [schemas])
    assert "warning" not in capsys.readouterr().err


# ---- a tiny model in each new format ----------------------------------------------------------

# The tokenizer the model learns its conversation with, and the template its directory ships:
# Qwen3's learnt through grpo's template, shipped with the stock one (which qwen3 replaces).
TAUGHT = {
    "qwen3": (lambda: qwen3_tokenizer(QWEN3_TEMPLATE), qwen3_tokenizer().chat_template),
    "llama3": (llama3_tokenizer, None),
}


@pytest.fixture(scope="module")
def format_models(tmp_path_factory):
    """name -> a tiny model taught, with `grpo sft`, to call TRL's documentation `multiply` in
    format `name` (the multiply conversation of tests/rollout/tool_models.py, that tool alone
    in the prompt: Llama 3's schemas are long), built when first asked for."""
    built = {}

    def model(name: str) -> str:
        if name not in built:
            built[name] = teach(name, tmp_path_factory.mktemp(f"{name}_model"))
        return built[name]

    return model


def teach(name, directory) -> str:
    from transformers import AutoTokenizer
    from transformers.utils import get_json_schema

    from grpo.tasks.tiny import tiny_llama
    from grpo.train.sft import FineTuneConfig, sft

    make, shipped = TAUGHT[name]
    tokenizer, base = make(), directory / "base"
    tiny_llama(tokenizer, hidden_size=64, layers=2, heads=4, max_positions=1536).save_pretrained(base)
    tokenizer.save_pretrained(base)
    (conversation,) = [c for tools, c in CONVERSATIONS if multiply in tools]
    row = {"messages": conversation, "tools": [get_json_schema(multiply)]}
    (directory / "rows.jsonl").write_text(json.dumps(row) + "\n")
    config = FineTuneConfig(
        model=str(base),
        data=str(directory / "rows.jsonl"),
        steps=150,
        batch_size=1,
        lr=3e-3,
        warmup_steps=0,
        max_grad_norm=0.0,
    )
    sft(directory / "model", config, progress=False, device="cpu")
    if shipped is not None:
        tok = AutoTokenizer.from_pretrained(directory / "model")
        tok.chat_template = shipped
        tok.save_pretrained(directory / "model")
    return str(directory / "model")


def correct(completions, **kwargs):
    return [float(c[-1]["content"].endswith("12")) for c in completions]


@pytest.mark.slow
@pytest.mark.parametrize("name, kwargs", [("qwen3", {}), ("qwen3", OFF), ("llama3", {})])
def test_a_tiny_model_calls_its_tool_and_trains_in_the_format(format_models, tmp_path, name, kwargs):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory = format_models(name)
    tok, model = AutoTokenizer.from_pretrained(directory), AutoModelForCausalLM.from_pretrained(directory).eval()
    sampler = sampler_for(tok, [multiply])
    sampler.template_kwargs = kwargs
    sampler.format = tool_format_for(sampler.tokenizer, "auto", kwargs)
    assert sampler.format.name == name
    records = spy_on(sampler, model)
    rollout = sampler.sample(model, [{"prompt": MULTIPLY_PROMPT}])
    assert rollout.tool_calls.tolist() == [1.0, 1.0] and rollout.tool_failures.sum() == 0
    for i in range(len(rollout)):  # tokens as sampled; the tool's answer as the template writes it, out of the loss
        mask = sampled_and_appended(rollout, records, sampler, i)
        assert torch.equal(rollout.loss_mask[i, : len(mask)], mask)
        assert rollout.messages[i][1] == {"role": "tool", "name": "multiply", "content": "12"}

    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": [{"role": "user", "content": "What is 3 times 4?"}]}\n' * 2)
    config = {
        "model": directory,
        "output_dir": str(tmp_path / "run"),
        "data": {"path": str(rows)},
        "rewards": [{"function": correct}],
        "rollout": {
            "group_size": 2,
            "prompts_per_step": 2,
            "max_new_tokens": 200,
            "temperature": 0.3,
            "tool_format": name,
            "chat_template_kwargs": kwargs,
        },
        "train": {"steps": 1, "lr": 1e-3, "gradient_checkpointing": False},
    }
    (metrics,) = grpo.train(config, tools=[multiply], progress=False).metrics
    assert metrics["tools/calls_per_rollout"] > 0 and metrics["reward/mean"] > 0
    assert 0 < metrics["tools/mask_fraction"] < 1 and metrics["tools/failures"] == 0
