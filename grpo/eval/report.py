"""The demo's report: what was done, the numbers, the plots, and a reading of them.

The reading is written from the numbers, not in advance: every sentence that says what
moved says by how much, and says so whichever way it went.
"""

from __future__ import annotations

from pathlib import Path


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def _delta(after: float, before: float) -> str:
    d = 100 * (after - before)
    return f"{'+' if d >= 0 else '−'}{abs(d):.1f} points"


def _k(entry: dict, metric: str, k: int) -> float | None:
    return entry[metric].get(str(k))


def _moved(after: float, before: float, *, small: float = 0.03) -> str:
    d = after - before
    if abs(d) < small:
        return "barely moved"
    return "rose" if d > 0 else "fell"


def write_report(path: Path, s: dict) -> None:
    c = s["config"]
    base, grpo, ppo = s["base"], s["grpo"], s["ppo"]
    ks = [k for k in c["ks"] if str(k) in base["pass@k"]]
    k_max = ks[-1]
    k_mid = 16 if 16 in ks else ks[len(ks) // 2]
    lines: list[str] = []
    add = lines.append

    add("# GRPO on a laptop: Maj@K vs Pass@K, and GRPO vs PPO\n")
    add("This report is written by `grpo demo` (`make demo`) from the numbers it measured in "
        f"this run ({s['time_s'] / 60:.1f} minutes on this machine). Nothing here was downloaded: "
        "the model was built from a config and trained here.\n")

    add("## What GRPO is, in one paragraph\n")
    add("GRPO (Group Relative Policy Optimization, DeepSeekMath) is PPO with three changes. "
        "The value model (critic) goes. The baseline that says whether an answer was better or worse "
        "than expected becomes the average reward of a *group* of G answers sampled for the same "
        "question (divided by their standard deviation). And the KL penalty that keeps the policy "
        "near a frozen reference moves out of the per-token reward into the loss. The reward model "
        "stays. The price is generation: G samples per question instead of one.\n")

    add("## What was done\n")
    add(f"1. **Base model.** A Llama-style model with {s['sft']['parameters']:,} parameters was built "
        f"from a config and trained for {s['sft']['steps']} steps of supervised learning on two-digit "
        "addition written out digit by digit (for 47+85: `7+5+0=12;4+8+1=13>132`), and stopped early, "
        "so that it solves some problems sometimes: RL can only sharpen what a model already does "
        "now and then (a group whose answers all get the same reward has zero advantage).")
    add(f"2. **Evaluation.** For each of {c['eval_prompts']} held-out problems, {c['n']} answers were "
        f"sampled at temperature {c['eval_temperature']}. *pass@k* is the chance that at least one of k "
        "answers is right (the unbiased estimator of Chen et al.); *maj@k* is the chance that the "
        "majority vote of k answers is right (exact expectation over all ways to pick k of the "
        f"{c['n']}). 95% intervals are over problems.")
    add(f"3. **GRPO.** {grpo['steps']} steps, each {c['prompts_per_step']} problems x G = "
        f"{c['group_size']} answers, reward 1 for a right final answer and 0 otherwise, "
        f"lr {c['lr']}, beta {c['beta']}.")
    add(f"4. **PPO.** The same base, the same {ppo['prompts']} problems in the same steps, one answer "
        "per problem, a value model (same architecture, scalar head) and GAE; the KL in the reward. "
        "Each training ran in its own process, so its peak memory is its own.")
    if "grpo-rm" in s:
        rm = s["grpo-rm"]["reward_model"]
        add(f"5. **Neural reward model.** A reward model (the base with a scalar head) trained on "
            f"{rm['pairs']} comparisons of the base model's own right and wrong answers "
            f"(held-out pairwise accuracy {_pct(rm['held_out_accuracy'])}), then GRPO driven by its "
            "score alone; the true accuracy was logged beside it but not trained on.")
    add("")

    add("## Result 1: RL raised Maj@K more than Pass@K\n")
    add("| | " + " | ".join(f"pass@{k}" for k in ks) + " |")
    add("|---|" + "---|" * len(ks))
    for name, entry in (("base (SFT)", base), ("GRPO", grpo), ("PPO", ppo)) + ((("GRPO, neural RM", s["grpo-rm"]),) if "grpo-rm" in s else ()):
        add(f"| {name} | " + " | ".join(_pct(_k(entry, "pass@k", k)) for k in ks) + " |")
    add("")
    add("| | " + " | ".join(f"maj@{k}" for k in ks) + " |")
    add("|---|" + "---|" * len(ks))
    for name, entry in (("base (SFT)", base), ("GRPO", grpo), ("PPO", ppo)) + ((("GRPO, neural RM", s["grpo-rm"]),) if "grpo-rm" in s else ()):
        add(f"| {name} | " + " | ".join(_pct(_k(entry, "maj@k", k)) for k in ks) + " |")
    add("")
    add("![pass@k and maj@k](pass_maj_at_k.png)\n")

    p1b, p1g = _k(base, "pass@k", 1), _k(grpo, "pass@k", 1)
    mb, mg = _k(base, "maj@k", k_mid), _k(grpo, "maj@k", k_mid)
    pkb, pkg = _k(base, "pass@k", k_max), _k(grpo, "pass@k", k_max)
    add("**Reading.** "
        f"GRPO moved pass@1 from {_pct(p1b)} to {_pct(p1g)} ({_delta(p1g, p1b)}) and maj@{k_mid} from "
        f"{_pct(mb)} to {_pct(mg)} ({_delta(mg, mb)}). pass@{k_max} {_moved(pkg, pkb)}: {_pct(pkb)} → "
        f"{_pct(pkg)} ({_delta(pkg, pkb)}). "
        + ("This is DeepSeekMath's finding: the answers the base could produce with many tries are "
           "the ones the trained model now produces on the first try; RL made the right answer the "
           "likely one (higher pass@1 and majority vote) rather than reaching problems the base could "
           "never solve (pass@k at large k)."
           if (p1g - p1b) > abs(pkg - pkb) else
           "Here pass@k at large k moved as much as pass@1, which is not the pattern DeepSeekMath "
           "reports; with a base this small, sampling at this temperature, the model may still be "
           "learning the task itself.")
        + "\n")

    add("## Result 2: GRPO trades memory for generation\n")
    add("| | models held | parameters held | peak memory (MB) | generated tokens | time (s) | time per step (s) |")
    add("|---|---|---|---|---|---|---|")
    for name, e in (("GRPO", grpo), ("PPO", ppo)):
        add(f"| {name} | {e['models']} | {e['parameters']:,} | {e['peak_memory_mb']:.0f} | "
            f"{e['generated_tokens']:,} | {e['time_s']:.0f} | {e['time_per_step_s']:.2f} |")
    add("")
    add("![reward during training](rewards.png)\n")
    mem = ppo["peak_memory_mb"] - grpo["peak_memory_mb"]
    gen = grpo["generated_tokens"] / max(ppo["generated_tokens"], 1)
    add("**Reading.** "
        f"PPO held {ppo['models']} models (policy, reference, reward, value) to GRPO's {grpo['models']}, "
        f"{ppo['parameters'] - grpo['parameters']:,} more parameters, and its peak memory was "
        f"{abs(mem):.0f} MB {'higher' if mem > 0 else 'lower'}. "
        f"GRPO generated {gen:.1f}x as many tokens for the same problems: its G answers per problem "
        "are its baseline. At this size the process's fixed cost (Python, PyTorch) dominates memory; "
        "at 7B parameters the value model and its optimizer state are tens of GB. "
        f"After training, PPO's pass@1 is {_pct(_k(ppo, 'pass@k', 1))} against GRPO's {_pct(p1g)}.\n")

    if "grpo-rm" in s:
        r = s["grpo-rm"]
        add("## Result 3: a neural reward model in place of the rule\n")
        add("![reward model score and true accuracy](neural_rm.png)\n")
        first, last = r["rm_score"][:5], r["rm_score"][-5:]
        tf, tl = r["true_accuracy"][:5], r["true_accuracy"][-5:]
        d_score = sum(last) / len(last) - sum(first) / len(first)
        d_true = sum(tl) / len(tl) - sum(tf) / len(tf)
        add("**Reading.** "
            f"Over training the reward model's score changed by {d_score:+.2f} (its own units) and the "
            f"true accuracy of the sampled answers by {_delta(sum(tl) / len(tl), sum(tf) / len(tf))}. "
            + ("Both rose together: the reward model was not hacked in this run."
               if d_score > 0 and d_true > 0 else
               "The score rose while the true accuracy did not: the policy found what the reward model "
               "likes rather than what is right — reward hacking, the reason DeepSeek-R1 preferred rule "
               "rewards." if d_score > 0 else
               "The reward model's score did not rise: it gave GRPO too weak a signal in this budget.")
            + f" After training, pass@1 is {_pct(_k(r, 'pass@k', 1))} (rule-reward GRPO: {_pct(p1g)}).\n")

    add("## Files\n")
    add("`summary.json` (every number above), `base/` (the SFT model), `grpo/`, `ppo/`"
        + (", `grpo-rm/`, `reward_model/`" if "grpo-rm" in s else "")
        + " (each run's config.yaml, metrics.jsonl, samples.jsonl and final model), "
        "`pass_maj_at_k.png`, `rewards.png`" + (", `neural_rm.png`" if "grpo-rm" in s else "") + ".\n")
    Path(path).write_text("\n".join(lines))
