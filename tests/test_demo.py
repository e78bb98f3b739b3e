"""The demo's report reads its numbers, and a small-budget demo runs every stage."""

import json
from dataclasses import asdict
from pathlib import Path

import pytest
import yaml

from grpo.demo.default import QUICK, DemoConfig, demo
from grpo.demo.summary import arm_entry
from grpo.errors import UserError
from grpo.demo.report import fig5_sentence, fig6_sentence, findings, write_report
from grpo.eval.runner import mean_ci

KS = [1, 2, 4, 8, 16, 32, 64]


def curves(pass_at, maj_at):
    return {
        "pass@k": {str(k): v for k, v in zip(KS, pass_at)},
        "maj@k": {str(k): v for k, v in zip(KS, maj_at)},
        "pass@k_ci": {},
        "maj@k_ci": {},
        "no_answer": 0.0,
    }


def run(models, parameters, memory, tokens, pass_at, maj_at, prompts=1600):
    return {
        **curves(pass_at, maj_at),
        "models": models,
        "parameters": parameters,
        "peak_memory_mb": memory,
        "time_s": 60.0,
        "generated_tokens": tokens,
        "steps": 100,
        "prompts": prompts,
        "time_per_step_s": 0.5,
        "reward": [0.2, 0.5],
        "true_accuracy": [0.2, 0.5],
    }


def arm(seeds: list[dict]) -> dict:
    """An arm's entry as arm_entry writes it, from per-seed entries (means and ranges)."""
    entry = dict(seeds[0])
    for metric in ("pass@k", "maj@k"):
        entry[metric] = {k: sum(s[metric][k] for s in seeds) / len(seeds) for k in seeds[0][metric]}
        entry[f"{metric}_range"] = {
            k: [min(s[metric][k] for s in seeds), max(s[metric][k] for s in seeds)] for k in seeds[0][metric]
        }
    entry["per_seed"] = seeds
    return entry


def summary(
    grpo_pass_at_64=0.86, grpo_p1=(0.48, 0.50, 0.52), ppo_p1=(0.40, 0.41, 0.42), ppo_tokens_p1=(0.47, 0.50, 0.55)
):
    def seeds(p1s, models, parameters, memory, tokens, prompts, p64):
        return [
            run(
                models,
                parameters,
                memory,
                tokens,
                [p1, 0.62, 0.73, 0.80, 0.83, 0.85, p64],
                [p1, p1, 0.58, 0.62, 0.64, 0.65, 0.66],
                prompts,
            )
            for p1 in p1s
        ]

    return {
        "config": asdict(DemoConfig()),
        "sft": {"parameters": 84544, "steps": 450},
        "time_s": 540.0,
        "base": {
            **curves([0.30, 0.45, 0.60, 0.70, 0.78, 0.83, 0.85], [0.30, 0.30, 0.40, 0.45, 0.50, 0.52, 0.53]),
            "by_digits": {"2": curves([0.4] * 7, [0.5] * 7), "3": curves([0.2] * 7, [0.3] * 7)},
        },
        "grpo": arm(seeds(grpo_p1, 3, 169088, 400.0, 160000, 1600, grpo_pass_at_64)),
        "ppo": arm(seeds(ppo_p1, 4, 253700, 430.0, 10000, 1600, 0.85)),
        "ppo_equal_tokens": arm(seeds(ppo_tokens_p1, 4, 253700, 480.0, 159000, 25600, 0.85)),
    }


def with_full(data, process, one, two, *, hacked_again=(False, False), steps=10):
    """`data` with --full's arms over len(process) seeds: process supervision's (pass@1,
    maj@16) per seed; the outcome arm is the GRPO arm's own seeds; GRPO on the reward model
    with 1 and 2 iterations, where the true accuracy of the training samples ended per seed
    (`one`, `two`). Each run's reward-model score rises; the second iteration of seed i falls
    in true accuracy while its score rises when hacked_again[i]."""
    n = len(process)
    rise = [i / (steps - 1) for i in range(steps)]  # 0 -> 1

    def rm_seed(seed, end, iterations, hacked):
        entry = run(3, 169088, 400.0, 160000, [end, 0.6, 0.7, 0.8, 0.8, 0.8, 0.85], [end] * 7)
        entry["seed"] = seed
        entry["rm_score"] = rise
        entry["true_accuracy"] = [0.3 + (end - 0.3) * r for r in rise]  # 30% -> end
        if iterations == 2:  # the first iteration flat; the second rises to `end`, or falls there by 10 points
            half = steps // 2
            up = [i / (half - 1) for i in range(half)]  # 0 -> 1
            second = [end + 0.1 - 0.1 * r for r in up] if hacked else [0.2 + (end - 0.2) * r for r in up]
            entry["true_accuracy"] = [0.3] * half + second
            entry["rm_score"] = [0.0] * half + up
            entry["rm_updates"] = [{"new_pairs": 12, "replayed": 3, "history": 30, "accuracy_on_new": 0.6}]
        return entry

    def process_seed(seed, p1, maj):
        entry = run(
            3, 169088, 400.0, 160000, [p1, 0.62, 0.73, 0.80, 0.83, 0.85, 0.86], [p1, p1, 0.58, 0.62, maj, 0.65, 0.66]
        )
        return {**entry, "seed": seed}

    data["config"]["rm_iterations"] = [1, 2]
    data["reward_model"] = {"pairs": 100, "held_out_accuracy": 0.65}
    data["grpo-outcome"] = arm(data["grpo"]["per_seed"][:n])
    data["grpo-process"] = arm([process_seed(i, p1, maj) for i, (p1, maj) in enumerate(process)])
    data["grpo-rm"] = arm([rm_seed(i, end, 1, False) for i, end in enumerate(one)])
    data["grpo-rm-iter2"] = arm([rm_seed(i, end, 2, hacked_again[i]) for i, end in enumerate(two)])
    for key in ("grpo-rm", "grpo-rm-iter2"):  # the means' curves
        seeds = data[key]["per_seed"]
        for curve in ("true_accuracy", "rm_score"):
            data[key][curve] = [sum(v) / len(v) for v in zip(*(s[curve] for s in seeds))]
    return data


def test_findings_say_reproduced_or_not_from_the_numbers(tmp_path):
    # GRPO (outcome): pass@1 48/50/52%, maj@16 64% in every seed.
    above = findings(with_full(summary(), [(0.60, 0.70), (0.62, 0.71)], one=[0.1, 0.1], two=[0.2, 0.3]))
    assert above["fig5"]["reproduced"] and above["fig5"]["pass@1"]["verdict"] == "above"
    assert above["fig5"]["maj@16"]["verdict"] == "above"
    assert above["fig6"] == {**above["fig6"], "seeds": 2, "above": 2, "reproduced": True}
    assert fig5_sentence(above["fig5"]) == (
        "**Reproduced** (DeepSeekMath Fig. 5: process supervision at least level with outcome supervision): over 2 "
        "seeds, process supervision is above it on pass@1 (61.0% against 49.0%, +12.0 points; the seeds' ranges "
        "apart) and above it on maj@16 (70.5% against 64.0%, +6.5 points; the seeds' ranges apart)."
    )
    assert fig6_sentence(above["fig6"]).startswith(
        "**Reproduced** (DeepSeekMath Fig. 6: a second iteration above the first): the true accuracy of the training "
        "samples ended higher, by 1 point or more, with two iterations than with one iteration in 2 of 2 seeds (seed "
        "0: 20.0% against 10.0%; seed 1: 30.0% against 10.0%); pass@1 on the held-out problems was higher in 2 of 2."
    )
    # Both seeds began at 30% (the runs' shared first tenth) and ended at 20% and 30%.
    assert fig6_sentence(above["fig6"]).endswith(
        "In 1 of 2 seeds the run with two iterations still ended below where training began (seed 0: 30.0% → "
        "20.0%): the reward model was hacked less, not overcome."
    )

    # Level: the ranges overlap (pass@1 47-49% against 48-50%); one metric below: not reproduced.
    level = findings(with_full(summary(), [(0.47, 0.64), (0.49, 0.66)], one=[0.1, 0.1], two=[0.2, 0.3]))
    assert level["fig5"]["pass@1"]["verdict"] == "level" and level["fig5"]["reproduced"]
    assert "is level with it on pass@1 (48.0% against 49.0%, −1.0 points; the seeds' ranges overlap)" in fig5_sentence(
        level["fig5"]
    )
    data = with_full(summary(), [(0.30, 0.66), (0.31, 0.66)], one=[0.1, 0.1], two=[0.2, 0.3])
    data["grpo-process"]["no_answer"] = 0.9
    below = findings(data)
    assert below["fig5"]["pass@1"]["verdict"] == "below" and not below["fig5"]["reproduced"]
    assert fig5_sentence(below["fig5"]).startswith("**Not reproduced**")
    assert "below it on pass@1 (30.5% against 49.0%" in fig5_sentence(below["fig5"])
    assert fig5_sentence(below["fig5"]).endswith(
        "; 90.0% of its evaluation samples gave no final answer (outcome supervision's: 0.0%): it learned to stop "
        "before answering."
    )

    # Above by less than a point is level, not above: seed 1's 10.5% against 10.0%.
    close = findings(with_full(summary(), [(0.6, 0.7), (0.6, 0.7)], one=[0.1, 0.1], two=[0.2, 0.105]))
    assert close["fig6"]["above"] == 1 and not close["fig6"]["reproduced"]
    assert "seed 1: in the second iteration" in fig6_sentence(close["fig6"]).split("Why not:")[1]

    # The second iteration below the first in seed 1, hacked again after the update there.
    missed = findings(
        with_full(summary(), [(0.6, 0.7), (0.6, 0.7)], one=[0.1, 0.2], two=[0.2, 0.1], hacked_again=(False, True))
    )
    assert missed["fig6"]["above"] == 1 and not missed["fig6"]["reproduced"]
    text = fig6_sentence(missed["fig6"])
    assert text.startswith("**Not reproduced**") and "in 1 of 2 seeds" in text
    assert (
        "Why not: seed 1: in the second iteration the reward model's score moved +1.00 while the true accuracy "
        "moved −10.0 points (hacked again after the update); its update learned from 12 new comparisons and 3 "
        "replayed, and ranked 60.0% of the new ones right after it." in text
    )
    assert "seed 0:" not in text.split("Why not:")[1].split(". ")[0]  # seed 0 reproduced it: no reason owed
    # The hacking of each reward-model arm is counted per seed (the score rose, the truth fell).
    assert [any(i["hacked"] for i in r["iterations"]) for r in missed["hacking"]["grpo-rm"]] == [True, True]
    assert [r["iterations"][-1]["hacked"] for r in missed["hacking"]["grpo-rm-iter2"]] == [False, True]

    data = with_full(
        summary(), [(0.30, 0.66), (0.31, 0.66)], one=[0.1, 0.2], two=[0.2, 0.1], hacked_again=(False, True)
    )
    write_report(tmp_path / "report.md", data)
    report = (tmp_path / "report.md").read_text()
    assert "- Fig. 5, process supervision at least level with outcome supervision: not reproduced (Result 4)." in report
    assert (
        "- Fig. 6, a second iteration of iterative RL above the first: not reproduced (1 of 2 seeds; Result 5)."
        in report
    )
    assert (
        "- Reward hacking, GRPO, neural RM, 1 iteration: the score rose while the true accuracy fell in 2 of 2 seeds"
        in report
    )
    assert fig5_sentence(findings(data)["fig5"]) in report and fig6_sentence(findings(data)["fig6"]) in report
    assert "| GRPO, neural RM, 2 iterations | 15.0% [10.0–20.0%] |" in report


def test_report_states_what_moved_by_how_much_and_over_how_many_seeds(tmp_path):
    write_report(tmp_path / "report.md", summary())
    text = (tmp_path / "report.md").read_text()
    assert (
        "The base solved 85.0% of the problems within 64 samples (2-digit: 40.0%, 3-digit: 20.0%): pass@64 had room to rise"
        in text
    )
    assert "GRPO moved pass@1 from 30.0% to 50.0% [48.0–52.0%] (+20.0 points; 3 of 3 seeds above the base)" in text
    assert "maj@16 from 50.0% to 64.0% [64.0–64.0%] (+14.0 points; 3 of 3 seeds above the base)" in text
    assert "pass@64 barely moved: 85.0% → 86.0% [86.0–86.0%] (+1.0 points)" in text
    assert "This is DeepSeekMath's finding" in text
    assert "PPO held 4 models" in text and "its peak memory was 30 MB higher at equal prompts" in text
    assert "At equal prompts GRPO generated 16.0x PPO's tokens" in text
    # Separated ranges are a difference; overlapping ones are said to be within the spread.
    assert "reached pass@1 50.0% against 41.0% (+9.0 points): above it (the seeds' ranges do not overlap)" in text
    assert "GRPO's pass@1 is 50.0% against 50.7% (−0.7 points), within the spread over seeds" in text
    assert "| GRPO | 3 | 169,088 | 400 | 160,000 | 1,600 | 60 | 50.0% [48.0–52.0%] |" in text
    assert "| PPO, equal generated tokens | 4 | 253,700 | 480 | 159,000 | 25,600 |" in text
    # PPO's tuning is recorded once, in benchmarks/README.md; the report says where.
    assert 'is recorded in the project\'s benchmarks/README.md ("grpo demo")' in text
    benchmarks = Path(__file__).parents[1] / "benchmarks" / "README.md"
    assert "\n## `grpo demo`: how its settings were chosen\n" in benchmarks.read_text()


def test_report_reads_a_ceiling_a_loss_and_a_large_k_move(tmp_path):
    data = summary(grpo_pass_at_64=0.99)
    data["base"]["pass@k"]["64"] = 0.97
    write_report(tmp_path / "a.md", data)
    assert "at or near the ceiling, so whether RL moves pass@64 cannot be read here" in (tmp_path / "a.md").read_text()

    data = summary(grpo_p1=(0.25, 0.28, 0.29))  # below the base's 30%
    write_report(tmp_path / "b.md", data)
    text = (tmp_path / "b.md").read_text()
    assert "0 of 3 seeds above the base" in text and "GRPO did not raise pass@1 in this run" in text
    assert "This is DeepSeekMath's finding" not in text

    data = summary()  # pass@1 rose and pass@64 fell: the finding, and the fall said
    data["grpo"]["pass@k"]["64"] = 0.55
    write_report(tmp_path / "c.md", data)
    text = (tmp_path / "c.md").read_text()
    assert "pass@64 fell: 85.0% → 55.0%" in text and "This is DeepSeekMath's finding" in text
    assert "pass@64 even fell" in text

    data = summary()  # pass@64 rose by more than pass@1
    data["base"]["pass@k"]["64"] = 0.60
    write_report(tmp_path / "d.md", data)
    text = (tmp_path / "d.md").read_text()
    assert "pass@64 rose: 60.0% → 86.0%" in text and "not the pattern DeepSeekMath reports" in text
    assert "This is DeepSeekMath's finding" not in text


def test_over_seeds_means_ranges_and_intervals_over_problems():
    rows = [{"digits": 2}, {"digits": 3}]

    def result(p1s):  # two problems
        per = [{"pass@k": {"1": p, "2": p}, "maj@k": {"1": p, "2": p}} for p in p1s]
        mean = {"1": sum(p1s) / 2, "2": sum(p1s) / 2}
        return {"pass@k": mean, "maj@k": mean, "pass@k_ci": {}, "maj@k_ci": {}, "no_answer": 0.0, "per_prompt": per}

    def trained(memory, accuracy):
        return {
            "models": 3,
            "parameters": 10,
            "peak_memory_mb": memory,
            "time_s": 1.0,
            "generated_tokens": 100,
            "steps": 2,
            "prompts": 8,
            "time_per_step_s": 0.5,
            "metrics": [
                {"reward/mean": a, "reward/arithmetic_correct": a, "completion_length/mean": 10 * memory * a}
                for a in accuracy
            ],
        }

    entry = arm_entry(
        [(0, trained(100.0, [0.1, 0.3]), result([0.6, 0.4])), (1, trained(200.0, [0.3, 0.5]), result([0.4, 0.2]))], rows
    )
    assert entry["pass@k"]["1"] == pytest.approx(0.4) and entry["pass@k_range"]["1"] == pytest.approx([0.3, 0.5])
    assert entry["peak_memory_mb"] == 150.0 and entry["true_accuracy"] == pytest.approx([0.2, 0.4])
    assert entry["completion_length"] == pytest.approx([(100 + 600) / 2, (300 + 1000) / 2])
    assert "rm_score" not in entry  # no reward model scored these runs
    assert [s["seed"] for s in entry["per_seed"]] == [0, 1]
    assert entry["per_seed"][0]["by_digits"] == {
        "2": {"pass@k": {"1": 0.6, "2": 0.6}, "maj@k": {"1": 0.6, "2": 0.6}},
        "3": {"pass@k": {"1": 0.4, "2": 0.4}, "maj@k": {"1": 0.4, "2": 0.4}},
    }
    # Per problem, averaged over seeds: 0.5 and 0.3; the interval is over those two.
    assert entry["pass@k_ci"]["1"] == pytest.approx(mean_ci([0.5, 0.3])[1])
    assert mean_ci([0.5, 0.3])[1] != pytest.approx(mean_ci([0.6, 0.4])[1])
    assert entry["by_digits"]["2"]["pass@k"]["1"] == pytest.approx(0.5)
    assert entry["by_digits"]["3"]["pass@k"]["1"] == pytest.approx(0.3)


@pytest.fixture(scope="module")
def demo_base(tmp_path_factory):
    """The demo's base (its default SFT steps and digits, seed 0), trained once for the
    module's whole-demo tests: `demo` then copies it where its own SFT would write. What
    the SFT stage does is tested in tests/train/test_sft.py; here it only costs time."""
    from grpo.train.sft import SFTConfig, sft

    c = DemoConfig()
    key = (0, c.sft_steps, list(c.digits))
    out = tmp_path_factory.mktemp("demo-base") / "base"
    info = sft(out, SFTConfig(seed=0, steps=c.sft_steps, digits=list(c.digits)), progress=False)
    return key, out, info


@pytest.fixture
def reuse_base(demo_base, monkeypatch):
    import shutil

    import grpo.train.sft as sft_module

    key, built, info = demo_base
    real = sft_module.sft

    def sft(output, config, **kwargs):
        if (config.seed, config.steps, list(config.digits)) != key:
            return real(output, config, **kwargs)
        shutil.copytree(built, output)
        return {**info, "output": str(output)}

    monkeypatch.setattr(sft_module, "sft", sft)


@pytest.mark.slow
def test_quick_demo_runs_every_stage_over_seeds(tmp_path, reuse_base):
    config = DemoConfig(
        seeds=2,
        full=True,
        sft_steps=DemoConfig.sft_steps,  # QUICK's weaker base gives the reward model too few right answers
        eval_prompts=8,
        n=8,
        ks=[1, 2, 4, 8],
        train_prompts=64,
        steps=4,
        prompts_per_step=2,
        group_size=4,
        rm_prompts=QUICK["rm_prompts"],
        rm_samples=8,
        rm_iterations=[1, 2],
        rm_update_prompts=4,
    )
    out = tmp_path / "demo"
    result = demo(out, config, progress=False)
    saved = json.loads((out / "summary.json").read_text())
    assert saved["time_s"] == pytest.approx(result["time_s"])
    for name in ("base", "grpo", "ppo", "ppo_equal_tokens"):
        assert set(saved[name]["pass@k"]) == {"1", "2", "4", "8"} and set(saved[name]["maj@k"]) == {"1", "2", "4", "8"}
    for name in ("grpo", "ppo", "ppo_equal_tokens"):
        per_seed = saved[name]["per_seed"]
        assert [s["seed"] for s in per_seed] == [0, 1]
        assert saved[name]["pass@k"]["1"] == pytest.approx(sum(s["pass@k"]["1"] for s in per_seed) / 2)
        assert saved[name]["maj@k"]["8"] == pytest.approx(sum(s["maj@k"]["8"] for s in per_seed) / 2)
    assert saved["grpo"]["models"] == 3 and saved["ppo"]["models"] == 4 == saved["ppo_equal_tokens"]["models"]
    # Equal prompts: G times fewer samples; equal tokens: G times the prompts, as many samples as GRPO.
    assert saved["ppo_equal_tokens"]["prompts"] == 4 * saved["ppo"]["prompts"] == 4 * saved["grpo"]["prompts"]
    assert saved["grpo"]["generated_tokens"] > saved["ppo"]["generated_tokens"]
    ppo_config = yaml.safe_load((out / "ppo" / "seed-1.yaml").read_text())
    c = DemoConfig()  # PPO's own settings, not GRPO's
    assert (
        ppo_config["seed"] == 1
        and ppo_config["train"]["lr"] == c.ppo_lr
        and ppo_config["value"]["lr"] == c.ppo_value_lr
    )
    assert (ppo_config["train"]["epochs"], ppo_config["train"]["minibatches"]) == (c.ppo_epochs, c.ppo_minibatches)
    assert ppo_config["loss"]["lam"] == c.ppo_lam
    grpo_config = yaml.safe_load((out / "grpo" / "seed-1.yaml").read_text())
    assert grpo_config["train"]["minibatches"] == c.minibatches and grpo_config["train"]["lr"] == c.lr
    assert set(saved["base"]["by_digits"]) == {"2", "3"}
    # --full's arms, over the same 2 seeds as the main arms, shaped as theirs; outcome
    # supervision is the GRPO arm's own runs of those seeds, not retrained.
    assert saved["neural_rm_skipped"] is None and saved["reward_model"]["pairs"] >= 10
    for name in ("grpo-outcome", "grpo-process", "grpo-rm", "grpo-rm-iter2"):
        per_seed = saved[name]["per_seed"]
        assert [s["seed"] for s in per_seed] == [0, 1], name
        assert saved[name]["pass@k"]["1"] == pytest.approx(sum(s["pass@k"]["1"] for s in per_seed) / 2)
        assert len(saved[name]["true_accuracy"]) == config.steps
    assert saved["grpo-outcome"]["per_seed"] == saved["grpo"]["per_seed"]
    assert not (out / "grpo-outcome").exists()
    for name in ("grpo-rm", "grpo-rm-iter2"):  # the hacking curve: the score beside the truth
        assert len(saved[name]["rm_score"]) == config.steps and saved[name]["iterations"] == int(name[-1:] == "2") + 1
    assert "supervision: process" in (out / "grpo-process" / "seed-1.yaml").read_text()
    # Iterative RL replays the reward model's own training comparisons from its first update on.
    iterative = yaml.safe_load((out / "grpo-rm-iter2" / "seed-1.yaml").read_text())
    assert iterative["train"]["iterations"] == 2
    history = iterative["reward_model_update"]["data"]
    assert history == str(out / "data" / "rm_pairs.jsonl")
    assert len((out / "data" / "rm_pairs.jsonl").read_text().splitlines()) == saved["reward_model"]["pairs"]
    for seed in saved["grpo-rm-iter2"]["per_seed"]:
        (update,) = seed["rm_updates"]
        assert update["history"] == saved["reward_model"]["pairs"] and update["replayed"] > 0
    assert set(saved["findings"]) == {"fig5", "fig6", "hacking"}
    report = (out / "report.md").read_text()
    assert "Result 2: GRPO against PPO, at equal prompts and at equal generated tokens" in report
    assert "Result 4: outcome against process supervision" in report and "Result 5: iterative RL" in report
    for png in ("pass_maj_at_k.png", "rewards.png", "supervision.png", "neural_rm.png", "iterative.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    with pytest.raises(UserError, match="pass --overwrite"):
        demo(out, config, progress=False)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="not an earlier demo's output"):
        demo(tmp_path / "other", config, progress=False, overwrite=True)
    assert (tmp_path / "other" / "notes.txt").read_text() == "mine"


@pytest.mark.slow
def test_a_failed_full_run_is_reported_and_the_rest_kept(tmp_path, monkeypatch, reuse_base):
    import grpo.demo.default as demo_module

    real = demo_module.train_in_child

    def flaky(config, path, **kwargs):
        if "grpo-process" in str(path):
            raise UserError("training grpo-process.yaml failed: grpo: error: planted")
        return real(config, path, **kwargs)

    monkeypatch.setattr(demo_module, "train_in_child", flaky)
    config = DemoConfig(
        seeds=1,
        full=True,
        neural_rm=False,
        eval_prompts=4,
        n=4,
        ks=[1, 2, 4],
        train_prompts=32,
        steps=2,
        prompts_per_step=2,
        group_size=2,
        rm_prompts=8,
        rm_iterations=[1, 2],
    )
    demo(tmp_path / "demo", config, progress=False)
    saved = json.loads((tmp_path / "demo" / "summary.json").read_text())
    assert "grpo-process" not in saved and "planted" in saved["failed"]["grpo-process/seed-0"]
    assert {"grpo", "ppo", "ppo_equal_tokens", "grpo-outcome"} <= saved.keys()
    assert "fig5" not in saved["findings"]
    report = (tmp_path / "demo" / "report.md").read_text()
    assert "Not shown: `grpo-process`, whose run `grpo-process/seed-0` failed" in report


@pytest.mark.parametrize(
    "low, high, words",
    [
        (0.62, 0.66, "The mean maj@16 gain (+14.0 points) is 3.5 times the spread of the seeds (4.0 points"),
        (0.52, 0.70, "The mean maj@16 gain (+14.0 points) is not larger than the spread of the seeds (18.0 points"),
    ],
)
def test_report_weighs_the_maj_gain_against_the_seeds_spread(tmp_path, low, high, words):
    s = summary()
    s["grpo"]["maj@k_range"]["16"] = [low, high]  # mean 64.0% against the base's 50.0%
    write_report(tmp_path / "report.md", s)
    assert words in (tmp_path / "report.md").read_text()


def test_report_names_the_host_it_ran_on(tmp_path):
    s = summary()
    s["host"] = {"cpu_model": "AMD EPYC", "cpu_flags": ["avx2"], "cpus": 2, "torch": "2.13.0+cpu"}
    write_report(tmp_path / "report.md", s)
    assert "minutes on this machine, AMD EPYC (avx2), 2 CPUs)" in (tmp_path / "report.md").read_text()


def test_ppo_at_equal_tokens_runs_only_when_asked_over_its_seeds():
    from grpo.demo.default import _arm_seeds

    assert _arm_seeds(DemoConfig(seeds=5)) == {"grpo": [0, 1, 2, 3, 4], "ppo": [0, 1, 2, 3, 4]}
    assert _arm_seeds(DemoConfig(seeds=5, full=True, full_seeds=3))["ppo_equal_tokens"] == [0, 1, 2]
    assert _arm_seeds(DemoConfig(seed=2, seeds=2, equal_tokens=True))["ppo_equal_tokens"] == [2, 3]


def test_report_without_ppo_at_equal_tokens_says_why(tmp_path):
    s = summary()
    del s["ppo_equal_tokens"]
    write_report(tmp_path / "report.md", s)
    text = (tmp_path / "report.md").read_text()
    assert "## Result 2: GRPO against PPO, at equal prompts\n" in text
    assert "(not run here: the costliest arm, it comes with `--full` or `--equal-tokens`)" in text
    assert "At equal generated tokens" not in text


@pytest.mark.slow
def test_a_stop_starts_no_queued_run(tmp_path, monkeypatch):
    """Ctrl-C while the runs train (here: as the first run's line is printed): the running
    ones get it themselves (and save their last step); none still queued starts after it."""
    import time

    import grpo.demo.default as demo_module

    started = []

    def train(config, path, **kwargs):
        started.append(Path(path).stem)
        time.sleep(0.0 if not started[1:] else 0.5)  # the first ends at once; the next runs on a while
        return {"time_s": 0.0, "metrics": [{"reward/mean": 0.0}]}

    def say(line):
        raise KeyboardInterrupt

    monkeypatch.setattr(demo_module, "train_in_child", train)
    jobs = [demo_module.Job(f"grpo/seed-{i}", f"seed {i}", {"model": "m"}) for i in range(4)]
    with pytest.raises(KeyboardInterrupt):
        demo_module.train_all(jobs, tmp_path, parallel=1, say=say)
    assert started[0] == "seed-0" and "seed-2" not in started and "seed-3" not in started
