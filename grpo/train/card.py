"""The model card that final/ and best/ carry: README.md in the Hub's card format.

A YAML header holds the Hub's metadata (base_model and datasets where they are hub ids, which
the Hub checks; library_name; tags), then the card says what a reader needs to trust and
reproduce the model: the base model, the data, the rewards with their weights, the key
settings, the steps and samples trained on, the held-out evaluation before and after (the
eval section's numbers in metrics.jsonl, or the `grpo eval` command that measures it), the
grpo version and the command that reproduces the run, with the resolved config written beside
(`CONFIG`) and shown collapsed. As TRL's trainers write theirs (their card template), and in
the layout of huggingface_hub's ModelCard. Process 0 writes it, atomically, after the weights.
The user's guide: docs/training.md#the-model-card-and-the-hub.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import yaml

from grpo.config import Config, config_to_dict, hub_repo
from grpo.data import GIVEN_DATASET
from grpo.infra.logging import read_metrics, write_atomic

__all__ = ["CARD", "CONFIG", "evaluations", "hub_id", "model_card", "write_card"]

CARD = "README.md"  # the card, where the Hub looks for it
CONFIG = "grpo_config.yaml"  # the resolved config beside the weights: `grpo train grpo_config.yaml`

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")


def hub_id(name) -> str | None:
    """`name` when it can only be a hub id (a model or dataset on the Hub), else None: a local
    folder or file, a generated source ('arithmetic:100'), an object handed to grpo.train."""
    if not isinstance(name, str) or _HUB_ID.fullmatch(name) is None or name == GIVEN_DATASET:
        return None
    return None if Path(name).expanduser().exists() else name


def evaluations(metrics: list[dict], step: int) -> tuple[dict | None, dict | None]:
    """The held-out evaluations of a run's metrics lines up to `step`: step 0's (before any
    update) and the latest (after), each a line with its step; None where there is none."""
    evaluated = [m for m in metrics if m.get("step", 0) <= step and any(k.startswith("eval/") for k in m)]
    before = next((m for m in evaluated if m["step"] == 0), None)
    return before, (evaluated[-1] if evaluated else None)


def _eval_rows(before: dict | None, after: dict | None) -> list[str]:
    """The evaluation's table: each pass@k and maj@k with its 95% interval, the shares cut
    and without an answer, one column per evaluation (before and after; one when they are
    the same step's)."""
    columns = list({m["step"]: m for m in (before, after) if m is not None}.values())
    names = sorted(
        {k for m in columns for k in m if re.fullmatch(r"eval/(pass|maj)@\d+", k)},
        key=lambda k: (not k.startswith("eval/pass"), int(k.split("@")[1])),  # pass@k first
    )
    names += [k for k in ("eval/truncated", "eval/no_answer") if any(k in m for m in columns)]

    def cell(m: dict, name: str) -> str:
        if m.get(name) is None:
            return "-"
        lo, hi = m.get(f"{name}_lo"), m.get(f"{name}_hi")
        return f"{m[name]:.3f}" if lo is None or hi is None else f"{m[name]:.3f} ({lo:.3f}-{hi:.3f})"

    head = ["| metric | " + " | ".join(f"step {m['step']}" for m in columns) + " |", "|---" * (1 + len(columns)) + "|"]
    return head + [f"| `{n}` | " + " | ".join(cell(m, n) for m in columns) + " |" for n in names]


def _table(rows: list[tuple[str, object]]) -> list[str]:
    return ["| | |", "|---|---|", *(f"| {name} | {value} |" for name, value in rows)]


def model_card(
    c: Config,
    *,
    steps: int,
    rows: int | None = None,
    before: dict | None = None,
    after: dict | None = None,
    tokens: int | None = None,
    adapter: bool = False,
    location: str | None = None,
) -> str:
    """The card's text for a policy trained `steps` steps with config `c`: `rows` in the
    data, the evaluations `before` and `after` (metrics lines, with their step), `tokens`
    generated, `adapter`: the folder holds a peft adapter alone; `location`: where the model
    is (the Hub repository or the folder), for the commands the card shows."""
    # The package's own: its __init__ has run (this module is in it); `from grpo import` would
    # make an import cycle of grpo -> grpo.train -> ... -> here.
    version = sys.modules["grpo"].__version__
    tree = config_to_dict(c)  # reward functions by name, as config.yaml records them
    ro = c.rollout
    name = (hub_repo(c) or Path(c.output_dir).resolve().name).rpartition("/")[2]
    location = location or hub_repo(c) or str(Path(c.output_dir) / "final")
    method = {"grpo": "GRPO", "ppo": "PPO"}[c.algorithm]
    out = [*_header(c, name, adapter), "", f"# {name}", ""]
    out.append(
        f"`{c.model}` trained with {method} by grpo {version}: "
        f"{steps} steps of {ro.prompts_per_step} prompts x {ro.group_size} completions."
        + (" The folder holds the LoRA adapter (peft's files) for that base model." if adapter else "")
    )
    out += ["", "## Data", "", *_data(c, rows)]
    out += ["", "## Rewards", "", *_rewards(tree)]
    out += ["", "## Training", "", *_table(_settings(c, steps, rows, tokens))]
    out += ["", "## Evaluation", "", *_evaluation(c, tree, before, after, location)]
    out += ["", "## Reproduce", "", *_reproduce(tree, version)]
    return "\n".join(out)


def _header(c: Config, name: str, adapter: bool) -> list[str]:
    """The card's YAML header: base_model and datasets where they are hub ids (the Hub checks
    them), the library, the name, the pipeline and the tags."""
    base, dataset = hub_id(c.model), hub_id(c.data.path)
    tags = list(dict.fromkeys(["grpo", c.algorithm, "reinforcement-learning", *(["lora"] if c.lora.r else [])]))
    header: dict = {}
    if base:
        header["base_model"] = base
    if dataset:
        header["datasets"] = [dataset]
    header.update(
        library_name="peft" if adapter else "transformers",
        model_name=name,
        pipeline_tag="text-generation",
        tags=tags,
    )
    return ["---", yaml.safe_dump(header, sort_keys=False).rstrip(), "---"]


def _data(c: Config, rows: int | None) -> list[str]:
    """The data section: where the prompts came from, which configuration and split, how many."""
    d = c.data
    if not d.path:
        return ["No dataset: each rollout's task comes from `rollout.environment`."]
    shown = "handed to `grpo.train(dataset=...)`" if d.path == GIVEN_DATASET else f"`{d.path}`"
    facts = [("data", shown)]
    if hub_id(d.path):
        facts.append(("configuration", f"`{d.config}`" if d.config else "default"))
        facts.append(("split", f"`{d.split}`"))
    facts.append(("prompt column", f"`{d.prompt_column}`"))
    if rows is not None:
        facts.append(("rows", rows))
    if d.system_prompt:
        facts.append(("system prompt", f"`{d.system_prompt!r}`"))
    return _table(facts)


def _rewards(tree: dict) -> list[str]:
    """The rewards section: each reward (a function by name, or a reward model) with its weight."""
    out = ["| reward | weight |", "|---|---|"]
    for entry in tree["rewards"]:
        what = f"`{entry['function']}`" if entry.get("function") else f"reward model `{entry['model']}`"
        out.append(f"| {what} | {entry['weight']:g} |")
    if not tree["rewards"]:
        out.append("| the environment's `get_reward` | 1 |")
    return out


def _settings(c: Config, steps: int, rows: int | None, tokens: int | None) -> list[tuple[str, object]]:
    """The training section's facts: what was trained on and the settings that shape it."""
    ro, tr, lo = c.rollout, c.train, c.loss
    prompts = steps * ro.prompts_per_step
    return [
        ("algorithm", c.algorithm),
        ("steps", steps),
        ("prompts trained on", prompts),
        ("completions sampled", prompts * ro.group_size),
        *([("passes over the data", f"{prompts / rows:.2f}")] if rows else []),
        *([("tokens generated", tokens)] if tokens is not None else []),
        ("group size G", ro.group_size),
        ("max new tokens", ro.max_new_tokens),
        ("temperature", f"{ro.temperature:g}"),
        ("learning rate", f"{tr.lr:g}"),
        ("KL coefficient (loss.beta)", f"{lo.beta:g}"),
        ("loss aggregation", lo.aggregation),
        ("update epochs x minibatches", f"{tr.epochs} x {tr.minibatches}"),
        ("optimizer", tr.optimizer),
        ("dtype", tr.dtype),
        ("LoRA", f"r {c.lora.r}, alpha {c.lora.alpha:g}" if c.lora.r else "none (all weights trained)"),
        ("seed", c.seed),
    ]


def _evaluation(c: Config, tree: dict, before: dict | None, after: dict | None, location: str) -> list[str]:
    """The evaluation section: before and after with their intervals, or the command that measures."""
    if after is None:
        functions = [r["function"] for r in tree["rewards"] if r.get("function")]
        verifier = f" --verifier {functions[0]}" if functions else ""
        return [
            "Not evaluated during training (the config has no `eval` section). Measure pass@k and "
            "maj@k on held-out problems with:",
            "",
            "```bash",
            f"grpo eval --model {location} --data HELD_OUT_DATA{verifier}",
            "```",
        ]
    ev = c.eval
    return [
        f"Held out: `{ev.data}`, {ev.n} samples per problem at temperature {ev.temperature:g} "
        "(pass@k and maj@k with their 95% intervals; the same numbers as `grpo eval`).",
        "",
        *_eval_rows(before, after),
    ]


def _reproduce(tree: dict, version: str) -> list[str]:
    """The reproduce section: the command, and the resolved config folded away."""
    return [
        f"With grpo {version} and the resolved config beside the weights (`{CONFIG}`):",
        "",
        "```bash",
        f"grpo train {CONFIG}",
        "```",
        "",
        "<details><summary>The resolved config</summary>",
        "",
        "```yaml",
        yaml.safe_dump(tree, sort_keys=False).rstrip(),
        "```",
        "",
        "</details>",
        "",
    ]


def write_card(directory: Path, c: Config, *, step: int, rows: int | None = None, after: dict | None = None) -> None:
    """final/'s or best/'s README.md and the resolved config beside it, for the policy after
    `step` steps (process 0 only): the evaluations from output_dir/metrics.jsonl up to that
    step, or `after` (a line with its step) when that step's is not logged yet (best/)."""
    directory = Path(directory)
    metrics = read_metrics(Path(c.output_dir) / "metrics.jsonl")
    before, logged = evaluations(metrics, step)
    after = after or logged
    if before is None and after is not None and after["step"] == 0:
        before = after
    tokens = [m["tokens/completion"] for m in metrics if 0 < m.get("step", 0) <= step and "tokens/completion" in m]
    adapter = (directory / "adapter_config.json").exists() and not (directory / "config.json").exists()
    location = hub_repo(c) or str(directory.with_name(directory.name.removesuffix(".tmp")))  # best.tmp: best
    total = sum(tokens) if tokens else None
    text = model_card(
        c, steps=step, rows=rows, before=before, after=after, tokens=total, adapter=adapter, location=location
    )
    write_atomic(directory / CONFIG, yaml.safe_dump(config_to_dict(c), sort_keys=False))
    write_atomic(directory / CARD, text)
