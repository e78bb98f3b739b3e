"""The demo's report: what was done, the numbers, the plots, and a reading of them.

The reading is written from the numbers, not in advance: every sentence that says what
moved says by how much, and says so whichever way it went; a difference smaller than the
spread over seeds is called that, not a win.
"""

from __future__ import annotations

from pathlib import Path

ARM_NAMES = {"grpo": "GRPO", "ppo": "PPO, equal prompts", "ppo_equal_tokens": "PPO, equal generated tokens"}


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


def _spread(entry: dict, metric: str, k: int) -> str:
    """'41.2% [38.0–44.1%]': the mean over seeds and the lowest and highest seed."""
    mean = _pct(_k(entry, metric, k))
    span = entry.get(f"{metric}_range", {}).get(str(k))
    if not span or len(entry.get("per_seed", [])) < 2:
        return mean
    return f"{mean} [{100 * span[0]:.1f}–{100 * span[1]:.1f}%]"


def _seeds_above(entry: dict, base: dict, metric: str, k: int) -> tuple[int, int]:
    """(how many seeds ended above the base on metric@k, how many seeds)."""
    seeds = entry.get("per_seed") or [entry]
    return sum(_k(s, metric, k) > _k(base, metric, k) for s in seeds), len(seeds)


def _versus(a: dict, b: dict, metric: str, k: int) -> str:
    """How arm a compares with arm b on metric@k, in words that respect the seeds' spread."""
    ma, mb = _k(a, metric, k), _k(b, metric, k)
    ra, rb = a.get(f"{metric}_range", {}).get(str(k)), b.get(f"{metric}_range", {}).get(str(k))
    seeds = min(len(a.get("per_seed", [])), len(b.get("per_seed", [])))
    if seeds >= 2 and ra and rb and (ra[0] <= rb[1] and rb[0] <= ra[1]):
        return f"{_pct(ma)} against {_pct(mb)} ({_delta(ma, mb)}), within the spread over seeds (their ranges overlap)"
    word = "above" if ma > mb else "below" if ma < mb else "level with"
    where = "the seeds' ranges do not overlap" if seeds >= 2 else "one seed each"
    return f"{_pct(ma)} against {_pct(mb)} ({_delta(ma, mb)}): {word} it ({where})"


def _host(host: dict | None) -> str:
    """', an AMD EPYC (avx2, avx512f), 2 CPUs': the machine, whose kind moves times and float results."""
    if not host:
        return ""
    flags = ", ".join(host.get("cpu_flags", [])) or "no AVX2"
    return f", {host.get('cpu_model') or 'a CPU'} ({flags}), {host.get('cpus')} CPUs"


def _gain_against_spread(entry: dict, base: dict, metric: str, k: int) -> str:
    """The mean gain over the base on metric@k against the spread of the seeds (highest minus
    lowest): a gain that the choice of seed alone could move is not called a finding."""
    gain = _k(entry, metric, k) - _k(base, metric, k)
    span = entry.get(f"{metric}_range", {}).get(str(k))
    name = metric.replace("k", str(k))
    if not span or len(entry.get("per_seed", [])) < 2:
        return f"One seed: the spread over seeds of the {name} gain is not measured here."
    spread = span[1] - span[0]
    if gain > 0 and gain > spread:
        times = f"{gain / spread:.1f} times" if spread > 0 else "far above"
        return (
            f"The mean {name} gain ({_delta(gain, 0)}) is {times} the spread of the seeds "
            f"({100 * spread:.1f} points from the lowest to the highest): larger than what the choice of seed moves."
        )
    return (
        f"The mean {name} gain ({_delta(gain, 0)}) is not larger than the spread of the seeds "
        f"({100 * spread:.1f} points from the lowest to the highest): within what the choice of seed moves."
    )


def _curve_tables(add, rows: list[tuple[str, dict]], ks: list[int]) -> None:
    for metric in ("pass@k", "maj@k"):
        add("| | " + " | ".join(metric.replace("k", str(k)) for k in ks) + " |")
        add("|---|" + "---|" * len(ks))
        for name, entry in rows:
            add(f"| {name} | " + " | ".join(_pct(_k(entry, metric, k)) for k in ks) + " |")
        add("")


def write_report(path: Path, s: dict) -> None:
    c = s["config"]
    base, grpo, ppo = s["base"], s["grpo"], s["ppo"]
    ppo_tokens = s.get("ppo_equal_tokens")
    ks = [k for k in c["ks"] if str(k) in base["pass@k"]]
    k_max = ks[-1]
    k_mid = 16 if 16 in ks else ks[len(ks) // 2]
    seeds = len(grpo.get("per_seed", [grpo]))
    lines: list[str] = []
    add = lines.append

    add("# GRPO on a laptop: Maj@K vs Pass@K, and GRPO vs PPO on two budgets\n")
    add(
        "This report is written by `grpo demo` (`make demo`) from the numbers it measured in "
        f"this run ({s['time_s'] / 60:.1f} minutes on this machine{_host(s.get('host'))}). Nothing here was downloaded: "
        f"the model was built from a config and trained here. Every RL arm ran {seeds} time(s), "
        f"seeds {c['seed']} to {c['seed'] + seeds - 1}: a number is the mean over seeds, [low–high] the lowest "
        "and highest seed, and the shaded bands of the plots 95% intervals over problems.\n"
    )

    add("## What GRPO is, in one paragraph\n")
    add(
        "GRPO (Group Relative Policy Optimization, DeepSeekMath) is PPO with three changes. "
        "The value model (critic) goes. The baseline that says whether an answer was better or worse "
        "than expected becomes the average reward of a *group* of G answers sampled for the same "
        "question (divided by their standard deviation). And the KL penalty that keeps the policy "
        "near a frozen reference moves out of the per-token reward into the loss. The reward model "
        "stays. The price is generation: G samples per question instead of one.\n"
    )

    digits = c.get("digits", [2])
    lengths = " and ".join(f"{d}-digit" for d in digits)
    add("## What was done\n")
    add(
        f"1. **Base model.** A Llama-style model with {s['sft']['parameters']:,} parameters was built "
        f"from a config and trained for {s['sft']['steps']} steps of supervised learning on {lengths} "
        "addition (an even mix) written out digit by digit (for 47+85: `7+5+0=12;4+8+1=13>132`), and "
        "stopped early, so that it solves some problems sometimes: RL can only sharpen what a model "
        "already does now and then (a group whose answers all get the same reward has zero advantage)."
    )
    add(
        f"2. **Evaluation.** For each of {c['eval_prompts']} held-out problems ({lengths}, an even mix: "
        f"chosen so that the base's pass@{k_max} has room below 100%; the reading says whether it had), "
        f"{c['n']} answers were sampled at temperature {c['eval_temperature']}. *pass@k* is the chance that "
        "at least one of k answers is right (the unbiased estimator of Chen et al.); *maj@k* is the chance "
        "that the majority vote of k answers is right (exact expectation over all ways to pick k of the "
        f"{c['n']})."
    )
    add(
        f"3. **GRPO.** {grpo['steps']} steps, each {c['prompts_per_step']} problems x G = "
        f"{c['group_size']} answers sampled at temperature {c.get('temperature', 1.0)}, reward 1 for a right "
        f"final answer and 0 otherwise, lr {c['lr']}, beta {c['beta']}, {c.get('minibatches', 1)} optimizer "
        "step(s) per step, each on a part of its answers."
    )
    add(
        f"4. **PPO, two budgets.** The same base and steps, one answer per problem, a value model and "
        "GAE, the KL in the reward; (a) *equal prompts*: the same "
        f"{c['prompts_per_step']} problems per step as GRPO, so {c['group_size']}x fewer generated tokens; "
        f"(b) *equal generated tokens*: {c['prompts_per_step'] * c['group_size']} problems per step, as many "
        "answers as GRPO samples. PPO's own settings, tuned on problems outside the evaluation set: "
        f"policy lr {c['ppo_lr']}, critic lr {c['ppo_value_lr']}, GAE lambda {c['ppo_lam']} (gamma 1), "
        f"{c['ppo_epochs']} epoch(s) over each batch in {c.get('ppo_minibatches', 1)} minibatches, the critic's "
        "backbone warm-started from the base (its scalar head new). What was tried to choose them, and what "
        'each setting measured, is recorded in the project\'s benchmarks/README.md ("grpo demo").'
    )
    parallel = c.get("parallel", 1)
    add(
        "5. Each training ran in its own process, so its peak memory is its own"
        + (
            f" ({parallel} at a time, one thread each: the times compare the runs with one another, not with a "
            "run alone)."
            if parallel > 1
            else "."
        )
    )
    if "grpo-rm" in s:
        rm = s["grpo-rm"]["reward_model"]
        add(
            f"6. **Neural reward model.** A reward model (the base with a scalar head) trained on "
            f"{rm['pairs']} comparisons of the base model's own right and wrong answers "
            f"(held-out pairwise accuracy {_pct(rm['held_out_accuracy'])}), then GRPO driven by its "
            "score alone (one seed); the true accuracy was logged beside it but not trained on."
        )
    add("")

    add("## Result 1: does RL raise Maj@K more than Pass@K?\n")
    named = [("base (SFT)", base), *((ARM_NAMES[a], s[a]) for a in ARM_NAMES if a in s)]
    if "grpo-rm" in s:
        named.append(("GRPO, neural RM", s["grpo-rm"]))
    _curve_tables(add, named, ks)
    add("![pass@k and maj@k](pass_maj_at_k.png)\n")

    p1b, p1g = _k(base, "pass@k", 1), _k(grpo, "pass@k", 1)
    mb, mg = _k(base, "maj@k", k_mid), _k(grpo, "maj@k", k_mid)
    pkb, pkg = _k(base, "pass@k", k_max), _k(grpo, "pass@k", k_max)
    by = base.get("by_digits", {})
    ceiling = (
        f"The base solved {_pct(pkb)} of the problems within {k_max} samples"
        + (
            " (" + ", ".join(f"{d}-digit: {_pct(v['pass@k'].get(str(k_max)))}" for d, v in by.items()) + ")"
            if len(by) > 1
            else ""
        )
        + (
            f": pass@{k_max} had room to rise. "
            if pkb < 0.95
            else f": at or near the ceiling, so whether RL moves pass@{k_max} cannot be read here. "
        )
    )
    up1, n1 = _seeds_above(grpo, base, "pass@k", 1)
    upm, nm = _seeds_above(grpo, base, "maj@k", k_mid)
    if (p1g - p1b) > 0 and (pkg - pkb) < (p1g - p1b):
        verdict = (
            "This is DeepSeekMath's finding: the answers the base could produce with many tries became "
            "the ones the trained model produces first; RL made the right answer the likely one (pass@1 "
            f"and the majority vote) rather than reaching problems the base never solved (pass@{k_max})."
        )
        if pkb - pkg >= 0.03:
            verdict += (
                f" pass@{k_max} even fell: the trained model's answers are less varied, so within {k_max} "
                "tries it reaches fewer of the problems the base reached now and then."
            )
    elif p1g - p1b <= 0:
        verdict = "GRPO did not raise pass@1 in this run, so the comparison DeepSeekMath draws cannot be made here."
    else:
        verdict = (
            f"Here pass@{k_max} rose as much as pass@1, which is not the pattern DeepSeekMath reports; "
            "with a base this small the model may still be learning the task itself."
        )
    add(
        "**Reading.** "
        + ceiling
        + f"GRPO moved pass@1 from {_pct(p1b)} to {_spread(grpo, 'pass@k', 1)} ({_delta(p1g, p1b)}; "
        f"{up1} of {n1} seeds above the base) and maj@{k_mid} from {_pct(mb)} to {_spread(grpo, 'maj@k', k_mid)} "
        f"({_delta(mg, mb)}; {upm} of {nm} seeds above the base). pass@{k_max} {_moved(pkg, pkb)}: {_pct(pkb)} → "
        f"{_spread(grpo, 'pass@k', k_max)} ({_delta(pkg, pkb)}). "
        + _gain_against_spread(grpo, base, "maj@k", k_mid)
        + " "
        + verdict
        + "\n"
    )
    if len(by) > 1 and "by_digits" in grpo:
        add("By operand length (pass@1 / maj@" + str(k_mid) + " / pass@" + str(k_max) + "):\n")
        add("| | " + " | ".join(f"{d}-digit" for d in by) + " |")
        add("|---|" + "---|" * len(by))
        for name, entry in named:
            if "by_digits" not in entry:
                continue
            cells = [
                " / ".join(
                    _pct(entry["by_digits"][d][m].get(str(k)))
                    for m, k in (("pass@k", 1), ("maj@k", k_mid), ("pass@k", k_max))
                )
                for d in by
            ]
            add(f"| {name} | " + " | ".join(cells) + " |")
        add("")

    add("## Result 2: GRPO against PPO, at equal prompts and at equal generated tokens\n")
    add(
        f"| | models held | parameters held | peak memory (MB) | generated tokens | prompts | time (s) | pass@1 | maj@{k_mid} |"
    )
    add("|---|---|---|---|---|---|---|---|---|")
    for arm in ARM_NAMES:
        if arm in s:
            e = s[arm]
            add(
                f"| {ARM_NAMES[arm]} | {e['models']} | {e['parameters']:,} | {e['peak_memory_mb']:.0f} | "
                f"{e['generated_tokens']:,.0f} | {e['prompts']:,} | {e['time_s']:.0f} | {_spread(e, 'pass@k', 1)} | "
                f"{_spread(e, 'maj@k', k_mid)} |"
            )
    add("")
    add("![reward during training](rewards.png)\n")
    mem = ppo["peak_memory_mb"] - grpo["peak_memory_mb"]
    gen = grpo["generated_tokens"] / max(ppo["generated_tokens"], 1)
    text = (
        "**Reading.** "
        f"PPO held {ppo['models']} models (policy, reference, reward, value) to GRPO's {grpo['models']}, "
        f"{ppo['parameters'] - grpo['parameters']:,} more parameters, and its peak memory was "
        f"{abs(mem):.0f} MB {'higher' if mem > 0 else 'lower'} at equal prompts"
        + (
            ""
            if mem > 0
            else f" (GRPO's step holds {c['group_size']}x the answers, their activations and the "
            "sampler's cache, which outweighs a fourth model of this size)"
        )
        + ". At this size the process's fixed cost (Python, PyTorch) dominates memory; at 7B parameters the "
        f"value model and its optimizer state are tens of GB. At equal prompts GRPO generated {gen:.1f}x PPO's tokens and reached pass@1 "
        f"{_versus(grpo, ppo, 'pass@k', 1)}; maj@{k_mid} {_versus(grpo, ppo, 'maj@k', k_mid)}."
    )
    if ppo_tokens is not None:
        ratio = ppo_tokens["generated_tokens"] / max(grpo["generated_tokens"], 1)
        text += (
            f" At equal generated tokens (PPO's {ratio:.2f}x GRPO's, over {ppo_tokens['prompts']:,} prompts "
            f"against {grpo['prompts']:,}) GRPO's pass@1 is {_versus(grpo, ppo_tokens, 'pass@k', 1)}; "
            f"maj@{k_mid} {_versus(grpo, ppo_tokens, 'maj@k', k_mid)}; PPO took "
            f"{ppo_tokens['time_s']:.0f} s to GRPO's {grpo['time_s']:.0f} s."
        )
    add(text + "\n")

    if "grpo-rm" in s:
        r = s["grpo-rm"]
        add("## Result 3: a neural reward model in place of the rule\n")
        add("![reward model score and true accuracy](neural_rm.png)\n")
        first, last = r["rm_score"][:5], r["rm_score"][-5:]
        tf, tl = r["true_accuracy"][:5], r["true_accuracy"][-5:]
        d_score = sum(last) / len(last) - sum(first) / len(first)
        d_true = sum(tl) / len(tl) - sum(tf) / len(tf)
        add(
            "**Reading.** "
            f"Over training the reward model's score changed by {d_score:+.2f} (its own units) and the "
            f"true accuracy of the sampled answers by {_delta(sum(tl) / len(tl), sum(tf) / len(tf))}. "
            + (
                "Both rose together: the reward model was not hacked in this run."
                if d_score > 0 and d_true > 0
                else "The score rose while the true accuracy did not: the policy found what the reward model "
                "likes rather than what is right — reward hacking, the reason DeepSeek-R1 preferred rule "
                "rewards."
                if d_score > 0
                else "The reward model's score did not rise: it gave GRPO too weak a signal in this budget."
            )
            + f" After training, pass@1 is {_pct(_k(r, 'pass@k', 1))} (rule-reward GRPO: {_pct(p1g)}).\n"
        )

    if "grpo-process" in s:
        outcome = grpo["per_seed"][0] if grpo.get("per_seed") else grpo
        _pair_section(
            add,
            "Result 4: outcome against process supervision (DeepSeekMath Fig. 5)",
            "supervision.png",
            [
                ("outcome (reward: the final answer)", outcome),
                ("process (reward: each step, by the task's verifier)", s["grpo-process"]),
            ],
            k_mid,
            k_max,
            f"GRPO, seed {c['seed']}, the same budget; process supervision gives each "
            "token the normalised rewards of the steps at or after it (§4.1.3)",
        )
    if "grpo-rm-iterative" in s and "grpo-rm" in s:
        _pair_section(
            add,
            "Result 5: iterative RL, one against two iterations (DeepSeekMath Fig. 6)",
            "iterative.png",
            [
                ("one iteration (the reward model fixed)", s["grpo-rm"]),
                ("two iterations (the reward model retrained between them)", s["grpo-rm-iterative"]),
            ],
            k_mid,
            k_max,
            "GRPO on the neural reward model's score, seed "
            f"{c['seed']}, the same steps; between the iterations the reward model learns from "
            "comparisons of the policy's fresh samples labelled by the rule, and the reference is reset "
            "to the policy (Algorithm 1)",
        )

    for name, why in (s.get("failed") or {}).items():
        add(f"**Not shown: the run `{name}` failed** ({why}); its directory holds what it left.\n")

    add("## Files\n")
    singles = [f"`{name}/`" for name in ("grpo-rm", "grpo-process", "grpo-rm-iterative") if name in s]
    add(
        "`summary.json` (every number above, each seed's under `per_seed`), `base/` (the SFT model), "
        + ", ".join(f"`{arm}/seed-N/`" for arm in ARM_NAMES if arm in s)
        + "".join(", " + name for name in singles)
        + (", `reward_model/`" if "grpo-rm" in s else "")
        + " (each run's config.yaml, metrics.jsonl, samples.jsonl and final model), `data/`, and the plots.\n"
    )
    Path(path).write_text("\n".join(lines))


def _pair_section(add, title: str, png: str, pair: list[tuple[str, dict]], k_mid: int, k_max: int, how: str) -> None:
    """A two-arm comparison with its table, plot and reading (--full's figures)."""
    add(f"## {title}\n")
    add(f"{how}.\n")
    add(f"| | pass@1 | maj@{k_mid} | pass@{k_max} | true accuracy, last 5 steps |")
    add("|---|---|---|---|---|")
    finals = []
    for name, e in pair:
        tail = e["true_accuracy"][-5:]
        finals.append(sum(tail) / len(tail))
        add(
            f"| {name} | {_pct(_k(e, 'pass@k', 1))} | {_pct(_k(e, 'maj@k', k_mid))} | "
            f"{_pct(_k(e, 'pass@k', k_max))} | {_pct(finals[-1])} |"
        )
    add("")
    add(f"![{title}]({png})\n")
    (a_name, a), (b_name, b) = pair
    d1 = _k(b, "pass@k", 1) - _k(a, "pass@k", 1)
    add(
        "**Reading.** "
        f"Against {a_name.split(' (')[0]}, {b_name.split(' (')[0]} moved pass@1 by {_delta(_k(b, 'pass@k', 1), _k(a, 'pass@k', 1))} "
        f"and maj@{k_mid} by {_delta(_k(b, 'maj@k', k_mid), _k(a, 'maj@k', k_mid))}; the true accuracy of the "
        f"training samples ended {_delta(finals[1], finals[0])} apart. "
        + (
            "One seed each: a difference this small is within what seeds alone move (Result 1's spread)."
            if abs(d1) < 0.05
            else "One seed each: read it as a direction, not a measured effect size."
        )
        + "\n"
    )
