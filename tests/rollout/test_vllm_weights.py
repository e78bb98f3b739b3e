"""`grpo.vllm.engine.policy_weights`, what the vLLM engine is fed, without vLLM: Hugging Face
names, the tied head added, a LoRA policy merged, and FSDP2 shards whole (two processes;
tests/vllm check the engine itself)."""

import copy

import pytest
import torch

from grpo.tasks.tiny import char_tokenizer
from grpo.vllm.engine import policy_weights
from tests.vllm.models import ALPHABET, build


def tiny(tied: bool):
    """The vLLM tests' models: a tied Qwen2 (with QKV biases) or an untied Llama."""
    return build("qwen2" if tied else "llama", char_tokenizer(ALPHABET))


@pytest.mark.parametrize("tied", [True, False])
def test_the_weights_are_the_state_dict_s_with_the_tied_head_added(tied):
    model = tiny(tied)
    weights = dict(policy_weights(model))
    expected = dict(model.state_dict())
    expected.setdefault("lm_head.weight", model.get_input_embeddings().weight)
    assert weights.keys() == expected.keys()
    assert all(torch.equal(weights[k], expected[k]) for k in expected)


def test_a_lora_policy_gives_its_merged_weights_and_stays_unmerged():
    peft = pytest.importorskip("peft")
    model = tiny(True)
    lora = peft.get_peft_model(copy.deepcopy(model), peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"]))
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.normal_()
    weights = dict(policy_weights(lora))
    assert weights.keys() == dict(policy_weights(model)).keys()
    merged = copy.deepcopy(lora).merge_and_unload().state_dict()
    for name, tensor in weights.items():
        expected = merged.get(name, merged["model.embed_tokens.weight"] if name == "lm_head.weight" else None)
        torch.testing.assert_close(tensor, expected)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.allclose(weights[q], model.state_dict()[q])  # the adapter counted
    assert not any(getattr(m, "merged", False) for m in lora.modules())  # the policy left unmerged


@pytest.mark.torchrun
def test_fsdp2_shards_come_whole_in_every_process(tmp_path):
    """Two processes (torchrun, gloo), the policy sharded as a run shards it: inside the
    gathering (where the Sampler prepares its decoder) and outside it (DTensors, gathered by
    full_tensor), every process gets every weight whole, equal to the unsharded model's."""
    from tests.train.test_distributed import torchrun

    run = torchrun("-m", "tests.rollout.test_vllm_weights", str(tmp_path))
    assert run.returncode == 0, run.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0.ok", "1.ok"]


def _worker(out: str) -> None:
    """One process of the torchrun launch above."""
    from pathlib import Path

    from torch.distributed.tensor import DTensor

    from grpo.infra.distributed import init_world

    world = init_world(torch.device("cpu"), "gloo")
    try:
        model = tiny(True)
        expected = {k: v.clone() for k, v in policy_weights(model)}
        sharded = world.shard(model)
        assert any(isinstance(p, DTensor) for p in sharded.parameters())

        def check(weights):
            assert weights.keys() == expected.keys(), weights.keys() ^ expected.keys()
            assert not any(isinstance(t, DTensor) for t in weights.values())
            assert all(torch.equal(weights[k], expected[k]) for k in expected)

        check(dict(policy_weights(sharded)))
        with world.gathered(sharded):  # read inside: the whole tensors are freed when it ends
            check(dict(policy_weights(sharded)))
        (Path(out) / f"{world.rank}.ok").write_text("")
    finally:
        world.close()


if __name__ == "__main__":
    import sys

    _worker(sys.argv[1])


@pytest.mark.parametrize("longest", [None, 12])
def test_the_weight_check_scores_a_sequence_the_engine_can_hold(longest):
    """The check's fixed sequence is cut to the engine's max_model_len: a run of short prompts
    and completions builds an engine that refuses a longer one. An engine that answers the
    policy's own log-probs passes, one that answers others fails."""
    from grpo.vllm.engine import LocalEngine, StaleWeights

    model = tiny(False).eval()
    engine = object.__new__(LocalEngine)  # no vLLM: the engine's answer is the policy's own
    engine.vocab, engine.longest, asked = model.config.vocab_size, longest, []

    def prompt_logprobs(ids, shift=0.0):
        asked.append(len(ids))
        if longest is not None and len(ids) > longest:
            raise ValueError(f"{len(ids)} tokens exceed max_model_len {longest}")  # as vLLM refuses
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits[0, :-1].float()
        return (logits.log_softmax(-1).gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1) + shift).tolist()

    engine.prompt_logprobs = prompt_logprobs
    assert engine.check(model, tolerance=1e-4) <= 1e-4
    assert asked == [longest or 32]
    engine.prompt_logprobs = lambda ids: prompt_logprobs(ids, shift=0.5)
    with pytest.raises(StaleWeights):
        engine.check(model, tolerance=1e-4)
