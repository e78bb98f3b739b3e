"""The demo's findings, from summary.json's numbers: which arms ran, where each curve ended,
and whether DeepSeekMath's figures were reproduced (the report words them, `grpo.demo.report`)."""

from __future__ import annotations

ARM_NAMES = {"grpo": "GRPO", "ppo": "PPO, equal prompts", "ppo_equal_tokens": "PPO, equal generated tokens"}
# --full's arms beside them (summary.json's keys): outcome supervision is the GRPO arm's own
# runs of --full's seeds; GRPO on the neural reward model is one arm per iteration count.
OUTCOME, PROCESS = "grpo-outcome", "grpo-process"
ARM_LABELS = {**ARM_NAMES, OUTCOME: "GRPO, outcome supervision", PROCESS: "GRPO, process supervision"}
# A true accuracy (of a tenth of a run's samples) that moved less than this is not said to
# have fallen or risen, nor one run's to be above another's: about the sampling noise of
# that many samples at the demo's size (20 steps x 256 samples: a standard error of 0.5 to
# 0.6 points at 10-20% accuracy).
NOISE = 0.01


def rm_arm(iterations: int) -> str:
    """summary.json's key for GRPO on the neural reward model with this many iterations."""
    return "grpo-rm" if iterations == 1 else f"grpo-rm-iter{iterations}"


def rm_label(iterations: int, *, short: bool = False) -> str:
    count = f"{iterations} iteration" + ("s" if iterations > 1 else "")
    return count if short else f"GRPO, neural RM, {count}"


def rm_arms(s: dict) -> list[tuple[int, str]]:
    """(iterations, key) of the neural reward model's arms in summary `s`, fewest iterations first."""
    counts = sorted({1, *s["config"].get("rm_iterations", [])})
    return [(i, rm_arm(i)) for i in counts if rm_arm(i) in s]


def at_k(entry: dict, metric: str, k: int) -> float | None:
    """metric@k of an arm (None where not measured)."""
    return entry[metric].get(str(k))


def mean_of(values: list[float]) -> float:
    return sum(values) / len(values)


def first_tenth(curve: list[float]) -> float:
    return mean_of(curve[: max(1, len(curve) // 10)])


def last_tenth(curve: list[float]) -> float:
    """Where a per-step curve ended: its mean over the last tenth of the steps."""
    return mean_of(curve[-max(1, len(curve) // 10) :])


def seeds_of(entry: dict) -> list[dict]:
    return entry.get("per_seed") or [entry]


def level(a: dict, b: dict, metric: str, k: int) -> str:
    """'above', 'level' or 'below': arm a against arm b on metric@k. Level when the seeds'
    ranges (lowest to highest seed) overlap: a difference within what seeds alone move; with
    one seed each a range is its one value."""
    ma, mb = at_k(a, metric, k), at_k(b, metric, k)
    ra = a.get(f"{metric}_range", {}).get(str(k)) or [ma, ma]
    rb = b.get(f"{metric}_range", {}).get(str(k)) or [mb, mb]
    if ra[0] <= rb[1] and rb[0] <= ra[1]:
        return "level"
    return "above" if ma > mb else "below"


def segments(curve: list[float], iterations: int) -> list[list[float]]:
    """A run's per-step curve cut at its iterations (steps split as the loop splits them)."""
    size = -(-len(curve) // iterations)
    return [curve[i : i + size] for i in range(0, len(curve), size)]


def hacking(seed: dict, iterations: int) -> list[dict]:
    """Per iteration of one seed's run on the reward model: how its score and the true
    accuracy moved (first to last tenth of the iteration's steps; an update of the reward
    model between iterations changes the score's scale, so each iteration is read alone),
    and whether it was hacked: the score rose while the true accuracy fell."""
    out = []
    for score, truth in zip(segments(seed["rm_score"], iterations), segments(seed["true_accuracy"], iterations)):
        d_score, d_true = last_tenth(score) - first_tenth(score), last_tenth(truth) - first_tenth(truth)
        out.append({"score": d_score, "true_accuracy": d_true, "hacked": d_score > 0 and d_true <= -NOISE})
    return out


def findings(s: dict) -> dict:
    """Whether each of DeepSeekMath's --full findings was reproduced, from summary `s`'s
    numbers: Fig. 5 (process supervision at least level with outcome supervision on pass@1
    and maj@k, over the same seeds), Fig. 6 (the second iteration's true accuracy above the
    first's in every seed), and the reward hacking of each neural-reward-model arm."""
    k_mid = 16 if "16" in s["base"]["maj@k"] else int(sorted(s["base"]["maj@k"], key=int)[len(s["base"]["maj@k"]) // 2])
    out: dict = {}
    if PROCESS in s and OUTCOME in s:
        process, outcome = s[PROCESS], s[OUTCOME]
        fig5: dict = {"seeds": len(seeds_of(process)), "k": k_mid}
        for metric, k in (("pass@k", 1), ("maj@k", k_mid)):
            fig5[metric.replace("k", str(k))] = {
                "process": at_k(process, metric, k),
                "outcome": at_k(outcome, metric, k),
                "verdict": level(process, outcome, metric, k),
            }
        fig5["reproduced"] = all(fig5[m]["verdict"] != "below" for m in ("pass@1", f"maj@{k_mid}"))
        length = process.get("completion_length")
        fig5["process_length"] = [first_tenth(length), last_tenth(length)] if length else None
        fig5["no_answer"] = {"process": process.get("no_answer"), "outcome": outcome.get("no_answer")}
        fig5["true_accuracy"] = {
            "process": last_tenth(process["true_accuracy"]),
            "outcome": last_tenth(outcome["true_accuracy"]),
        }
        out["fig5"] = fig5
    arms = dict(rm_arms(s))
    out["hacking"] = {
        key: [
            {"seed": seed.get("seed"), "iterations": hacking(seed, i)}
            for seed in seeds_of(s[key])
            if "rm_score" in seed
        ]
        for i, key in arms.items()
    }
    if 1 in arms and 2 in arms:
        one, two = seeds_of(s[arms[1]]), seeds_of(s[arms[2]])
        per_seed = [
            {
                "seed": b.get("seed"),
                "start": first_tenth(a["true_accuracy"]),  # both runs' first iteration begins alike
                "one": last_tenth(a["true_accuracy"]),
                "two": last_tenth(b["true_accuracy"]),
                "pass@1": [at_k(a, "pass@k", 1), at_k(b, "pass@k", 1)],
                "second_iteration": hacking(b, 2)[-1] if "rm_score" in b else None,
                "update": (b.get("rm_updates") or [None])[0],
            }
            for a, b in zip(one, two)
        ]
        above = sum(p["two"] >= p["one"] + NOISE for p in per_seed)
        out["fig6"] = {
            "seeds": len(per_seed),
            "above": above,
            "pass@1_above": sum(p["pass@1"][1] > p["pass@1"][0] for p in per_seed),
            "reproduced": above == len(per_seed),
            "per_seed": per_seed,
        }
        if 3 in arms:
            three = seeds_of(s[arms[3]])
            out["fig6"]["three_above_two"] = sum(
                last_tenth(c["true_accuracy"]) >= last_tenth(b["true_accuracy"]) + NOISE for b, c in zip(two, three)
            )
    return out
