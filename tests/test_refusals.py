"""The refusal table (grpo/refusals.py): every row is listed in docs/refusals.md with the limit
behind it, every row's wording stands nowhere else in grpo/ (worded once), and every row is
raised by the check that owns it, in its own words."""

import ast
import re
import types
from pathlib import Path

import pytest
import torch

import grpo
from grpo.config import config_from_dict
from grpo.errors import UserError
from grpo.refusals import REFUSALS, refusal, refuse
from grpo.rollout import decoders
from grpo.rollout.worker import refuse_auto_generate
from grpo.train.models import GivenPolicy, check_given
from grpo.train.preflight import preflight

ROOT = Path(__file__).parents[1]
PACKAGE = Path(grpo.__file__).parent
PAGE = ROOT / "docs" / "refusals.md"


# ---- the docs list every row ------------------------------------------------------------------


def docs_line(name, row) -> str:
    """A row as docs/refusals.md's table shows it."""
    return f"| `{name}` | {row.what} | {row.limit} |"


def test_docs_list_every_row_and_no_other():
    shown = [line for line in PAGE.read_text().splitlines() if re.match(r"^\| `[^`]+` \|", line)]
    expected = [docs_line(name, row) for name, row in REFUSALS.items()]
    assert shown == expected, "docs/refusals.md's table should read:\n" + "\n".join(expected)


def test_the_docs_page_is_linked_from_the_readme():
    assert "(docs/refusals.md)" in (ROOT / "README.md").read_text()


# ---- worded once ------------------------------------------------------------------------------


def strings(path: Path) -> list[str]:
    """The string constants of a module (an implicit concatenation is one; an f-string's
    literal parts each)."""
    return [
        n.value
        for n in ast.walk(ast.parse(path.read_text()))
        if isinstance(n, ast.Constant) and isinstance(n.value, str)
    ]


def fragments(text: str) -> list[str]:
    """The literal runs of a row's reason between its {fields}, those long enough to be words."""
    return [part.strip() for part in re.split(r"\{\w+\}", text) if len(part.strip()) >= 12]


def rewordings(root: Path, table: dict) -> list[str]:
    """Where a module under `root` other than the table's spells a row's reason again."""
    found = []
    for path in sorted(root.rglob("*.py")):
        if path.name == "refusals.py" and path.parent == root:
            continue
        texts = strings(path)
        for name, row in table.items():
            for part in fragments(row.reason):
                if any(part in text for text in texts):
                    found.append(f"{path.relative_to(root)} words {name!r} again: {part!r}")
    return found


def test_every_row_is_worded_once():
    assert rewordings(PACKAGE, REFUSALS) == []


def test_the_wording_check_sees_a_row_spelt_again(tmp_path):
    (tmp_path / "refusals.py").write_text("")
    (tmp_path / "check.py").write_text(
        'def check(c):\n    if c.rollout.sampler == "hf":\n        raise ValueError(\n'
        "            \"rollout.sampler: hf (transformers' generate) returns no log-probs, which a stale batch's \"\n"
        '            "ratio needs; use fast, auto or vllm")\n'
    )
    assert rewordings(tmp_path, REFUSALS) == [
        "check.py words 'async+hf' again: \"rollout.sampler: hf (transformers' generate) returns no log-probs, "
        "which a stale batch's ratio needs; use fast, auto or vllm\""
    ]


def test_refusal_fills_the_fields_and_refuse_raises_it():
    assert refusal("async+server+torchrun", world_size=2).startswith("rollout.async: the generator processes of 2 ")
    with pytest.raises(UserError, match=r"^rollout.async: rollout.sampler: hf \(transformers' generate\) returns no"):
        refuse("async+hf")


# ---- the checks raise every row ---------------------------------------------------------------

MODEL_REWARD = {"model": "tiny-reward-model"}
VERIFIER = {"verifier": "exact_answer"}
TOOLS = ["tests.rollout.tool_models:multiply"]
SERVER = {"sampler": "vllm", "vllm": {"server": "127.0.0.1:8000"}}
ASYNC = {"async": {"max_staleness": 1}}
QLORA = {"r": 4, "quantize": "nf4"}


def minimal(**sections) -> dict:
    data = {"model": "tiny-model", "data": {"path": "prompts.jsonl"}, "rewards": [{"function": "exact_answer"}]}
    data.update(sections)
    return data


def launch(world_size, **sections):
    """The checks a launch of `world_size` processes makes before any model loads (those that
    need an engine's facts, then the launch's own)."""
    return lambda: preflight(config_from_dict(minimal(**sections)), world_size, torch.device("cpu"))


GPT2 = types.SimpleNamespace(config=types.SimpleNamespace(model_type="gpt2"))  # no Llama: fast cannot run it


def sample_with(name):
    return lambda: decoders.choose(name, GPT2, 20)


# row -> what raises it (a config mapping for config_from_dict, or a call)
TRIGGERS = {
    "process+function": minimal(rewards=[{"function": "exact_answer", "process": True}]),
    "process-model+outcome": minimal(rewards=[{**MODEL_REWARD, "process": True}]),
    "reward-model+timeout": minimal(rewards=[{**MODEL_REWARD, "timeout": 5}]),
    "group+one-sample": minimal(rollout={"group_size": 1}),
    "group+kl-in-reward": minimal(loss={"kl_in": "reward"}),
    "drop-zero-std+one-sample": minimal(
        algorithm="ppo", rollout={"group_size": 1}, loss={"drop_zero_std_groups": True}
    ),
    "process+critic": minimal(algorithm="ppo", loss={"supervision": "process"}),
    "multi-turn+process": minimal(rollout={"tools": TOOLS}, loss={"supervision": "process"}),
    "agent+tools": minimal(rollout={"tools": TOOLS, "agent": "tests.train.test_agent:guess"}),
    "sampler-logprobs+hf": minimal(rollout={"sampler": "hf"}, train={"old_logprobs": "sampler"}),
    "fast-only": launch(1, rollout={"sampler": "hf", "draw": "fast"}),
    "lora+sampler": launch(1, rollout={"sampler": "fast"}, lora={"r": 4}),
    "adapter+iterations": minimal(lora={"r": 4, "save": "both"}, train={"iterations": 2}),
    "sampler+model": sample_with("fast"),
    "vllm+top_p+min_p": launch(1, rollout={"sampler": "vllm", "top_p": 0.9, "min_p": 0.1}),
    "server+not-vllm": minimal(rollout={"vllm": {"server": "127.0.0.1:8000"}}),
    "transport-nccl": minimal(rollout={**SERVER, "vllm": {"server": "127.0.0.1:8000", "transport": "nccl"}}),
    "async+hf": minimal(rollout={**ASYNC, "sampler": "hf"}),
    "async+auto-hf": lambda: refuse_auto_generate(config_from_dict(minimal(rollout=ASYNC)).rollout, GPT2),
    "async+recompute-uncorrected": minimal(
        rollout=ASYNC, train={"old_logprobs": "recompute"}, loss={"engine_correction": "none"}
    ),
    "iterative+no-reward-model": minimal(train={"iterations": 2}, reward_model_update=VERIFIER),
    "iterative+function-reward": minimal(
        rewards=[{"function": "exact_answer"}, MODEL_REWARD],
        train={"iterations": 2},
        reward_model_update={**VERIFIER, "reward": 0},
    ),
    "iterative+one-iteration": minimal(rewards=[MODEL_REWARD], reward_model_update=VERIFIER),
    "quantize+iterations": minimal(lora=QLORA, train={"iterations": 2}),
    "nccl+cpu": launch(1, train={"backend": "nccl"}),
    "torchrun+uneven-prompts": launch(2, rollout={"prompts_per_step": 3}),
    "adamw_8bit+torchrun": launch(2, train={"optimizer": "adamw_8bit"}),
    "in-backward+clipping": minimal(train={"optimizer_in_backward": True}),
    "in-backward+accumulation": minimal(
        train={"optimizer_in_backward": True, "max_grad_norm": 0, "micro_batch_size": 4}
    ),
    "in-backward+token-budget": minimal(
        train={"optimizer_in_backward": True, "max_grad_norm": 0, "micro_batch_tokens": 64}
    ),
    "in-backward+torchrun": launch(2, train={"optimizer_in_backward": True, "max_grad_norm": 0}),
    "quantize+torchrun": launch(2, lora=QLORA),
    "async+server+torchrun": launch(2, rollout={**SERVER, **ASYNC}),
    "given-policy+async": lambda: check_given(config_from_dict(minimal(rollout=ASYNC)), GivenPolicy(None, object())),
    "given-model+critic": lambda: check_given(config_from_dict(minimal(algorithm="ppo")), GivenPolicy(object(), None)),
    "given-model+quantize": lambda: check_given(config_from_dict(minimal(lora=QLORA)), GivenPolicy(object(), None)),
}


def pattern(name) -> str:
    """Row `name`'s one line, any value in its {fields}."""
    row = REFUSALS[name]
    return "^" + ".+".join(re.escape(part) for part in re.split(r"\{\w+\}", f"{row.key}: {row.reason}")) + "$"


def test_every_row_has_a_trigger():
    assert sorted(REFUSALS) == sorted(TRIGGERS), "a row without a trigger here, or a trigger of a row that is gone"


@pytest.mark.parametrize("name", sorted(TRIGGERS))
def test_the_check_raises_the_row_in_its_words(name):
    assert name in REFUSALS, f"{name} is no longer refused: delete its trigger here and its line in docs/refusals.md"
    trigger = TRIGGERS[name]
    with pytest.raises(UserError) as info:
        trigger() if callable(trigger) else config_from_dict(trigger)
    assert re.match(pattern(name), str(info.value)), str(info.value)
