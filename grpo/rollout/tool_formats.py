"""Tool-call formats: how a chat template shows tools, how the model writes a call, and how a
tool's answer follows it. One class a format, chosen once at the edge by rollout.tool_format
(`tool_format_for`; auto reads the tokenizer's chat template):

- `hermes`: the Qwen2.5 / Hermes format, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
  in the assistant's turn, the tokenizer's own template (Qwen2.5's, Qwen3-Instruct-2507's,
  Hermes-style ones), checked to be prefix-preserving.
- `qwen3`: Qwen3's calls are Hermes', but its stock template is not prefix-preserving (it
  drops an assistant turn's empty think block once a message follows it); rendered with
  `QWEN3_TEMPLATE`, our own, which keeps it, as TRL's training templates do. Thinking on
  (the default) or off with rollout.chat_template_kwargs {enable_thinking: false}.
- `llama3`: Llama 3.1 / 3.2's JSON calls, `{"name": ..., "parameters": {...}}` as the whole
  turn (after `<|python_tag|>` or bare), tool messages as `ipython` turns; the tokenizer's
  own template.

Each format renders (`render`), gives the text a turn's tool messages add after the model's
end of turn (`suffix`, out of the loss), reads the calls in a turn's text (`parse`), and
that text without them (`content`). The user's guide: docs/tools.md.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from grpo.errors import UserError
from grpo.infra.imports import one_line

__all__ = [
    "FORMATS",
    "TOOL_CALL",
    "Call",
    "HermesFormat",
    "Llama3Format",
    "Qwen3Format",
    "ToolFormat",
    "parse_calls",
    "parse_llama3",
    "tool_format_for",
]

TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
PYTHON_TAG = "<|python_tag|>"
_LLAMA_ENDS = ("<|eot_id|>", "<|eom_id|>")  # a Llama 3 turn's end tokens, when a text still has them


# ---- calls --------------------------------------------------------------------------------------


@dataclass
class Call:
    """One tool call the model wrote: its name and arguments, or why it cannot be run."""

    name: str
    arguments: dict = field(default_factory=dict)
    error: str | None = None  # set: the call is not run, this is the tool's answer

    def as_message(self) -> dict:
        """The call as a chat message's `tool_calls` entry (TRL's, and transformers' chat templates')."""
        return {"type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def _call_of(data, key: str) -> Call:
    """The Call a decoded JSON value stands for: `{"name": str, key: object}` (the arguments
    may also be a JSON string of an object, as some models write them)."""
    name = data.get("name") if isinstance(data, dict) else None
    arguments = data.get(key, {}) if isinstance(data, dict) else None
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    if not isinstance(name, str) or not isinstance(arguments, dict):
        return Call(name if isinstance(name, str) else "", error=f'a tool call is {{"name": string, "{key}": object}}')
    return Call(name, arguments)


def _not_json(err: json.JSONDecodeError) -> Call:
    return Call("", error=f"the tool call is not JSON ({err.msg} at character {err.pos})")


def parse_calls(text: str) -> list[Call]:
    """The calls in a model turn's text, Hermes format: each `<tool_call>...</tool_call>`
    block's JSON, `{"name": str, "arguments": object}`. A block that is not such JSON is a
    Call with an error."""
    calls = []
    for block in TOOL_CALL.findall(text):
        try:
            calls.append(_call_of(json.loads(block), "arguments"))
        except json.JSONDecodeError as err:
            calls.append(_not_json(err))
    return calls


def _llama3_turn(text: str) -> tuple[str, bool]:
    """A Llama 3 turn's text without its end token and surrounding blanks, and whether it
    starts with <|python_tag|> (then without it)."""
    text = text.strip()
    for end in _LLAMA_ENDS:
        text = text.removesuffix(end).rstrip()
    tagged = text.startswith(PYTHON_TAG)
    return (text[len(PYTHON_TAG) :].strip() if tagged else text), tagged


def parse_llama3(text: str) -> list[Call]:
    """The calls in a model turn's text, Llama 3.1 / 3.2 format: the turn is JSON objects
    `{"name": str, "parameters": object}` (one, or several separated by ';'), after
    <|python_tag|> or bare. A bare turn is a call only when it starts with such an object
    (else it is the model's answer, as vLLM's llama3_json parser reads it); after the tag,
    what is not such JSON is a Call with an error."""
    text, tagged = _llama3_turn(text)
    if not tagged and not text.startswith("{"):
        return []
    calls, decoder, pos = [], json.JSONDecoder(), 0
    while pos < len(text):
        try:
            data, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as err:
            if not tagged and not calls:
                return []
            calls.append(_not_json(err))
            break
        if not tagged and not calls and not (isinstance(data, dict) and "name" in data):
            return []  # a JSON answer, not a call
        key = "parameters" if not isinstance(data, dict) or "arguments" not in data else "arguments"
        calls.append(_call_of(data, key))
        while pos < len(text) and text[pos] in " \t\n;":
            pos += 1
    return calls


# ---- the formats ------------------------------------------------------------------------------


PROBE_TOOL = "grpo_probe_tool"
_PROBE = {
    "type": "function",
    "function": {
        "name": PROBE_TOOL,
        "description": "Probe.",
        "parameters": {"type": "object", "properties": {"x": {"type": "integer", "description": "X."}}},
    },
}
_PROBE_CALL = {"role": "assistant", "content": "", "tool_calls": [Call(PROBE_TOOL, {"x": 1}).as_message()]}
_PROBE_USER = {"role": "user", "content": "hi"}


def _listing() -> str:
    return "; ".join(f"{name} ({cls.describes})" for name, cls in FORMATS.items())


class ToolFormat:
    """A tool-call format spoken through a chat template (the tokenizer's own, or `template`
    where the format brings its own), checked when built: it renders the tools' schemas into
    the prompt and a probe call in the format (read back by `parse`, arguments and all), and
    each appended message leaves what came before it as it was (prefix-preserving)."""

    name = ""
    describes = ""  # the format in a few words, for messages
    template: str | None = None  # the chat template rendered with; None: the tokenizer's own

    def __init__(self, tokenizer, template_kwargs: dict | None = None):
        self.tokenizer = tokenizer
        self.template_kwargs = dict(template_kwargs or {})  # rollout.chat_template_kwargs
        if self.template is None and getattr(tokenizer, "chat_template", None) is None:
            raise UserError(
                f"rollout.tools: the model's tokenizer has no chat template (tools need one in {self.describes})"
            )
        self.eos = tokenizer.eos_token
        try:
            prompt = self.render([_PROBE_USER], [_PROBE], generation=True)
            turn = _turn_of(prompt, self.render([_PROBE_USER, _PROBE_CALL], [_PROBE], generation=False))
        except Exception as err:
            raise UserError(
                f"rollout.tools: the model's chat template cannot render a tool call ({one_line(str(err))}); "
                f"rollout.tool_format {self.name} is {self.describes}"
            ) from None
        if PROBE_TOOL not in prompt or not _reads_probe(self.parse, turn):
            raise UserError(
                f"rollout.tools: the model's chat template does not render tools in {self.describes} "
                f"(rollout.tool_format {self.name}); the formats: {_listing()} (docs/tools.md)"
            )
        self.suffix([{"role": "tool", "name": PROBE_TOOL, "content": "grpo_probe_result"}])  # renders, cuts

    def render(self, messages: list[dict], tools: list[dict] | None, *, generation: bool) -> str:
        """`messages` (and the tools' JSON schemas) as the model reads them."""
        options = {} if self.template is None else {"chat_template": self.template}
        return self.tokenizer.apply_chat_template(
            messages,
            tools=tools or None,
            add_generation_prompt=generation,
            tokenize=False,
            **options,
            **self.template_kwargs,
        )

    def suffix(self, tool_messages: list[dict]) -> str:
        """What follows the model's end-of-turn token when a turn's `tool_messages` answer it,
        up to the next assistant turn's start: rendered after a stand-in conversation and
        cut where the stand-in's assistant turn ends (at its EOS)."""
        name = tool_messages[0].get("name", "tool")
        before = [
            {"role": "user", "content": "x"},
            {"role": "assistant", "content": "", "tool_calls": [Call(name, {}).as_message()]},
        ]
        prefix = self.render(before, None, generation=False)
        full = self.render(before + tool_messages, None, generation=True)
        if not full.startswith(prefix):
            raise UserError(
                "rollout.tools: the model's chat template renders a conversation differently once a tool message "
                "follows (not prefix-preserving, as Qwen3's stock template, which rollout.tool_format qwen3 "
                "replaces), so the sampled tokens cannot be kept; save the model's tokenizer with a "
                "prefix-preserving template (docs/tools.md)"
            )
        end = prefix.rfind(self.eos) if self.eos else -1
        if end < 0:
            raise UserError(
                f"rollout.tools: the chat template's assistant turn does not end with the tokenizer's EOS "
                f"({self.eos!r}), where the model stops; cannot tell where a tool message starts"
            )
        return full[end + len(self.eos) :]

    @staticmethod
    def parse(text: str) -> list[Call]:
        """The calls in a model turn's text (errors included: a call written badly)."""
        raise NotImplementedError

    def content(self, text: str) -> str:
        """A model turn's text without its calls: its message's content."""
        raise NotImplementedError


def _turn_of(prompt: str, conversation: str) -> str:
    """The assistant turn `conversation` renders after `prompt` (the whole text where the
    template renders the prompt otherwise)."""
    return conversation[len(prompt) :] if conversation.startswith(prompt) else conversation


def _reads_probe(parse, turn: str) -> bool:
    return any(c.error is None and c.name == PROBE_TOOL and c.arguments == {"x": 1} for c in parse(turn))


class HermesFormat(ToolFormat):
    """The Qwen2.5 / Hermes format through the tokenizer's own chat template: the tools'
    schemas in the system turn, a call as a `<tool_call>` block of JSON in the assistant's
    turn, `{"role": "tool", ...}` messages after them."""

    name = "hermes"
    describes = "the Qwen2.5/Hermes format, <tool_call>{json}</tool_call>"
    parse = staticmethod(parse_calls)

    def content(self, text: str) -> str:
        return TOOL_CALL.sub("", text)


class Qwen3Format(HermesFormat):
    """Qwen3's format (Hermes' calls, think blocks) through `QWEN3_TEMPLATE`, which renders
    what Qwen3's stock template renders but keeps every assistant turn after the last user
    message as it was once more messages follow (module doc). The reasoning is the model's:
    a call is read after its think block, never inside it."""

    name = "qwen3"
    describes = "Qwen3's format, <tool_call>{json}</tool_call> after a think block, through grpo's template"

    def __init__(self, tokenizer, template_kwargs: dict | None = None):
        from grpo.rollout.chat_templates import QWEN3_TEMPLATE

        self.template = QWEN3_TEMPLATE
        super().__init__(tokenizer, template_kwargs)

    @staticmethod
    def parse(text: str) -> list[Call]:
        return parse_calls(text.rpartition("</think>")[2])


class Llama3Format(ToolFormat):
    """Llama 3.1 / 3.2's JSON calls through the tokenizer's own chat template: the tools'
    schemas in the first user turn, a call as the assistant turn's whole text
    (`parse_llama3`), a tool message as an `ipython` turn."""

    name = "llama3"
    describes = 'Llama 3.1/3.2\'s JSON calls, {"name": ..., "parameters": {...}}'
    parse = staticmethod(parse_llama3)

    def content(self, text: str) -> str:
        return "" if parse_llama3(text) else _llama3_turn(text)[0]


FORMATS: dict[str, type[ToolFormat]] = {"hermes": HermesFormat, "qwen3": Qwen3Format, "llama3": Llama3Format}
AUTO = "auto"


def detect(tokenizer, template_kwargs: dict | None = None) -> str:
    """The format the tokenizer's chat template speaks: its rendering of a probe call read
    by each format's parser; a `<tool_call>` template that is Qwen3's (thinking, and not
    prefix-preserving) is qwen3. A one-line UserError for a template that fits none."""
    template = getattr(tokenizer, "chat_template", None)
    if template is None:
        raise UserError("rollout.tools: the model's tokenizer has no chat template (tools need one); " + _formats())
    kwargs = {"tokenize": False, **dict(template_kwargs or {})}
    try:
        prompt = tokenizer.apply_chat_template([_PROBE_USER], tools=[_PROBE], add_generation_prompt=True, **kwargs)
        called = tokenizer.apply_chat_template([_PROBE_USER, _PROBE_CALL], tools=[_PROBE], **kwargs)
    except Exception as err:
        raise UserError(
            f"rollout.tools: the model's chat template cannot render a tool call ({one_line(str(err))}); " + _formats()
        ) from None
    turn = _turn_of(prompt, called)
    if _reads_probe(parse_llama3, turn):
        return "llama3"
    if not _reads_probe(parse_calls, turn):
        raise UserError(f"rollout.tools: the model's chat template speaks no tool-call format grpo reads; {_formats()}")
    if "<think>" in template and "enable_thinking" in template and not _prefix_preserving(tokenizer, kwargs):
        return "qwen3"
    return "hermes"


def _prefix_preserving(tokenizer, kwargs: dict) -> bool:
    before = tokenizer.apply_chat_template([_PROBE_USER, _PROBE_CALL], **kwargs)
    tool = {"role": "tool", "name": PROBE_TOOL, "content": "1"}
    return tokenizer.apply_chat_template([_PROBE_USER, _PROBE_CALL, tool], **kwargs).startswith(before)


def _formats() -> str:
    return f"rollout.tool_format names one of: {_listing()} (docs/tools.md)"


def tool_format_for(tokenizer, name: str = AUTO, template_kwargs: dict | None = None) -> ToolFormat:
    """The tool-call format `name` (rollout.tool_format: auto, hermes, qwen3 or llama3) over
    `tokenizer`, checked; auto: the one its chat template speaks (`detect`).
    `template_kwargs`: rollout.chat_template_kwargs, the template's own variables."""
    if name == AUTO:
        name = detect(tokenizer, template_kwargs)
    if name not in FORMATS:
        raise UserError(f"rollout.tool_format: {name!r} is not a format; auto, or {_formats().partition(': ')[2]}")
    return FORMATS[name](tokenizer, template_kwargs)
