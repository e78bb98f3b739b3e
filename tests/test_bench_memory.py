"""benchmarks/bench_memory.py on the tiny workload (no TRL): every variant measured per
phase, each peak the highest of its phases, each floor what its states hold."""

import json

import pytest

from benchmarks import bench_memory
from grpo.infra.allocator import library


def _tiny(folder, variants: str, *options: str) -> dict:
    """bench_memory's results on the tiny workload, 2 steps, without TRL."""
    argv = ["--workload", "tiny", "--steps", "2", "--skip-trl", "--variants", variants, "--results", str(folder)]
    assert bench_memory.main([*argv, *options]) == 0
    (path,) = folder.glob("memory-*.json")
    return json.loads(path.read_text())["workloads"]["tiny"]


def test_every_variant_has_its_phases_and_its_floor(tmp_path, capsys):
    tiny = _tiny(tmp_path, "exact,exact_glibc,savers")
    p = tiny["parameters"]
    for variant in ("exact", "savers"):
        run = tiny["runs"][variant]
        assert set(bench_memory.PHASES) <= set(run["phases"]) and run["peak_mb"] == max(run["phases"].values())
        assert 100 < run["runtime_mb"] < run["phases"]["update"] and run["median_step_s"] > 0
        # The runtime counts the model's code and the tokenizer, read before them as "bare".
        assert 100 < run["runtime_bare_mb"] < run["runtime_mb"]
    # Each run under the allocator the command would pick, or the one the variant names.
    assert tiny["runs"]["exact_glibc"]["allocator"] == "system"
    assert tiny["runs"]["exact"]["allocator"] == ("mimalloc" if library() else "system")
    exact, savers = tiny["floors"]["exact"], tiny["floors"]["savers"]
    assert exact["weights"] + exact["gradients"] + exact["moments"] + exact["reference"] == 20 * p / (1 << 20)
    assert (
        savers["gradients"] == 4 * tiny["largest_tensor"] / (1 << 20) and savers["reference"] == exact["reference"] / 2
    )
    assert savers["moments"] < exact["moments"] / 3
    out = capsys.readouterr().out
    assert "| exact |" in out and "| savers |" in out and "TRL not measured: --skip-trl" in out


def test_live_counts_the_states_and_what_the_update_adds(tmp_path, capsys):
    """--live: the tensors live at the last update's peak hold at least every state of the
    exact path (weights, reference, moments, and all the gradients at the backward's end) and
    at least the gradients more than those alive as the update starts; the table says so."""
    tiny = _tiny(tmp_path, "exact", "--live")
    run, floor = tiny["runs"]["exact"], tiny["floors"]["exact"]
    states = floor["total"] - floor["runtime"]
    live = run["live"]
    assert live["peak_mb"] >= max(states, live["at_start_mb"] + floor["gradients"])
    assert live["at_start_mb"] < states  # no gradient yet
    # What the profiler saw is part of what was live (the reference's weights, untouched, are not in it).
    seen = live["profiled_at_peak_mb"]
    assert seen["optimizer_state"] >= floor["moments"] - 0.01 and sum(seen.values()) <= live["peak_mb"] + 0.01
    assert "| live + runtime MB | live / floor |" in capsys.readouterr().out


@pytest.mark.slow
def test_qlora_holds_its_base_in_4_bits_and_prints_its_peak_against_lora(tmp_path, capsys):
    """The lora and qlora variants: the same adapter's states, no reference, the base's linear
    layers in nf4 in qlora's floor; the line of qlora's peak against lora's."""
    tiny = _tiny(tmp_path, "lora,qlora")
    lora, qlora = tiny["floors"]["lora"], tiny["floors"]["qlora"]
    assert lora["reference"] == qlora["reference"] == 0 and 0 < qlora["gradients"] == lora["gradients"]
    assert qlora["moments"] == 2 * lora["gradients"] and qlora["weights"] < lora["weights"]
    assert all(tiny["runs"][v]["peak_mb"] == max(tiny["runs"][v]["phases"].values()) for v in ("lora", "qlora"))
    assert "qlora against lora (fp32 base): peak" in capsys.readouterr().out


def test_replan_predicts_an_earlier_runs_variants_again(tmp_path, capsys):
    """--replan: each run of an earlier results file gets grpo plan's prediction again, at the
    completion length that run recorded, against its measured peak; nothing is measured."""
    earlier = {
        "date": "2026-12-06T00:00:00",
        "steps": 2,
        "workloads": {"tiny": {"runs": {"exact": {"peak_mb": 500.0, "plan": {"completion_tokens": 7}}}}},
    }
    path = tmp_path / "memory-earlier.json"
    path.write_text(json.dumps(earlier))
    assert bench_memory.main(["--replan", str(path), "--results", str(tmp_path / "out")]) == 0
    (written,) = (tmp_path / "out").glob("memory-earlier-replanned-*.json")
    plan = json.loads(written.read_text())["workloads"]["tiny"]["runs"]["exact"]["plan"]
    assert plan["completion_tokens"] == 7 and plan["ratio"] == plan["peak_mb"] / 500.0 > 0
    assert "| exact |" in capsys.readouterr().out
