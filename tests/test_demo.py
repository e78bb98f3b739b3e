"""The demo's report reads its numbers, and a small-budget demo runs every stage."""

import json
from dataclasses import asdict
from pathlib import Path

import pytest
import yaml

from grpo.demo import DemoConfig, _over_seeds, demo
from grpo.errors import UserError
from grpo.eval.report import write_report
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
    """An arm's entry as _over_seeds writes it, from per-seed entries (means and ranges)."""
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
            "metrics": [{"reward/mean": a, "reward/arithmetic_correct": a} for a in accuracy],
        }

    entry = _over_seeds(
        [(0, trained(100.0, [0.1, 0.3]), result([0.6, 0.4])), (1, trained(200.0, [0.3, 0.5]), result([0.4, 0.2]))], rows
    )
    assert entry["pass@k"]["1"] == pytest.approx(0.4) and entry["pass@k_range"]["1"] == pytest.approx([0.3, 0.5])
    assert entry["peak_memory_mb"] == 150.0 and entry["true_accuracy"] == pytest.approx([0.2, 0.4])
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


def test_quick_demo_runs_every_stage_over_seeds(tmp_path):
    config = DemoConfig(
        seeds=2,
        full=True,
        sft_steps=300,
        eval_prompts=8,
        n=8,
        ks=[1, 2, 4, 8],
        train_prompts=64,
        steps=4,
        prompts_per_step=2,
        group_size=4,
        rm_prompts=16,
        rm_samples=8,
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
    for name in ("grpo-rm", "grpo-process", "grpo-rm-iterative"):
        assert name in saved or saved["neural_rm_skipped"] is not None and name != "grpo-process", name
    assert "supervision: process" in (out / "grpo-process.yaml").read_text()
    report = (out / "report.md").read_text()
    assert "Result 2: GRPO against PPO, at equal prompts and at equal generated tokens" in report
    assert "Result 4: outcome against process supervision" in report
    for png in ("pass_maj_at_k.png", "rewards.png", "supervision.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    with pytest.raises(UserError, match="pass --overwrite"):
        demo(out, config, progress=False)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="not an earlier demo's output"):
        demo(tmp_path / "other", config, progress=False, overwrite=True)
    assert (tmp_path / "other" / "notes.txt").read_text() == "mine"


def test_a_failed_full_run_is_reported_and_the_rest_kept(tmp_path, monkeypatch):
    import grpo.demo as demo_module

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
        sft_steps=300,
        eval_prompts=4,
        n=4,
        ks=[1, 2, 4],
        train_prompts=32,
        steps=2,
        prompts_per_step=2,
        group_size=2,
        rm_prompts=8,
    )
    demo(tmp_path / "demo", config, progress=False)
    saved = json.loads((tmp_path / "demo" / "summary.json").read_text())
    assert "grpo-process" not in saved and "planted" in saved["failed"]["grpo-process"]
    assert {"grpo", "ppo", "ppo_equal_tokens"} <= saved.keys()
    assert "Not shown: the run `grpo-process` failed" in (tmp_path / "demo" / "report.md").read_text()


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
