"""benchmarks/bench_time_to_quality.py: when each tool first reaches the target pass@1 (on
made-up series), the training time summed up to each checkpoint, a checkpoint's weights
exported as the model that is evaluated, and the whole --quick run (ours, and TRL where it is
installed) with its series."""

import importlib.util
import json

import pytest
import torch

from benchmarks import bench_time_to_quality as ttq


def points(*triples, samples=80):
    """A made-up series: (step, train_s, correct) triples."""
    return [{"step": s, "train_s": t, "correct": c, "samples": samples} for s, t, c in triples]


# ours dips after its first crossing and rises above it later; TRL reaches its best exactly.
OURS = points((0, 0.0, 10), (10, 100.0, 25), (20, 200.0, 40), (30, 300.0, 35), (40, 400.0, 45))
TRL = points((0, 0.0, 10), (10, 250.0, 20), (20, 500.0, 30), (30, 750.0, 38), (40, 1000.0, 36))


def test_the_default_target_is_the_highest_both_reach_and_each_time_its_first_crossing():
    result = ttq.time_to_target({"ours": OURS, "trl": TRL})
    assert (result["correct"], result["samples"], result["pass@1"]) == (38, 80, 38 / 80)
    assert result["reached"] == {"ours": {"step": 20, "train_s": 200.0}, "trl": {"step": 30, "train_s": 750.0}}
    assert result["ratio"] == 200.0 / 750.0 and result["note"] is None
    # The points' order in the list does not matter: the first crossing is by step.
    shuffled = ttq.time_to_target({"ours": OURS[::-1], "trl": TRL[::-1]})
    assert shuffled["reached"] == result["reached"]


def test_a_fixed_target_is_a_count_of_correct_samples():
    # 0.55 * 720 is 396.00000000000006 in floating point, 29 / 720 * 720 is 29.000000000000004:
    # still 396 and 29 correct samples, so that a point's own pass@1 as the target is reached by it.
    assert ttq.target_count(0.55, 720) == 396 and ttq.target_count(29 / 720, 720) == 29
    assert ttq.target_count(0.35, 720) == 252 and ttq.target_count(0.3501, 720) == 253
    result = ttq.time_to_target({"ours": OURS, "trl": TRL}, target=0.5)  # 40 of 80: ours only
    assert result["chosen"] == "fixed" and result["correct"] == 40
    assert result["reached"] == {"ours": {"step": 20, "train_s": 200.0}, "trl": None} and result["ratio"] is None
    assert "TRL: never reached" in ttq.verdict(result)


def test_no_gain_over_the_base_is_said_not_timed():
    flat = points((0, 0.0, 10), (10, 100.0, 9))
    result = ttq.time_to_target({"ours": flat, "trl": points((0, 0.0, 10), (10, 300.0, 10))})
    assert result["reached"]["ours"]["step"] == 0 and result["ratio"] is None
    assert "no tool rose above the base" in ttq.verdict(result)
    with pytest.raises(ValueError, match="different numbers of samples"):
        ttq.time_to_target({"ours": flat, "trl": points((0, 0.0, 10), samples=40)})


def report(correct_per_prompt, n):
    """An evaluation report as grpo.eval.runner.evaluate gives it, the parts a series reads."""
    total = sum(correct_per_prompt) / (n * len(correct_per_prompt))
    return {
        "n": n,
        "prompts": len(correct_per_prompt),
        "pass@k": {"1": total, str(n): 0.5},
        "pass@k_ci": {"1": [0.0, 1.0]},
        "maj@k": {str(n): 0.25},
        "truncated": 0.0,
        "per_prompt": [{"correct": c} for c in correct_per_prompt],
    }


def test_a_series_sums_the_step_times_up_to_each_checkpoint():
    evaluations = {0: report([1, 0], 4), 4: report([4, 3], 4), 2: report([2, 1], 4)}
    series = ttq.series_of([1.0, 2.0, 3.0, 4.0], evaluations)
    assert [(p["step"], p["train_s"], p["correct"], p["samples"]) for p in series] == [
        (0, 0.0, 1, 8),
        (2, 3.0, 3, 8),
        (4, 10.0, 7, 8),
    ]
    assert series[1]["pass@1"] == 3 / 8 and series[1]["maj@4"] == 0.25
    with pytest.raises(ValueError, match="only 4 steps"):
        ttq.series_of([1.0, 2.0, 3.0, 4.0], {6: report([1], 4)})
    printed = ttq.table({"ours": series}, 4)
    assert "| 2 | 3.0 | 0.375 [0.000, 1.000] | 0.250 |" in printed


def test_a_checkpoint_is_evaluated_with_its_own_policy_weights(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo.tasks.tiny import save_tiny_tool_model

    base = save_tiny_tool_model(tmp_path / "base", hidden_size=16, layers=1, heads=2)
    trained = AutoModelForCausalLM.from_pretrained(base)
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(0.01 * torch.randn_like(p))
    checkpoint = tmp_path / "step-000003"
    checkpoint.mkdir()
    torch.save({"policy": trained.state_dict(), "step": 3}, checkpoint / "state.pt")
    out = ttq.export_checkpoint(checkpoint, str(base), tmp_path / "exported")
    exported = AutoModelForCausalLM.from_pretrained(out).state_dict()
    for key, value in trained.state_dict().items():
        assert torch.equal(exported[key], value), key
    assert AutoTokenizer.from_pretrained(out).chat_template == AutoTokenizer.from_pretrained(base).chat_template


def test_the_trl_settings_are_read_as_yaml():
    assert ttq.parse_trl_set("beta=0.04") == ("beta", 0.04)
    assert ttq.parse_trl_set("lr_scheduler_type=constant") == ("lr_scheduler_type", "constant")
    with pytest.raises(SystemExit):
        ttq.main(["--quick", "--steps", "3", "--every", "2"])  # both tools save at each multiple


@pytest.mark.slow
def test_the_quick_run_measures_both_tools_alike(tmp_path, monkeypatch, capsys):
    for name in ("PYTHONPATH", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):  # main sets them for the children
        monkeypatch.setenv(name, "1" if name != "PYTHONPATH" else "")
    with_trl = importlib.util.find_spec("trl") is not None
    out = tmp_path / "result.json"
    argv = ["--quick", "--threads", "1", "--json", str(out), "--work-dir", str(tmp_path / "work")]
    assert ttq.main(argv + ([] if with_trl else ["--skip-trl"])) == 0
    result = json.loads(out.read_text())
    tools = ["ours", "trl"] if with_trl else ["ours"]
    assert list(result["series"]) == tools
    for tool in tools:
        series, steps_s = result["series"][tool], result["runs"][tool]["steps_s"]
        assert len(steps_s) == 2 and min(steps_s) > 0
        assert [p["step"] for p in series] == [0, 1, 2]
        assert [p["train_s"] for p in series] == [0.0, steps_s[0], steps_s[0] + steps_s[1]]
        assert {p["samples"] for p in series} == {3 * 2}  # --quick: 3 questions x 2 samples
    if with_trl:
        assert result["series"]["ours"][0] == result["series"]["trl"][0]  # one base, evaluated once
        assert result["runs"]["trl"]["settings"]["beta"] == 0.0  # TRL's default, not ours
        assert set(result["time_to_target"]["reached"]) == {"ours", "trl"}
    assert result["runs"]["ours"]["settings"]["loss.beta"] == 0.04
    logged = [json.loads(line)["time/step"] for line in (tmp_path / "work/ours/metrics.jsonl").read_text().splitlines()]
    assert result["runs"]["ours"]["steps_s"] == logged  # step by step, in order
    printed = capsys.readouterr().out
    assert "| step | ours training s |" in printed and "target pass@1" in printed
    assert not (tmp_path / "work" / "ours-step-1").exists()  # each point's weights go once evaluated
