"""A run's adapter (lora.save: adapter, grpo.train.models.save_adapter) served by vLLM as a LoRA
request on its base: the engine's log-probs of a prompt's tokens are the peft policy's."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from grpo.train.models import apply_lora, save_adapter
from tests.vllm.models import assert_same_logprobs, save

pytestmark = pytest.mark.vllm


def test_vllm_serves_a_saved_adapter_as_the_policy_it_was(tmp_path):
    import vllm
    from vllm.lora.request import LoRARequest

    from grpo.vllm.engine import environment

    base = save("llama", tmp_path / "base")
    policy = apply_lora(AutoModelForCausalLM.from_pretrained(base), 4, 8, "all-linear")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:  # peft starts B at 0: an adapter that changes nothing would prove nothing
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    save_adapter(policy, tmp_path / "adapter")

    ids = torch.randint(1, 30, (1, 24), generator=g)
    with torch.no_grad():
        logits = policy(input_ids=ids).logits[0, :-1].float()
        with policy.disable_adapter():
            base_logits = policy(input_ids=ids).logits[0, :-1].float()
    want = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0]
    untouched = torch.log_softmax(base_logits, -1).gather(-1, ids[0, 1:, None])[:, 0]

    environment(1)
    llm = vllm.LLM(
        model=str(base),
        skip_tokenizer_init=True,
        dtype=torch.float32,
        max_model_len=64,
        seed=0,
        enforce_eager=True,
        enable_lora=True,
        max_lora_rank=8,
        max_loras=1,
    )
    params = vllm.SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False)
    prompt = [{"prompt_token_ids": ids[0].tolist()}]

    def served(lora=None):
        (out,) = llm.generate(prompt, params, use_tqdm=False, lora_request=lora)
        return torch.tensor([s[t].logprob for s, t in zip(out.prompt_logprobs[1:], ids[0, 1:].tolist())])

    got = served(LoRARequest("run", 1, str(tmp_path / "adapter")))
    assert_same_logprobs(got, want)
    assert not torch.allclose(want, untouched, atol=1e-2)  # the adapter moves the log-probs
    assert_same_logprobs(served(), untouched)
