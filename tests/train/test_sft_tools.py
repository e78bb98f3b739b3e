"""`grpo sft` on conversations that call tools: what is learned is what a sampler with tools
samples (each assistant turn as the template renders it, its <tool_call> blocks included),
and the tool messages are context tokenized as the sampler appends them (alone, after the
EOS). tests/rollout/tool_models.py's model is trained this way, and the rollout tests then
sample its calls."""

import pytest
from transformers.utils import get_json_schema

from grpo.errors import UserError
from grpo.rollout.tools import HermesFormat
from grpo.tasks.tiny import tool_chat_tokenizer
from grpo.train.sft import IGNORE_INDEX, FineTuneConfig, conversation_pieces, encode_pieces
from grpo.train.sft_data import row_pieces
from tests.rollout.tool_models import CONVERSATIONS, async_add, multiply

TOOLS, MESSAGES = CONVERSATIONS[0]
SCHEMAS = [get_json_schema(t) for t in TOOLS]
CALL = '<tool_call>\n{"name": "multiply", "arguments": {"a": 3, "b": 4}}\n</tool_call>'


def test_a_tool_call_turn_is_learned_as_rendered_and_the_tool_message_is_context():
    tok = tool_chat_tokenizer()
    pieces, every_turn = conversation_pieces(tok, MESSAGES, SCHEMAS)
    assert every_turn and [learned for _, learned in pieces] == [False, True, False, True]
    (prompt, _), (call, _), (answer, _), (final, _) = pieces
    assert prompt == tok.apply_chat_template(MESSAGES[:1], tools=SCHEMAS, add_generation_prompt=True, tokenize=False)
    assert call == CALL and final == "12"
    # The tool message's text is what a sampler with tools appends after the model's EOS.
    assert answer == HermesFormat(tok).suffix([MESSAGES[2]])
    # The pieces, with an EOS after each learned one, are the whole conversation as rendered.
    joined = "".join(text + (tok.eos_token if learned else "") for text, learned in pieces)
    assert tok.apply_chat_template(MESSAGES, tools=SCHEMAS, tokenize=False).startswith(joined)
    ids, labels = encode_pieces(tok, pieces)
    learned = tok.decode([i for i, label in zip(ids, labels) if label != IGNORE_INDEX])
    assert learned == CALL + tok.eos_token + "12" + tok.eos_token  # neither the prompt nor the tool's answer


def test_the_tools_column_takes_schemas_or_specs():
    tok = tool_chat_tokenizer()
    c = FineTuneConfig(model="m", data="d")
    by_spec = {"messages": MESSAGES, "tools": ["tests.rollout.tool_models:multiply", SCHEMAS[1]]}
    by_schema = {"messages": MESSAGES, "tools": SCHEMAS}
    assert row_pieces(by_spec, "messages", c, tok, "row 1") == row_pieces(by_schema, "messages", c, tok, "row 1")
    assert [multiply, async_add] == TOOLS
    with pytest.raises(UserError, match="row 1: 'tools' must be a list"):
        row_pieces({"messages": MESSAGES, "tools": "multiply"}, "messages", c, tok, "row 1")
    empty = [MESSAGES[0], {"role": "assistant", "content": ""}]
    with pytest.raises(UserError, match="message 2 \\(the assistant's\\) is empty"):
        row_pieces({"messages": empty}, "messages", c, tok, "row 1")
