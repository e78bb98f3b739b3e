"""benchmarks/bench_grpo_step.py's realistic workload at a tiny size: its construction (a Qwen2
model, a byte-level tokenizer that survives AutoTokenizer, a warm-up), one step of ours with
the completions' lengths recorded, and the sweep's argument."""

import argparse
import json
from pathlib import Path

import pytest

from benchmarks import _realistic, bench_grpo_step as bench

TEXT = "ab c  12 = x\tq\n7+7"


def _save_beside_qwen2(directory, tokenizer, vocab_size):
    from transformers import Qwen2Config

    Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=64,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    ).save_pretrained(directory)
    tokenizer.save_pretrained(directory)


def test_tokenizer_round_trips_through_autotokenizer(tmp_path):
    from transformers import AutoTokenizer

    tokenizer = _realistic.byte_level_tokenizer(1000)
    assert len(tokenizer) == 1000 and tokenizer.eos_token_id == tokenizer.pad_token_id == 999
    _save_beside_qwen2(tmp_path, tokenizer, 1000)
    _realistic.check_round_trip(tmp_path)  # raises if not
    loaded = AutoTokenizer.from_pretrained(tmp_path)  # what both tools load: Qwen2Tokenizer in transformers 5
    ids = loaded(TEXT)["input_ids"]
    assert loaded.decode(ids) == TEXT
    assert len(ids) == len(TEXT)  # one token per character (per byte)
    assert ids == tokenizer(TEXT)["input_ids"]  # the same ids as the tokenizer that was saved


def test_check_round_trip_catches_the_trap(tmp_path):
    """The trap the byte-level tokenizer avoids: a character-level WordLevel tokenizer saved
    beside a Qwen2 config comes back from AutoTokenizer without its spaces."""
    from transformers import AutoTokenizer

    from grpo.tasks.tiny import char_tokenizer

    tokenizer = char_tokenizer(_realistic.ALPHABET)
    _save_beside_qwen2(tmp_path, tokenizer, len(tokenizer))
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    if loaded.decode(loaded("a b")["input_ids"]) == "a b":
        pytest.skip(f"this transformers loads {type(loaded).__name__} and keeps the spaces: no trap to catch")
    with pytest.raises(ValueError, match="does not round-trip"):
        _realistic.check_round_trip(tmp_path)


@pytest.mark.slow
def test_realistic_tiny_one_step_of_ours(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the `grpo train` child's threads
    cache = tmp_path / "cache"
    built = _realistic.cached(cache, "tiny", progress=False, log=lambda line: None)
    assert built["spec"]["config"]["vocab_size"] == 1000
    rows = built["warmup_rows"]
    assert rows["max"] <= _realistic.LENGTH_CAP + 1 and rows["p50"] < rows["p90"] < rows["max"]  # lengths vary
    _realistic.check_round_trip(built["model_dir"])

    # Reused, not rebuilt: the same directory, and a marker left in it survives.
    marker = Path(built["directory"]) / "marker"
    marker.write_text("x")
    assert _realistic.cached(cache, "tiny", progress=False, log=lambda line: None)["directory"] == built["directory"]
    assert marker.exists()

    w = bench.build_realistic(tmp_path, cache, "tiny")
    assert w["model_dir"] == built["model_dir"]
    assert w["tied_embeddings"] and w["vocab_size"] == 1000
    assert w["body_parameters"] == w["parameters"] - w["embedding_parameters"]  # tied: the head is the embedding
    group, prompts, limit = 4, 2, 24
    w["settings"] = {**w["settings"], "group_size": group, "prompts_per_step": prompts, "max_new_tokens": limit}
    run = bench.run_ours(w, tmp_path, 1, "fp32", "auto", None)  # None: ours' own default
    assert run["settings"]["train.gradient_checkpointing"] is True  # ours' default, as TRL's
    ((metrics,), (record,)) = run["steps"], run["lengths"]
    assert len(record["lengths"]) == group * prompts and max(record["lengths"]) <= limit
    assert sum(record["lengths"]) == metrics["tokens/completion"]
    # The prompts in the file's order (as TRL's run takes them), recorded with the lengths.
    first = [json.loads(line)["prompt"] for line in Path(w["prompts"]).read_text().splitlines()[:prompts]]
    assert sorted(record["prompts"]) == sorted(p for p in first for _ in range(group))
    assert bench.same_prompts(run, run) == 1.0
    other = {"lengths": [{**record, "prompts": ["another prompt", *record["prompts"][1:]]}]}
    assert bench.same_prompts(run, other) == 0.0 and bench.same_prompts(run, {"lengths": []}) is None

    summary = bench.summarize(run, None, w)
    (stats,) = summary["lengths_per_step"]
    assert summary["length_mean_gap_to_tool_metric"] == 0.0  # the recorder agrees with metrics.jsonl
    assert stats["frac_truncated"] == pytest.approx(metrics["frac_truncated"])
    assert stats["max"] == max(record["lengths"]) and stats["n"] == group * prompts
    flops = bench.lengths_flops(w, w["prompt_tokens"], record["lengths"])
    assert summary["achieved_gflops"] == pytest.approx(flops["total"] / metrics["time/step"] / 1e9)

    # --ours-set reaches the run's config, as `grpo train --set` takes it.
    (tmp_path / "set").mkdir()
    bench.run_ours(w, tmp_path / "set", 1, "fp32", "auto", None, overrides=["train.chunked_head=false"])
    resolved = (tmp_path / "set" / f"ours-{w['name']}-fp32" / "config.yaml").read_text()
    assert "chunked_head: false" in resolved

    # bench_sampling.py on the same build: every sampling variant draws the same tokens.
    from benchmarks import bench_sampling

    assert bench_sampling.main(["--shape", "tiny", "--cache-dir", str(cache), "--repeats", "1"]) == 0

    # Generation as a stream of the weights: one read of every fp32 weight per token step, as
    # many steps as the longest completion, over the phase's time.
    streamed = max(record["lengths"]) * 4 * w["parameters"] / metrics["time/generate"] / 1e9
    assert summary["generate_weight_gbps"] == pytest.approx(streamed)

    printed = bench.table(w, summary, None, "skipped", 100.0, None, bandwidth=2 * streamed)
    assert f"weights streamed at {streamed:.1f} GB/s, 50% of the measured {2 * streamed:.1f} GB/s" in printed
    assert f"{stats['mean']:.1f} / {stats['p50']} / {stats['p90']} / {stats['max']}" in printed
    assert "ours step 1 (warm-up)" in printed and "train.gradient_checkpointing True" in printed
    json.dumps(summary)  # goes into the results file


def test_length_stats_by_hand():
    stats = _realistic.length_stats([5, 1, 3, 10, 2, 8, 4, 7, 6, 9], [True] * 8 + [False] * 2)
    assert stats == {"n": 10, "mean": 5.5, "p50": 5, "p90": 9, "max": 10, "frac_truncated": 0.2}


def test_sweep_argument():
    assert bench.parse_sweep("group_size=4,8,16,32") == ("group_size", [4, 8, 16, 32])
    assert bench.parse_sweep("max_new_tokens=64") == ("max_new_tokens", [64])
    for bad in ("group_size", "lr=1,2", "group_size=4,x", "group_size=0,4", "max_new_tokens="):
        with pytest.raises(argparse.ArgumentTypeError):
            bench.parse_sweep(bad)


def test_sweep_refuses_more_tokens_than_positions(tmp_path, capsys):
    argv = [
        "--sweep",
        "max_new_tokens=64,1000",
        "--realistic-shape",
        "tiny",
        "--skip-trl",
        "--sweep-steps",
        "2",
        "--cache-dir",
        str(tmp_path),
        "--results",
        str(tmp_path),
    ]
    with pytest.raises(SystemExit) as exit_:
        bench.main(argv)
    assert exit_.value.code == 2
    assert "--sweep max_new_tokens: at most 500 with --realistic-shape tiny" in capsys.readouterr().err


def test_sweep_table_marks_failures_not_skips():
    ours = {
        "median_step_s": 1.5,
        "peak_rss_mb": 900.0,
        "lengths_timed": {"n": 32, "mean": 47.5, "p50": 40, "p90": 99, "max": 140, "frac_truncated": 0.0},
    }
    points = [
        {
            "value": 4,
            "ours": ours,
            "trl": None,
            "ours_note": None,
            "trl_note": "skipped (--skip-trl)",
            "trl_failed": False,
        },
        {
            "value": 32,
            "ours": None,
            "trl": None,
            "ours_note": "grpo train failed (killed by signal 9)",
            "trl_note": "TRL run failed (exit 1): boom",
            "trl_failed": True,
        },
    ]
    printed = bench.sweep_table("group_size", points, "fp32", 3)
    rows = [line for line in printed.splitlines() if line.startswith("| 4 ") or line.startswith("| 32 ")]
    assert rows == [
        "| 4 | 1.50 | - | - | 900 | - | - | 47.5 / 140, 0% | - |",
        "| 32 | - | - | - | - | - | - | failed | failed |",
    ]
    assert "group_size=32 ours: grpo train failed (killed by signal 9)" in printed
    assert "group_size=32 trl: TRL run failed (exit 1): boom" in printed
    assert "skipped" not in printed
