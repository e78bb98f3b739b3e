"""Built-in rule rewards: a checked final answer (exact or math-equivalent) and R1's format.

DeepSeek-R1 (arXiv 2501.12948, §2.2.2) trains with rules instead of a neural reward model,
which it found prone to reward hacking: an accuracy reward that checks the final answer
against the data's reference, and a format reward for `<think>...</think><answer>...</answer>`.
Each is a RewardFn (TRL's signature): 1.0 right, 0.0 wrong, None without a reference; of the
columns it gets by keyword, each reads the ones it needs. `extract_answer` reads R1's, MATH's
and GSM8K's answer forms, and a reference with a marker (GSM8K's '#### 72') is read the same way.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Sequence
from decimal import Decimal
from typing import Any

from grpo.errors import UserError

__all__ = ["exact_answer", "extract_answer", "math_answer", "r1_format"]

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_BOXED = "\\boxed{"
# An integer with optional thousands separators, or a decimal: '1,000', '-3', '2.50', '.5'.
_NUMBER = re.compile(r"[+-]?(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d*)?|\.\d+)")
# Whitespace may surround and separate the two blocks; nothing else may (R1's format reward).
_R1_FORMAT = re.compile(r"\s*<think>.*?</think>\s*<answer>.*?</answer>\s*", re.DOTALL)
_R1_TAGS = ("<think>", "</think>", "<answer>", "</answer>")
# math_verify's own default, in whole seconds (it arms signal.alarm with it).
_MATH_VERIFY_TIMEOUT_S = 5


def extract_answer(text: str) -> str | None:
    """The model's final answer in `text`, or None when it gave none.

    In order: the content of the last `<answer>...</answer>` (R1 format; a `\\boxed{}` inside
    it is unwrapped), else the content of the last `\\boxed{...}` with balanced braces
    (MATH), else the first line after the last '####' (GSM8K). Stripped of outer whitespace.
    """
    tagged = _ANSWER_TAG.findall(text)
    if tagged:
        boxed = _last_boxed(tagged[-1])
        return (tagged[-1] if boxed is None else boxed).strip()
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    if "####" in text:
        after = text.rsplit("####", 1)[1].strip()
        return after.split("\n", 1)[0].strip()
    return None


def _last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{`, up to its matching brace; None if absent or unclosed."""
    start = text.rfind(_BOXED)
    if start == -1:
        return None
    begin = start + len(_BOXED)
    depth = 1
    for i in range(begin, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[begin:i]
    return None  # a truncated generation: the box never closes


def _canonical(answer: str) -> str | Decimal:
    """Whitespace collapsed, a trailing period dropped; numbers as exact Decimals.

    Decimal compares by value ('1000' == '1000.0') without float rounding, and the
    thousands separators go first ('1,000' == '1000').
    """
    answer = " ".join(answer.split())
    if answer.endswith("."):
        answer = answer[:-1].rstrip()
    if _NUMBER.fullmatch(answer):
        return Decimal(answer.replace(",", ""))
    return answer


def _require_answers(reward: str, answer: Sequence[Any] | None) -> Sequence[Any]:
    """The `answer` column, or a UserError naming the reward that needs it."""
    if answer is None:
        raise UserError(f"reward {reward!r} needs an 'answer' column in the data")
    return answer


def text_of(value: Any) -> str:
    """A prompt or completion as text: a string as it is; TRL's conversational form (a list of
    messages, e.g. `[{"role": "assistant", "content": ...}]`) as its last message's content."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and isinstance(value[-1], dict):
        return str(value[-1].get("content", ""))
    return str(value)


def _exact_match(completion: str, gold: Any) -> float | None:
    if gold is None:
        return None
    prediction = extract_answer(completion)
    if prediction is None:
        return 0.0
    reference = extract_answer(str(gold))
    if reference is None:
        reference = str(gold)
    return float(_canonical(prediction) == _canonical(reference))


def exact_answer(
    prompts: list[str], completions: list[str], answer: Sequence[Any] | None = None, **columns: Any
) -> list[float | None]:
    """1.0 when the completion's final answer equals the `answer` column, else 0.0.

    The final answer is `extract_answer(completion)`; no extractable answer scores 0.0. Both
    sides are compared after `_canonical` (whitespace, trailing period, numbers by value).
    A None reference cannot be scored (None).
    """
    golds = _require_answers("exact_answer", answer)
    return [_exact_match(text_of(c), g) for c, g in zip(completions, golds, strict=True)]


def _math_verify_timeout() -> int | None:
    """Timeout for math_verify's parse/verify: its default on the main thread, else None.

    math_verify guards both with signal.alarm, and signal handlers can only be set from the
    main thread: elsewhere it raises ValueError unless the timeout is None (which it then
    logs once as a warning). Off the main thread a pathological expression can therefore run
    unbounded; the caller owns that timeout.
    """
    return _MATH_VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


def math_answer(
    prompts: list[str], completions: list[str], answer: Sequence[Any] | None = None, **columns: Any
) -> list[float | None]:
    """1.0 when math_verify finds the completion's answer equivalent to `answer`, else 0.0.

    gold = parse(answer), retried as `$answer$` when the raw string yields nothing (a bare
    `x^2+1` is only read as LaTeX); prediction = parse(completion); the score is
    verify(gold, prediction). math_verify compares symbolically and numerically, so
    `$\\frac{1}{2}$` matches `0.5`. A reference that is None or unparsable cannot be scored
    (None). Needs the optional `math-verify` package (`pip install 'grpo[math]'`).
    """
    golds = _require_answers("math_answer", answer)
    try:
        from math_verify import parse, verify
    except ImportError:
        raise UserError("reward 'math_answer' needs the math-verify package: pip install 'grpo[math]'") from None
    timeout = _math_verify_timeout()
    # A prompt's G completions share one reference: parse it once per call.
    parsed_golds: dict[str, list[Any]] = {}
    scores: list[float | None] = []
    for completion, gold in zip(completions, golds, strict=True):
        if gold is None:
            scores.append(None)
            continue
        text = str(gold)
        if text not in parsed_golds:
            parsed_golds[text] = parse(text, parsing_timeout=timeout) or parse(f"${text}$", parsing_timeout=timeout)
        target = parsed_golds[text]
        if not target:
            scores.append(None)
            continue
        prediction = parse(text_of(completion), parsing_timeout=timeout)
        scores.append(float(verify(target, prediction, timeout_seconds=timeout)))
    return scores


def r1_format(prompts: list[str], completions: list[str], **columns: Any) -> list[float | None]:
    """DeepSeek-R1's format reward: 1.0 for `<think>...</think>` then `<answer>...</answer>`.

    Whitespace is allowed around and between the blocks, nothing else is, and each of the four
    tags appears exactly once (so a second answer or a tag inside a block scores 0.0).
    """
    texts = [text_of(c) for c in completions]
    return [float(_R1_FORMAT.fullmatch(c) is not None and all(c.count(t) == 1 for t in _R1_TAGS)) for c in texts]
