"""benchmarks/gpu_check.py, at the tiny shape on the CPU: both samplers run, every number is there."""

import json

from benchmarks import gpu_check

PROMPTS, GROUP, TOKENS = 2, 4, 8


def test_gpu_check_tiny_on_cpu(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OUT", str(tmp_path))
    argv = [
        "--shape",
        "tiny",
        "--steps",
        "2",
        "--prompts",
        str(PROMPTS),
        "--group-size",
        str(GROUP),
        "--max-new-tokens",
        str(TOKENS),
        "--device",
        "cpu",
        "--samplers",
        "fast,hf",
    ]
    returned = gpu_check.main(argv, progress=False)

    (path,) = tmp_path.glob("gpu-check-*.json")
    results = json.loads(path.read_text())
    assert results == json.loads(json.dumps(returned))
    rows = results["results"]
    assert [r["sampler"] for r in rows] == ["fast", "hf"]
    for r in rows:
        for key in ("time/step", "time/generate", "time/update", "completion_tokens_per_s", "memory/peak_mb", "wall_s"):
            assert r[key] > 0, (r["sampler"], key)
        assert r["time/score"] >= 0
        assert r["steps_timed"] == 1  # step 1 is warm-up
        assert r["tokens_per_step"] == PROMPTS * GROUP * TOKENS  # EOS suppressed: every completion is full length
        assert [s["step"] for s in r["per_step"]] == [1, 2]
    assert results["settings"]["device"] == "cpu" and results["failed"] == []

    printed = capsys.readouterr().out
    table = printed[printed.index("sampler  s/step") :]
    for r in rows:
        assert f"{r['sampler']}  " in table and f"{r['time/step']:.3f}" in table
    assert f"results: {path}" in printed


def test_reward_and_vocabulary():
    assert gpu_check.reward(["p", "p", "p"], ["02", "13", ""]) == [1.0, 0.0, 0.0]
    chars = gpu_check.vocabulary(gpu_check.SHAPES["qwen0.5b"]["vocab_size"])
    assert len(set(chars)) == len(chars) == 151936 - 4
    assert chars.startswith(gpu_check.ALPHABET)


def test_vllm_runs_last():
    """Its engine stays for the process (GPU memory too): the other samplers run before it."""
    assert gpu_check.parse_args(["--samplers", "vllm,hf,fast"]).samplers == ["hf", "fast", "vllm"]
