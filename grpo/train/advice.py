"""`grpo plan`'s advice on grpo.train.plan's prediction: the savers that apply to a config,
each one's peak alone, the verdict against a budget (the cheapest saver, or savers added
cheapest first, that fits) and the report as text and JSON. The accounting of a step's
memory is grpo.train.plan's; this module only reruns it with each saver's overrides.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from grpo.config import Config
from grpo.errors import UserError
from grpo.train.plan import megabytes, predict, settings

LORA_R = 16  # the rank the LoRA saver proposes


# ---- the savers ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Saver:
    """A change that holds less, its --set overrides and what it costs (docs/memory.md; the
    measured ratios: benchmarks/README.md#memory)."""

    name: str
    overrides: tuple[str, ...]
    cost: str


def savers(c: Config, rows: list[Saver] = ()) -> list[Saver]:
    """The savers that apply to `c`, cheapest first: the same numbers (`rows`: fewer rows a
    pass or a sampling call after checkpointing), then an approximation, then another
    objective or method."""
    t, out = c.train, []
    if not t.chunked_head:
        out.append(Saver("the chunked head", ("train.chunked_head=true",), "none: the same numbers"))
    if not t.gradient_checkpointing:
        out.append(
            Saver("gradient checkpointing", ("train.gradient_checkpointing=true",), "one more forward pass a backward")
        )
    out += rows
    if not t.optimizer_in_backward:
        out.append(
            Saver(
                "the step in the backward",
                ("train.optimizer_in_backward=true", "train.max_grad_norm=0", "train.micro_batch_size=0"),
                "no clipping by the global norm; one pass a minibatch",
            )
        )
    if c.train.reference_dtype != "bfloat16" and c.loss.beta > 0 and c.lora.r == 0:
        out.append(
            Saver(
                "a bf16 reference",
                ("train.reference_dtype=bfloat16",),
                "the reference's log-probs rounded to bf16; slower reference passes on a CPU without bf16 instructions",
            )
        )
    if t.optimizer != "adamw_8bit":
        out.append(
            Saver("8-bit moments", ("train.optimizer=adamw_8bit",), "an approximate update; a slower step on a CPU")
        )
    if c.lora.r == 0:
        out.append(Saver("LoRA", (f"lora.r={LORA_R}",), "another method: only adapters train"))
    if c.lora.quantize == "none":
        r = c.lora.r or LORA_R
        out.append(
            Saver(
                "QLoRA (nf4)",
                (f"lora.r={r}", "lora.quantize=nf4"),
                "only adapters train, on a 4-bit base: rounded weights, slower passes",
            )
        )
    if c.loss.beta > 0 and c.lora.r == 0:
        out.append(Saver("no reference", ("loss.beta=0",), "no KL penalty: the objective changes"))
    return out


def _halvings(n: int) -> list[int]:
    out = []
    while n > 1:
        n //= 2
        out.append(n)
    return out


def advise(
    config: Config | dict | str | Path,
    *,
    overrides: list[str] = (),
    memory: int | None = None,
    device: str = "auto",
    prompt_tokens: int | None = None,
    completion_tokens: int | None = None,
    runtime: int | None = None,
    libraries: dict[str, int] | None = None,
) -> dict:
    """The prediction for `config` (with `overrides`), every saver's (alone), and with
    `memory` (bytes) the verdict: fits, fits with the cheapest saver (or savers, added
    cheapest first) that brings the peak under it, or does not fit. `runtime` and
    `libraries`: as `predict` takes them, measured once for all the savers."""
    from grpo.train.loop import as_config

    c = as_config(config, list(overrides))
    if device == "auto":
        device = "cuda" if c.train.device.startswith("cuda") or (c.train.device == "auto" and _has_cuda()) else "cpu"
    kwargs = dict(device=device, memory=memory, prompt_tokens=prompt_tokens, completion_tokens=completion_tokens)
    base = predict(c, runtime=runtime, libraries=libraries, **kwargs)
    runtime, libraries = base["components"]["runtime"], base["libraries"]

    def with_(extra: tuple[str, ...]) -> dict | None:
        try:
            return predict(as_config(config, [*overrides, *extra]), runtime=runtime, libraries=libraries, **kwargs)
        except UserError:  # a combination the config's checks refuse
            return None

    s = settings(c, device, prompt_tokens, completion_tokens)
    fewer = []
    for key, n, cost in (
        ("train.micro_batch_size", s.micro_rows, "more, smaller passes: a slower update, the same gradient"),
        ("rollout.generation_batch_size", s.generation_rows, "more sampling calls: slower sampling"),
    ):
        for size in _halvings(n):  # half as many without a size; else the most that fit, or 1
            saver = Saver(f"{key.split('.')[1]} {size}", (f"{key}={size}",), cost)
            found = with_(saver.overrides)
            if found and (memory is None or found["peak"] <= memory or size == 1):
                fewer.append(saver)
                break
    candidates, rows = savers(c, fewer), []
    for saver in candidates:
        found = with_(saver.overrides)
        if found is not None and found["peak"] < base["peak"]:  # a saver that lowers the peak
            rows.append({"saver": saver.name, "set": list(saver.overrides), "peak": found["peak"], "cost": saver.cost})
    result = {**base, "memory": memory, "savers": rows}
    if memory is not None:
        result["verdict"] = _verdict(base, rows, candidates, memory, with_)
    return result


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _verdict(base: dict, rows: list[dict], candidates: list[Saver], memory: int, with_) -> dict:
    if base["peak"] <= memory:
        return {
            "fits": True,
            "with": [],
            "set": [],
            "peak": base["peak"],
            "line": f"fits: peak {megabytes(base['peak'])} of {megabytes(memory)}",
        }
    alone = [r for r in rows if r["peak"] <= memory]
    if alone:
        r = alone[0]  # the cheapest (candidates are cheapest first)
        line = f"fits with {r['saver']} (--set {' --set '.join(r['set'])}): peak {megabytes(r['peak'])} of {megabytes(memory)}; cost: {r['cost']}"
        return {"fits": True, "with": [r["saver"]], "set": r["set"], "peak": r["peak"], "line": line}
    taken, sets, peak = [], [], base["peak"]
    for saver in candidates:  # cheapest first, each kept where it lowers the peak
        found = with_((*sets, *saver.overrides))
        if found is None or found["peak"] >= peak:
            continue
        taken.append(saver)
        sets = [*sets, *saver.overrides]
        peak = found["peak"]
        if peak <= memory:
            names = " + ".join(x.name for x in taken)
            line = (
                f"fits with {names} (--set {' --set '.join(sets)}): peak {megabytes(peak)} of {megabytes(memory)}; cost: "
                + "; ".join(x.cost for x in taken)
            )
            return {"fits": True, "with": [x.name for x in taken], "set": sets, "peak": peak, "line": line}
    line = (
        f"does not fit: peak {megabytes(base['peak'])} against {megabytes(memory)}; "
        + (f"with {' + '.join(x.name for x in taken)} still {megabytes(peak)}: " if taken else "")
        + f"the smallest change is {megabytes(peak)} of memory, or a smaller model"
    )
    return {"fits": False, "with": [x.name for x in taken], "set": sets, "peak": peak, "line": line}


# ---- the command -----------------------------------------------------------------------------

LABELS = (
    (
        "runtime",
        "libraries, the model's code, the tokenizer (measured here on a CPU; the CUDA context's estimate on a GPU)",
    ),
    ("libraries", "peft and bitsandbytes, where the run imports them (measured here)"),
    ("policy weights", "the policy (with LoRA: the base and its adapters)"),
    ("reference", "the frozen copy for the KL penalty"),
    ("critic", "PPO's value model: weights, gradients, moments"),
    ("reward models", "the rewards' models"),
    ("optimizer moments", "AdamW's two moments"),
    ("gradients", "the trained weights' gradients (the update)"),
    ("kv cache and logits", "sampling's keys and values, logits, prefill (the sample)"),
    ("fused copies", "the fast loop's stacked q/k/v and gate/up (the sample)"),
    ("packed copies", "single matrices packed in the gradients' room (the sample)"),
    ("activations", "what the update's largest pass saves for its backward"),
    ("head", "the LM head's logits or chunks (the update)"),
    ("dequantized weight", "a 4-bit layer's weight dequantized for its matmul (QLoRA)"),
    ("adapter's activations", "the unmerged adapters' outputs in generate's prefill (LoRA)"),
    ("save's copies", "what the final save merges at a time (LoRA, QLoRA)"),
    ("vllm engine", "the colocated engine's share"),
)


def table(n: dict) -> str:
    """The prediction as text: components, phases, the peak, the savers, the verdict."""
    a = n["assumed"]
    lines = [
        f"grpo plan: {n['model']} on {n['device']}: {n['parameters']:,} parameters; "
        f"prompts of {a['prompt_tokens']} tokens, completions of {a['completion_tokens']}; "
        f"{a['layout']} layout, {a['attention']} attention, sampler {a['sampler']}",
        "",
        "held                   size        what",
    ]
    for key, what in LABELS:
        if key in n["components"]:
            value = n["components"][key]
            shown = "unknown (pass --memory)" if value is None else megabytes(value)
            lines.append(f"  {key:<20} {shown:>11}  {what}")
    acts = n["activations"]
    lines.append(
        f"  (activations of {acts['tokens']:,} tokens a pass: {megabytes(acts['with checkpointing'])} with "
        f"checkpointing, {megabytes(acts['without checkpointing'])} without)"
    )
    lines += ["", "phase                  peak"]
    for name, value in n["phases"].items():
        lines.append(f"  {name:<20} {megabytes(value):>11}" + ("  <- the peak" if name == n["peak_phase"] else ""))
    if n["savers"]:
        lines += ["", "saver (alone)                       peak         cost"]
        for r in n["savers"]:
            lines.append(f"  {r['saver']:<33} {megabytes(r['peak']):>11}  {r['cost']}")
    if n["device"] == "cuda":
        lines.append("(on a GPU these are predictions, not yet measured)")
    if n.get("verdict"):
        lines += ["", n["verdict"]["line"]]
    return "\n".join(lines)


def command(
    config: str,
    *,
    overrides: list[str] = (),
    memory: int | None = None,
    device: str = "auto",
    prompt_tokens: int | None = None,
    completion_tokens: int | None = None,
    json_path: str | None = None,
) -> int:
    """`grpo plan`: the table printed, every number in `json_path` if given."""
    from transformers.utils import logging as hf_logging

    from grpo.infra.logging import write_atomic

    if json_path and (Path(json_path).is_dir() or not Path(json_path).parent.is_dir()):
        raise UserError(f"--json: cannot write {json_path!r}: its folder does not exist or it is a folder")
    hf_logging.set_verbosity_error()
    n = advise(
        config,
        overrides=overrides,
        memory=memory,
        device=device,
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
    )
    if json_path:
        write_atomic(Path(json_path), json.dumps(n, indent=2) + "\n")
    print(table(n))
    return 0
