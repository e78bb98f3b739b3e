"""The demo's report: what was done, the numbers, the plots, and a reading of them.

The reading is written from the numbers, not in advance: every sentence that says what
moved says by how much, and says so whichever way it went; a difference smaller than the
spread over seeds is called that, not a win.
"""

from __future__ import annotations

from pathlib import Path

from grpo.demo.findings import (
    ARM_LABELS,
    ARM_NAMES,
    NOISE,
    OUTCOME,
    PROCESS,
    at_k,
    findings,
    first_tenth,
    last_tenth,
    mean_of,
    rm_arms,
    rm_label,
    seeds_of,
)


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def _delta(after: float, before: float) -> str:
    d = 100 * (after - before)
    return f"{'+' if d >= 0 else '−'}{abs(d):.1f} points"


def _moved(after: float, before: float, *, small: float = 0.03) -> str:
    d = after - before
    if abs(d) < small:
        return "barely moved"
    return "rose" if d > 0 else "fell"


def _spread(entry: dict, metric: str, k: int) -> str:
    """'41.2% [38.0–44.1%]': the mean over seeds and the lowest and highest seed."""
    mean = _pct(at_k(entry, metric, k))
    span = entry.get(f"{metric}_range", {}).get(str(k))
    if not span or len(entry.get("per_seed", [])) < 2:
        return mean
    return f"{mean} [{100 * span[0]:.1f}–{100 * span[1]:.1f}%]"


def _seeds_above(entry: dict, base: dict, metric: str, k: int) -> tuple[int, int]:
    """(how many seeds ended above the base on metric@k, how many seeds)."""
    seeds = entry.get("per_seed") or [entry]
    return sum(at_k(s, metric, k) > at_k(base, metric, k) for s in seeds), len(seeds)


def _versus(a: dict, b: dict, metric: str, k: int) -> str:
    """How arm a compares with arm b on metric@k, in words that respect the seeds' spread."""
    ma, mb = at_k(a, metric, k), at_k(b, metric, k)
    ra, rb = a.get(f"{metric}_range", {}).get(str(k)), b.get(f"{metric}_range", {}).get(str(k))
    seeds = min(len(a.get("per_seed", [])), len(b.get("per_seed", [])))
    if seeds >= 2 and ra and rb and (ra[0] <= rb[1] and rb[0] <= ra[1]):
        return f"{_pct(ma)} against {_pct(mb)} ({_delta(ma, mb)}), within the spread over seeds (their ranges overlap)"
    word = "above" if ma > mb else "below" if ma < mb else "level with"
    where = "the seeds' ranges do not overlap" if seeds >= 2 else "one seed each"
    return f"{_pct(ma)} against {_pct(mb)} ({_delta(ma, mb)}): {word} it ({where})"


def host_line(host: dict | None) -> str:
    """', CPU-MODEL (avx2, avx512f), 2 CPUs': the machine, whose kind moves times and float results."""
    if not host:
        return ""
    flags = ", ".join(host.get("cpu_flags", [])) or "no AVX2"
    return f", {host.get('cpu_model') or 'a CPU'} ({flags}), {host.get('cpus')} CPUs"


def _gain_against_spread(entry: dict, base: dict, metric: str, k: int) -> str:
    """The mean gain over the base on metric@k against the spread of the seeds (highest minus
    lowest): a gain that the choice of seed alone could move is not called a finding."""
    gain = at_k(entry, metric, k) - at_k(base, metric, k)
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
            add(f"| {name} | " + " | ".join(_pct(at_k(entry, metric, k)) for k in ks) + " |")
        add("")


class _Report:
    """The summary and what every section of the report reads from it, derived once."""

    def __init__(self, s: dict):
        self.s, self.c = s, s["config"]
        self.base, self.grpo, self.ppo = s["base"], s["grpo"], s["ppo"]
        self.ppo_tokens = s.get("ppo_equal_tokens")
        self.ks = [k for k in self.c["ks"] if str(k) in self.base["pass@k"]]
        self.k_max = self.ks[-1]
        self.k_mid = 16 if 16 in self.ks else self.ks[len(self.ks) // 2]
        self.seeds = len(self.grpo.get("per_seed", [self.grpo]))
        self.rms = rm_arms(s)
        self.findings = s.get("findings") or findings(s)


def write_report(path: Path, s: dict) -> None:
    """report.md from summary `s`: its sections (`SECTIONS`) in order."""
    r = _Report(s)
    lines: list[str] = []
    for section in SECTIONS:
        section(lines.append, r)
    Path(path).write_text("\n".join(lines))


def _heading(add, r: _Report) -> None:
    """The title, and what the report is: which run, on which machine, over how many seeds."""
    s, c, seeds = r.s, r.c, r.seeds
    add("# GRPO on a laptop: Maj@K vs Pass@K, and GRPO vs PPO\n")
    add(
        "This report is written by `grpo demo` (`make demo`) from the numbers it measured in "
        f"this run ({s['time_s'] / 60:.1f} minutes on this machine{host_line(s.get('host'))}). Nothing here was downloaded: "
        f"the model was built from a config and trained here. Every RL arm ran {seeds} time(s), "
        f"seeds {c['seed']} to {c['seed'] + seeds - 1}: a number is the mean over seeds, [low–high] the lowest "
        "and highest seed, and the shaded bands of the plots 95% intervals over problems.\n"
    )


def _what_grpo_is(add, r: _Report) -> None:
    """GRPO against PPO, in one paragraph."""
    add("## What GRPO is, in one paragraph\n")
    add(
        "GRPO (Group Relative Policy Optimization, DeepSeekMath) is PPO with three changes. "
        "The value model (critic) goes. The baseline that says whether an answer was better or worse "
        "than expected becomes the average reward of a *group* of G answers sampled for the same "
        "question (divided by their standard deviation). And the KL penalty that keeps the policy "
        "near a frozen reference moves out of the per-token reward into the loss. The reward model "
        "stays. The price is generation: G samples per question instead of one.\n"
    )


def _what_was_done(add, r: _Report) -> None:
    """Each stage of the demo, with its settings."""
    s, c, grpo, ppo_tokens, k_max, rms = r.s, r.c, r.grpo, r.ppo_tokens, r.k_max, r.rms
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
        f"4. **PPO.** The same base and steps, one answer per problem, a value model and "
        "GAE, the KL in the reward; (a) *equal prompts*: the same "
        f"{c['prompts_per_step']} problems per step as GRPO, so {c['group_size']}x fewer generated tokens; "
        f"(b) *equal generated tokens*: {c['prompts_per_step'] * c['group_size']} problems per step, as many "
        "answers as GRPO samples"
        + (
            f", over {len(ppo_tokens.get('per_seed', [ppo_tokens]))} seed(s)"
            if ppo_tokens is not None
            else " (not run here: the costliest arm, it comes with `--full` or `--equal-tokens`)"
        )
        + ". PPO's own settings, tuned on problems outside the evaluation set: "
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
    if rms:
        rm = s["reward_model"]
        add(
            f"6. **Neural reward model.** A reward model (the base with a scalar head) trained on "
            f"{rm['pairs']} comparisons of the base model's own right and wrong answers "
            f"(held-out pairwise accuracy {_pct(rm['held_out_accuracy'])}), then GRPO driven by its "
            f"score alone ({_seed_word(len(seeds_of(s[rms[0][1]])))}; its own lr {c.get('rm_policy_lr', c['lr'])} "
            f"and beta {c.get('rm_policy_beta', c['beta'])}); the true accuracy was logged beside it but not "
            "trained on."
        )
    if PROCESS in s:
        add(
            f"7. **--full** ({_seed_word(len(seeds_of(s[PROCESS])))}, each arm GRPO's steps and samples): process "
            "supervision (the task's per-step verifier as the reward, DeepSeekMath §4.1.3) against outcome "
            "supervision (the GRPO arm's own runs of the same seeds); and iterative RL on the neural reward model "
            "(§4.1.4) with " + ", ".join(rm_label(i, short=True) for i, _ in rms) + ": the steps split evenly between "
            "the iterations; between them the reward model trains on comparisons of the policy's fresh samples "
            f"({c['rm_update_prompts']} problems x {c['rm_update_samples']} samples, at most {c['rm_update_pairs']} "
            "comparisons each, labelled by the task's verifier) with 10% of its history replayed (its own first "
            f"comparisons included), {c['rm_update_epochs']} epoch(s) at lr {c['rm_update_lr']}, and the reference "
            "is reset to the policy."
        )
    add("")


def _result_maj_against_pass(add, r: _Report) -> None:
    """Result 1: pass@k and maj@k of every arm, and whether RL raised maj@k more than pass@k."""
    s, base, grpo, ks, k_max, k_mid, rms = r.s, r.base, r.grpo, r.ks, r.k_max, r.k_mid, r.rms
    add("## Result 1: does RL raise Maj@K more than Pass@K?\n")
    named = [("base (SFT)", base), *((ARM_NAMES[a], s[a]) for a in ARM_NAMES if a in s)]
    named += [(ARM_LABELS[a], s[a]) for a in (PROCESS,) if a in s] + [(rm_label(i), s[key]) for i, key in rms]
    _curve_tables(add, named, ks)
    add("![pass@k and maj@k](pass_maj_at_k.png)\n")

    p1b, p1g = at_k(base, "pass@k", 1), at_k(grpo, "pass@k", 1)
    mb, mg = at_k(base, "maj@k", k_mid), at_k(grpo, "maj@k", k_mid)
    pkb, pkg = at_k(base, "pass@k", k_max), at_k(grpo, "pass@k", k_max)
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
    _by_operand_length(add, r, named, by)


def _by_operand_length(add, r: _Report, named: list[tuple[str, dict]], by: dict) -> None:
    """Result 1 by operand length (pass@1 / maj@k / pass@k_max per digit count), where the base
    was measured on more than one."""
    grpo, k_max, k_mid = r.grpo, r.k_max, r.k_mid
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


def _result_against_ppo(add, r: _Report) -> None:
    """Result 2: GRPO against PPO, what each held and generated and where it ended."""
    s, c, grpo, ppo, ppo_tokens, k_mid = r.s, r.c, r.grpo, r.ppo, r.ppo_tokens, r.k_mid
    budgets = "at equal prompts and at equal generated tokens" if ppo_tokens is not None else "at equal prompts"
    add(f"## Result 2: GRPO against PPO, {budgets}\n")
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


def _result_neural_rm(add, r: _Report) -> None:
    """Result 3: GRPO on a neural reward model's score, and whether it was hacked."""
    s, grpo, k_max, k_mid, rms, f = r.s, r.grpo, r.k_max, r.k_mid, r.rms, r.findings
    if rms:
        add("## Result 3: a neural reward model in place of the rule\n")
        add(
            "GRPO optimised the reward model's score; the true accuracy of the same samples was logged beside it "
            "(weight 0). A score that rises while the true accuracy falls is reward hacking: the policy found what "
            "the reward model likes rather than what is right, the reason DeepSeek-R1 dropped neural reward "
            "models for reasoning in favour of rule rewards.\n"
        )
        _arm_table(add, [(rm_label(i), s[key]) for i, key in rms[:1]], k_mid, k_max, score=True)
        add("![reward model score and true accuracy](neural_rm.png)\n")
        add(
            "**Reading.** "
            + hacking_sentence(rm_label(rms[0][0]), f["hacking"][rms[0][1]])
            + f" Rule-reward GRPO reached pass@1 {_spread(grpo, 'pass@k', 1)}."
            + (" The iterative arms' curves are read in Result 5." if len(rms) > 1 else "")
            + "\n"
        )


def _result_supervision(add, r: _Report) -> None:
    """Result 4: outcome against process supervision (--full)."""
    s, k_max, k_mid, f = r.s, r.k_max, r.k_mid, r.findings
    if "fig5" in f:
        _arm_section(
            add,
            "Result 4: outcome against process supervision (DeepSeekMath Fig. 5)",
            "supervision.png",
            [(ARM_LABELS[OUTCOME], s[OUTCOME]), (ARM_LABELS[PROCESS], s[PROCESS])],
            k_mid,
            k_max,
            "GRPO on the same seeds and budget; outcome supervision rewards the final answer (the GRPO arm's own "
            "runs), process supervision each step, by the task's per-step verifier: each token gets the normalised "
            "rewards of the steps at or after it (§4.1.3)",
            fig5_sentence(f["fig5"]),
        )


def _result_iterative(add, r: _Report) -> None:
    """Result 5: iterative RL on the neural reward model (--full)."""
    s, k_max, k_mid, rms, f = r.s, r.k_max, r.k_mid, r.rms, r.findings
    if "fig6" in f:
        reading = fig6_sentence(f["fig6"])
        if "three_above_two" in f["fig6"]:
            reading += (
                f" A third iteration ended above the second, by a point or more, in {f['fig6']['three_above_two']} of "
                f"{f['fig6']['seeds']}."
            )
        reading += " " + " ".join(hacking_sentence(rm_label(i), f["hacking"][key]) for i, key in rms[1:])
        _arm_section(
            add,
            "Result 5: iterative RL (DeepSeekMath Fig. 6)",
            "iterative.png",
            [(rm_label(i), s[key]) for i, key in rms],
            k_mid,
            k_max,
            "GRPO on the neural reward model's score, the same seeds and steps, split evenly between the "
            "iterations; between them the reward model learns from comparisons of the policy's fresh samples "
            "labelled by the rule, with 10% of its history replayed, and the reference is reset to the policy "
            "(Algorithm 1)",
            reading,
            score=True,
        )


def _not_shown(add, r: _Report) -> None:
    """The runs that failed, by name."""
    s = r.s
    for name, why in (s.get("failed") or {}).items():
        add(
            f"**Not shown: `{name.split('/')[0]}`, whose run `{name}` failed** ({why}); its directory holds what it left.\n"
        )


def _files(add, r: _Report) -> None:
    """The files the demo wrote."""
    s, rms = r.s, r.rms
    add("## Files\n")
    extra = [f"`{name}/seed-N/`" for name in (PROCESS, *(key for _, key in rms)) if name in s]
    add(
        "`summary.json` (every number above, each seed's under `per_seed`, the findings under `findings`), "
        "`base/` (the SFT model), "
        + ", ".join(f"`{arm}/seed-N/`" for arm in ARM_NAMES if arm in s)
        + "".join(", " + name for name in extra)
        + (", `reward_model/` (and its comparisons, `data/rm_pairs.jsonl`)" if rms else "")
        + " (each run's config.yaml, metrics.jsonl, samples.jsonl and final model), `data/`, and the plots.\n"
    )


def _arm_table(add, rows: list[tuple[str, dict]], k_mid: int, k_max: int, *, score: bool = False) -> None:
    """Arms over seeds: means [lowest–highest seed], each seed's pass@1, where the true
    accuracy of the training samples ended, and (`score`) how the reward model's score moved."""
    head = f"| | pass@1 | maj@{k_mid} | pass@{k_max} | pass@1 per seed | true accuracy, first → last tenth |"
    add(head + (" reward model's score, first → last tenth |" if score else ""))
    add("|---|---|---|---|---|---|" + ("---|" if score else ""))
    for name, e in rows:
        seeds = ", ".join(_pct(at_k(one, "pass@k", 1)) for one in seeds_of(e))
        truth = e["true_accuracy"]
        cells = [
            _spread(e, "pass@k", 1),
            _spread(e, "maj@k", k_mid),
            _spread(e, "pass@k", k_max),
            seeds,
            f"{_pct(first_tenth(truth))} → {_pct(last_tenth(truth))}",
        ]
        if score:
            cells.append(f"{first_tenth(e['rm_score']):+.2f} → {last_tenth(e['rm_score']):+.2f}")
        add(f"| {name} | " + " | ".join(cells) + " |")
    add("")


def _arm_section(
    add,
    title: str,
    png: str,
    rows: list[tuple[str, dict]],
    k_mid: int,
    k_max: int,
    how: str,
    reading: str,
    *,
    score: bool = False,
) -> None:
    """A comparison of --full's arms over seeds: how they ran, the table, the plot, the reading."""
    add(f"## {title}\n")
    add(f"{how}.\n")
    _arm_table(add, rows, k_mid, k_max, score=score)
    add(f"![{title}]({png})\n")
    add(f"**Reading.** {reading}\n")


def add_findings(add, s: dict) -> None:
    """DeepSeekMath's --full findings in one place near the top: reproduced or not (the
    sections below give the numbers), and the reward hacking that DeepSeek-R1 acted on."""
    f = s.get("findings") or findings(s)
    lines = []
    if "fig5" in f:
        lines.append(
            "Fig. 5, process supervision at least level with outcome supervision: "
            + ("reproduced" if f["fig5"]["reproduced"] else "not reproduced")
            + " (Result 4)."
        )
    if "fig6" in f:
        lines.append(
            "Fig. 6, a second iteration of iterative RL above the first: "
            + ("reproduced" if f["fig6"]["reproduced"] else "not reproduced")
            + f" ({f['fig6']['above']} of {_seed_word(f['fig6']['seeds'])}; Result 5)."
        )
    for i, key in rm_arms(s):
        runs = f["hacking"][key]
        hacked = sum(any(it["hacked"] for it in r["iterations"]) for r in runs)
        lines.append(
            f"Reward hacking, {rm_label(i)}: the score rose while the true accuracy fell in {hacked} of "
            f"{_seed_word(len(runs))} (Result 3)."
        )
    if lines:
        add("## Findings, as measured\n")
        add("\n".join(f"- {line}" for line in lines) + "\n")


def _seed_word(n: int) -> str:
    return f"{n} seed" + ("s" if n != 1 else "")


def fig5_sentence(f: dict) -> str:
    """Reproduced or not, and each metric's verdict with its numbers."""
    words = {"above": "above", "level": "level with", "below": "below"}
    parts = []
    for metric in ("pass@1", f"maj@{f['k']}"):
        m = f[metric]
        why = "the seeds' ranges overlap" if m["verdict"] == "level" else "the seeds' ranges apart"
        if f["seeds"] == 1:
            why = "one seed"
        parts.append(
            f"{words[m['verdict']]} it on {metric} ({_pct(m['process'])} against {_pct(m['outcome'])}, "
            f"{_delta(m['process'], m['outcome'])}; {why})"
        )
    head = "**Reproduced**" if f["reproduced"] else "**Not reproduced**"
    text = (
        f"{head} (DeepSeekMath Fig. 5: process supervision at least level with outcome supervision): over "
        f"{_seed_word(f['seeds'])}, process supervision is " + " and ".join(parts) + "."
    )
    if not f["reproduced"]:
        acc = f["true_accuracy"]
        text += (
            f" The true accuracy of its training samples ended at {_pct(acc['process'])} against outcome "
            f"supervision's {_pct(acc['outcome'])}"
        )
        length = f.get("process_length")
        if length:
            text += f"; its completions went from {length[0]:.1f} to {length[1]:.1f} tokens"
        none = f.get("no_answer") or {}
        if none.get("process") is not None and none.get("outcome") is not None:
            text += (
                f"; {_pct(none['process'])} of its evaluation samples gave no final answer (outcome supervision's: "
                f"{_pct(none['outcome'])})"
                + (": it learned to stop before answering" if none["process"] > 0.5 > none["outcome"] else "")
            )
        text += "."
    return text


def fig6_sentence(f: dict, labels: tuple[str, str] = ("one iteration", "two iterations")) -> str:
    """Reproduced or not (the seeds counted), and for each seed that missed, why: what the
    reward model's score and the true accuracy did in the second iteration, and the update."""
    n, above = f["seeds"], f["above"]
    head = "**Reproduced**" if f["reproduced"] else "**Not reproduced**"
    seeds = "; ".join(f"seed {p['seed']}: {_pct(p['two'])} against {_pct(p['one'])}" for p in f["per_seed"])
    text = (
        f"{head} (DeepSeekMath Fig. 6: a second iteration above the first): the true accuracy of the training "
        f"samples ended higher, by {100 * NOISE:.0f} point or more, with {labels[1]} than with {labels[0]} in "
        f"{above} of {_seed_word(n)} ({seeds}); pass@1 on the held-out problems was higher in {f['pass@1_above']} "
        f"of {n}."
    )
    missed = [p for p in f["per_seed"] if p["two"] < p["one"] + NOISE]
    reasons = []
    for p in missed:
        second, update = p["second_iteration"], p["update"]
        if second is None:
            continue
        state = (
            "hacked again after the update"
            if second["hacked"]
            else "the score and the truth moved together"
            if second["score"] > 0 and second["true_accuracy"] > -NOISE
            else "the updated reward model's score did not rise: a weak signal"
        )
        reason = (
            f"seed {p['seed']}: in the second iteration the reward model's score moved {second['score']:+.2f} while "
            f"the true accuracy moved {_delta(second['true_accuracy'], 0)} ({state})"
        )
        if update is not None:
            accuracy = update.get("accuracy_on_new")
            reason += (
                f"; its update learned from {update['new_pairs']} new comparisons and {update['replayed']} replayed"
                + (f", and ranked {_pct(accuracy)} of the new ones right after it" if accuracy is not None else "")
            )
        reasons.append(reason)
    if reasons:
        text += " Why not: " + "; ".join(reasons) + "."
    below = [p for p in f["per_seed"] if p["two"] < p["start"] - NOISE]
    if below:
        text += (
            f" In {len(below)} of {_seed_word(n)} the run with {labels[1]} still ended below where training began ("
            + "; ".join(f"seed {p['seed']}: {_pct(p['start'])} → {_pct(p['two'])}" for p in below)
            + "): the reward model was hacked"
            + (" less, not overcome." if all(p["two"] >= p["one"] + NOISE for p in below) else ".")
        )
    return text


def hacking_sentence(label: str, runs: list[dict]) -> str:
    """How many seeds of an arm on the reward model were hacked, in which iterations."""
    hacked = [r for r in runs if any(it["hacked"] for it in r["iterations"])]
    total = [r["iterations"][-1] for r in runs]
    score = mean_of([t["score"] for t in total])
    truth = mean_of([t["true_accuracy"] for t in total])
    where = "".join(
        f"; seed {r['seed']} in iteration(s) "
        + ", ".join(str(i + 1) for i, it in enumerate(r["iterations"]) if it["hacked"])
        for r in hacked
        if len(r["iterations"]) > 1
    )
    return (
        f"{label}: hacked in {len(hacked)} of {_seed_word(len(runs))} (its score rose while the true accuracy fell"
        f"{where}); over its last iteration the score moved {score:+.2f} and the true accuracy "
        f"{_delta(truth, 0)} (means over seeds)."
    )


def _findings(add, r: _Report) -> None:
    """The --full findings, reproduced or not (`add_findings`)."""
    add_findings(add, r.s)


SECTIONS = (
    _heading,
    _what_grpo_is,
    _what_was_done,
    _findings,
    _result_maj_against_pass,
    _result_against_ppo,
    _result_neural_rm,
    _result_supervision,
    _result_iterative,
    _not_shown,
    _files,
)
