"""The benchmarks' vllm paths on the CPU, at tiny sizes: benchmarks/bench_vllm.py (generation
with fixed lengths, and a GRPO step, with vllm; tests/test_bench_vllm.py runs fast and hf) and benchmarks/gpu_check.py (the check a
GPU machine runs, here on the CPU path with vllm)."""

import json

import pytest

from benchmarks import bench_vllm, gpu_check

pytestmark = [pytest.mark.vllm, pytest.mark.slow]  # each starts processes

TOKENS = 8


def test_bench_vllm_generation_and_step(tmp_path):
    argv = ["--shape", "tiny", "--samplers", "vllm", "--parts", "generate,step", "--lengths", "fixed"]  # fast: tests/
    argv += ["--max-new-tokens", str(TOKENS), "--repeats", "1", "--steps", "2"]
    assert bench_vllm.main([*argv, "--cache-dir", str(tmp_path / "cache"), "--results", str(tmp_path)]) == 0

    (path,) = tmp_path.glob("vllm-*.json")
    results = json.loads(path.read_text())
    assert list(results["generate"]) == list(results["step"]) == ["vllm"]
    vllm = results["generate"]["vllm"]["modes"]["fixed"]
    assert all(c["tokens"] == 4 * 8 * TOKENS for c in vllm["calls"])  # min_tokens: every completion full length
    assert vllm["start_s"] > 0 and vllm["tokens_per_s"] > 0
    for name, step in results["step"].items():
        assert step["median_step_s"] > 0 and step["median_generate_s"] > 0, name
        assert 0 < step["completion_tokens_per_step"] <= 4 * 8 * TOKENS, name
        assert [m["step"] for m in step["steps"]] == [1, 2]


def test_gpu_check_with_vllm_on_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path))
    argv = ["--shape", "tiny", "--steps", "2", "--prompts", "2", "--group-size", "4", "--max-new-tokens", str(TOKENS)]
    results = gpu_check.main([*argv, "--device", "cpu", "--samplers", "vllm,fast", "--autocast", "off"], progress=False)
    assert results["failed"] == []
    rows = results["results"]
    # vllm last, whatever the order asked; each sampler asynchronous (K = 1, the default's) first
    assert [(r["sampler"], r["max_staleness"]) for r in rows] == [("fast", 1), ("fast", 0), ("vllm", 1), ("vllm", 0)]
    for r in rows:
        assert r["tokens_per_step"] == 2 * 4 * TOKENS, r["sampler"]  # EOS suppressed in both
        assert r["completion_tokens_per_s"] > 0 and r["time/update"] > 0
        assert r["step_tokens_per_s"] > 0 and r.get("async/staleness", 1) == 1
