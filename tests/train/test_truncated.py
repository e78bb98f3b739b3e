"""loss.mask_truncated_completions: completions cut off at max_new_tokens leave the loss."""

import torch
from transformers import AutoModelForCausalLM

import grpo


def test_truncated_completions_leave_the_loss_when_asked(make_config, tiny_model, tmp_path):
    # Every completion is cut off (EOS suppressed up to max_new_tokens): nothing is trained.
    cut = make_config(
        output_dir=str(tmp_path / "cut"),
        train={"steps": 2, "lr": 1e-2},
        loss={"beta": 0.04, "mask_truncated_completions": True},
    )
    result = grpo.train(cut, progress=False)
    assert [m["frac_truncated"] for m in result.metrics] == [1.0, 1.0]
    assert all(m["tokens/trained"] == 0 and m["tokens/completion"] == 4 * 8 * 8 for m in result.metrics)
    initial = AutoModelForCausalLM.from_pretrained(tiny_model).state_dict()
    final = AutoModelForCausalLM.from_pretrained(result.final_dir).state_dict()
    assert all(torch.equal(initial[k], final[k]) for k in initial)

    kept = grpo.train(make_config(output_dir=str(tmp_path / "kept"), train={"steps": 1, "lr": 1e-2}), progress=False)
    assert kept.metrics[0]["frac_truncated"] == 1.0 and kept.metrics[0]["tokens/trained"] == 4 * 8 * 8


def test_only_the_cut_off_completions_leave_it(make_config, tmp_path):
    """With EOS allowed some completions end early: those are trained on, the others not."""
    config = make_config(
        rollout={"group_size": 8, "prompts_per_step": 4, "max_new_tokens": 3, "min_new_tokens": 0},
        train={"steps": 3, "lr": 1e-2},
        loss={"beta": 0.04, "mask_truncated_completions": True},
    )
    metrics = grpo.train(config, progress=False).metrics
    mixed = [m for m in metrics if 0 < m["frac_truncated"] < 1]
    assert mixed, [m["frac_truncated"] for m in metrics]
    for m in mixed:
        assert 0 < m["tokens/trained"] < m["tokens/completion"]
        # a cut-off completion has all 3 tokens: the trained ones are the others'
        assert m["tokens/completion"] - m["tokens/trained"] == round(m["frac_truncated"] * 32) * 3
