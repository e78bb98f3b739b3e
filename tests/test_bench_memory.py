"""benchmarks/bench_memory.py on the tiny workload (no TRL): every variant measured per
phase, each peak the highest of its phases, each floor what its states hold."""

import json

from benchmarks import bench_memory
from grpo.infra.allocator import library


def test_every_variant_has_its_phases_and_its_floor(tmp_path, capsys):
    assert (
        bench_memory.main(
            [
                "--workload",
                "tiny",
                "--steps",
                "2",
                "--skip-trl",
                "--variants",
                "exact,exact_glibc,savers",
                "--results",
                str(tmp_path),
            ]
        )
        == 0
    )
    (path,) = tmp_path.glob("memory-*.json")
    tiny = json.loads(path.read_text())["workloads"]["tiny"]
    p = tiny["parameters"]
    for variant in ("exact", "savers"):
        run = tiny["runs"][variant]
        assert set(bench_memory.PHASES) <= set(run["phases"]) and run["peak_mb"] == max(run["phases"].values())
        assert 100 < run["runtime_mb"] < run["phases"]["update"] and run["median_step_s"] > 0
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
