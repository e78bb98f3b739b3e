"""benchmarks/gpu_check.py, at the tiny shape on the CPU: both samplers run, fast synchronous and
asynchronous (hf has no asynchronous run), every number is there."""

import pytest
import json

import torch

from benchmarks import gpu_check
from tests.helpers import FORWARD

PROMPTS, GROUP, TOKENS = 2, 4, 8


@pytest.mark.slow
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
    assert [(r["sampler"], r["max_staleness"]) for r in rows] == [("fast", 1), ("fast", 0), ("hf", 0)]
    assert results["skipped"] == [
        {"sampler": "hf", "max_staleness": 1, "why": "transformers' generate returns no log-probs"}
    ]
    for r in rows:
        for key in ("time/step", "time/generate", "time/update", "completion_tokens_per_s", "memory/peak_mb", "wall_s"):
            assert r[key] > 0, (r["sampler"], key)
        assert r["time/score"] >= 0
        assert r["steps_timed"] == 1  # step 1 is warm-up
        assert r["tokens_per_step"] == PROMPTS * GROUP * TOKENS  # EOS suppressed: every completion is full length
        assert [s["step"] for s in r["per_step"]] == [1, 2]
        assert r["step_tokens_per_s"] > 0
    stepped_ahead, synchronous = rows[0], rows[1]
    assert (
        stepped_ahead["async/staleness"] == 1 and stepped_ahead["async/dropped"] == 0
    )  # step 2 trained step 1's weights' batch
    assert stepped_ahead["async/queue_wait_s"] >= 0 and stepped_ahead["per_step"][1]["async/staleness"] == 1
    assert not any(k.startswith("async/") for k in synchronous)
    assert results["settings"]["device"] == "cpu" and results["failed"] == []
    packed = results["packed_attention"]
    assert packed["varlen_kernel"] is False and "varlen" not in packed  # no such kernel on a CPU
    for way in ("mask", "per segment"):
        assert packed[way]["s"] > 0, (way, packed[way])  # max_difference: relative to the outputs' largest
        assert packed[way]["max_difference"] < FORWARD * torch.finfo(torch.float32).eps, (way, packed[way])

    printed = capsys.readouterr().out
    table = printed[printed.index("sampler  K  s/step") :]
    for r in rows:
        assert f"{r['sampler']}  " in table and f"{r['time/step']:.3f}" in table
    assert "fast K=1: " in printed and "x the synchronous step rate (staleness 1.00, 0 dropped)" in printed
    assert f"results: {path}" in printed
    assert "packed attention, 2 bins of 84 slots" in printed and "(no varlen call on this device and dtype)" in printed


def test_reward_and_vocabulary():
    assert gpu_check.reward(["p", "p", "p"], ["02", "13", ""]) == [1.0, 0.0, 0.0]
    chars = gpu_check.vocabulary(gpu_check.SHAPES["qwen0.5b"]["vocab_size"])
    assert len(set(chars)) == len(chars) == 151936 - 4
    assert chars.startswith(gpu_check.ALPHABET)


def test_staleness_runs_asynchronous_first_and_hf_only_synchronous():
    planned, skipped = gpu_check.runs(gpu_check.parse_args(["--samplers", "hf,fast", "--staleness", "0,2,1"]))
    assert planned == [("hf", 0), ("fast", 2), ("fast", 1), ("fast", 0)]
    assert [(s["sampler"], s["max_staleness"]) for s in skipped] == [("hf", 2), ("hf", 1)]


def test_vllm_runs_last():
    """Its engine stays for the process (GPU memory too): the other samplers run before it."""
    assert gpu_check.parse_args(["--samplers", "vllm,hf,fast"]).samplers == ["hf", "fast", "vllm"]
