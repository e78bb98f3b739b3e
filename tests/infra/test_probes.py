"""The one-time probes that decide whether a faster path gives a model's own numbers
(grpo.infra.probes): tolerances in rounding steps of the dtype the model computes in, one
verdict for every process, and each probe's fallback, with one warning line, when the probed
thing is planted broken: the attention switch's registration with transformers, a model whose
code branches on the implementation's name (GPT-2's reorder_and_upcast_attn), chunked
attention, the varlen kernel (at the model's head size, its gradients too), the forward
layouts and the critic's packing."""

import json

import pytest
import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM

from grpo.infra import attention, probes
from grpo.infra.distributed import SingleProcess
from grpo.infra.packing import windowed
from grpo.train import layouts
from grpo.train.layouts import PACKED, PADDED, SHARED, decide_layouts
from grpo.train.models import enable_checkpointing
from grpo.train.networks import backbone_packs
from tests.infra.test_attention import reference_varlen
from tests.train.test_packing import SHAPES, build

BF16_EPS = torch.finfo(torch.bfloat16).eps


def warnings(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("grpo: warning:")]


# ---- the tolerance --------------------------------------------------------------------------


def test_a_difference_is_judged_in_rounding_steps_of_the_dtype_times_the_values_scale():
    """Log-probs near -20 rounded to bf16 move by up to a sixteenth of a nat (more than
    the absolute 5e-2 once used): close in bf16, not in float32; a difference of a nat is close
    in neither. The scale is the values' where compared; a NaN there is never close."""
    want = -torch.linspace(0.5, 20.0, 64)
    rounded = want.to(torch.bfloat16).float()
    assert (rounded - want).abs().max() > 5e-2
    assert probes.close(rounded, want, torch.bfloat16)
    assert not probes.close(rounded, want, torch.float32)
    assert not probes.close(want + 1.0, want, torch.bfloat16)
    assert probes.close(want * (1 + 1e-6), want, torch.float32)
    hidden = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(0))
    where = torch.tensor([[1, 1, 0], [1, 0, 0]])
    planted = hidden.clone()
    planted[0, 2] = float("nan")
    assert probes.close(planted, hidden, torch.float32, where=where)  # outside `where`: not read
    planted[0, 1, 3] = float("nan")
    assert not probes.close(planted, hidden, torch.float32, where=where)
    assert probes.tolerance(torch.bfloat16) > probes.tolerance(torch.float16) > probes.tolerance(torch.float32)


def test_float32_matrix_products_in_less_precision_round_as_that_precision(monkeypatch):
    assert probes.rounding(torch.float32) == torch.finfo(torch.float32).eps
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "high")
    assert probes.rounding(torch.float32) == 2.0**-10  # TF32
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "medium")
    assert probes.rounding(torch.float32) == BF16_EPS
    assert probes.rounding(torch.bfloat16) == BF16_EPS


# ---- the attention switch -------------------------------------------------------------------


def test_a_registration_that_fails_leaves_the_model_on_its_own_attention_with_one_warning(monkeypatch, capsys):
    model = build("llama")
    was = model.config._attn_implementation

    def refuses(*args, **kwargs):
        raise ValueError("this transformers takes no new attention functions")

    monkeypatch.setattr(transformers.AttentionInterface, "register", refuses)
    assert not attention.enable(model)
    assert model.config._attn_implementation == was and not getattr(model, attention._ENABLED, False)
    (line,) = warnings(capsys)
    assert "did not register grpo_segments_" in line and "this transformers takes no" in line
    ids = torch.tensor([[3, 4, 5]])
    assert torch.isfinite(model(input_ids=ids).logits).all()  # it runs as it did


def gpt2_upcast(dtype: torch.dtype = torch.float32):
    """A tiny GPT-2 whose eager attention takes its reorder-and-upcast path: GPT-2 tests
    `config._attn_implementation == "eager"` to take it."""
    config = AutoConfig.for_model(
        "gpt2", n_embd=32, n_layer=2, n_head=4, n_positions=64, vocab_size=40, reorder_and_upcast_attn=True
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.3)
    return model.to(dtype)


def padded_hidden(model) -> torch.Tensor:
    probe = attention._Probe.of(model)
    return probe.outputs(model)[0][probe.padded_real]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpt2_reorder_and_upcast_keeps_its_own_numbers_under_the_switch(dtype, monkeypatch):
    """Under grpo's name GPT-2 leaves its reorder-and-upcast path: the switch is kept only where
    its padded pass still gives what the path gave."""
    model = gpt2_upcast(dtype)
    upcast = type(model.transformer.h[0].attn)._upcast_and_reordered_attn
    taken = []

    def counted(self, *args, **kwargs):
        taken.append(1)
        return upcast(self, *args, **kwargs)

    monkeypatch.setattr(type(model.transformer.h[0].attn), "_upcast_and_reordered_attn", counted)
    original = padded_hidden(model)
    assert taken  # the path the name selects ran
    if attention.enable(model):
        assert probes.close(padded_hidden(model), original, dtype)
    else:
        assert model.config._attn_implementation == "eager"


def test_a_model_whose_code_computes_otherwise_under_another_name_is_not_switched(monkeypatch, capsys):
    """Planted: GPT-2's "eager"-only path gives other numbers than its eager function (as a
    branch on the name may): under grpo's name its padded pass would change, so it stays."""
    model = gpt2_upcast()
    upcast = type(model.transformer.h[0].attn)._upcast_and_reordered_attn

    def other(self, *args, **kwargs):
        out, weights = upcast(self, *args, **kwargs)
        return out * 1.5, weights

    monkeypatch.setattr(type(model.transformer.h[0].attn), "_upcast_and_reordered_attn", other)
    assert not attention.enable(model)
    assert model.config._attn_implementation == "eager" and not getattr(model, attention._ENABLED, False)
    (line,) = warnings(capsys)
    assert "GPT2LMHeadModel's packed passes attend through the mask" in line and "branches on the name" in line


def test_a_wrapped_implementation_that_gives_other_values_is_not_kept(monkeypatch, capsys):
    """Planted: what the switched model calls for its plain passes returns other values."""
    model = build("llama")
    real = attention._base_function

    def wrong(name, module):
        function = real(name, module)
        return lambda *args, **kwargs: (function(*args, **kwargs)[0] * 0.5, None)

    monkeypatch.setattr(attention, "_base_function", wrong)
    assert not attention.enable(model)
    assert model.config._attn_implementation == "sdpa"
    assert len(warnings(capsys)) == 1


def test_segments_are_compared_with_the_original_implementation_through_the_mask(monkeypatch, capsys):
    """Planted: by segments the switched model's outputs move (while its padded pass, and
    anything through the mask under the new name, stay): refused, with one warning line."""
    model = build("llama")
    real = attention._attend
    monkeypatch.setattr(attention, "_attend", lambda *args: real(*args) * 1.01)
    assert not attention.enable(model)
    (line,) = warnings(capsys)
    assert "by segments its packed pass differs" in line


def llama4(chunk: int | None):
    config = AutoConfig.for_model(
        "llama4_text",
        **SHAPES["llama"][1],
        intermediate_size_mlp=64,
        head_dim=8,
        num_local_experts=2,
        vocab_size=40,
        pad_token_id=0,
        attention_chunk_size=chunk,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


def test_chunked_attention_is_windowed_and_never_packed(capsys):
    """Llama 4's chunks (8192 positions, its default) are far longer than a probe: only the
    config can tell that a packed pass would not cut them. Without chunks it packs."""
    chunked = llama4(8192)
    assert windowed(chunked)
    assert decide_layouts(chunked, False).plain == SHARED
    assert not attention.enable(chunked) and not getattr(chunked, attention._ENABLED, False)
    assert warnings(capsys) == []  # by capability: nothing to warn of
    plain = llama4(None)
    assert not windowed(plain)
    assert decide_layouts(plain, False).plain == PACKED


# ---- the varlen kernel ----------------------------------------------------------------------


def _scale_of_64(q, k, v, *args, scale=None, **kwargs):
    """A kernel right at head size 64 only: its default scale is 64's."""
    return reference_varlen(q, k, v, *args, scale=64**-0.5 if scale is None else scale, **kwargs)


class _WrongBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * 1.5


def _wrong_backward(q, k, v, *args, **kwargs):
    """A kernel whose outputs are right and whose queries' gradients are not."""
    return reference_varlen(_WrongBackward.apply(q), k, v, *args, **kwargs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_varlen_probe_runs_at_the_model_s_head_size_with_a_backward(dtype):
    cpu = torch.device("cpu")
    for heads, head_dim in ((4, 64), (6, 128), (3, 16)):
        assert attention._varlen_serves(reference_varlen, cpu, dtype, heads=heads, head_dim=head_dim)
    assert attention._varlen_serves(_scale_of_64, cpu, dtype, heads=4, head_dim=64)
    assert not attention._varlen_serves(_scale_of_64, cpu, dtype, heads=4, head_dim=128)
    problem = attention._varlen_problem(_wrong_backward, cpu, dtype, heads=4, head_dim=64)
    assert problem is not None and "gradients of the queries" in problem


def test_the_varlen_probe_runs_inside_the_first_packed_pass_whatever_its_mode():
    """The probe runs inside a layer's forward, the first time one meets the kernel: under the
    no-grad passes' inference mode, and inside a checkpointed layer, its backward must still run
    (and a right kernel pass)."""
    cpu = torch.device("cpu")
    with torch.inference_mode():
        assert attention._varlen_serves(reference_varlen, cpu, torch.float32)
    with torch.no_grad():
        assert attention._varlen_serves(reference_varlen, cpu, torch.float32)
    verdicts = []

    def layer(x):
        verdicts.append(attention._varlen_serves(reference_varlen, cpu, torch.float32))
        return x * 2

    x = torch.ones(3, requires_grad=True)
    torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False).sum().backward()
    assert verdicts[0] and torch.equal(x.grad, torch.full((3,), 2.0))


def test_a_varlen_kernel_that_fails_its_probe_is_not_used_with_one_warning(capsys):
    cpu = torch.device("cpu")

    def broken(*args, **kwargs):
        raise RuntimeError("no kernel image is available")

    assert attention._checked_varlen(reference_varlen, cpu, torch.bfloat16, 4, 64) is reference_varlen
    assert attention._checked_varlen(None, cpu, torch.bfloat16, 4, 64) is None  # torch has none
    assert warnings(capsys) == []
    assert attention._checked_varlen(broken, cpu, torch.bfloat16, 4, 64) is None
    assert attention._checked_varlen(_wrong_backward, cpu, torch.bfloat16, 4, 128) is None
    first, second = warnings(capsys)
    assert "no kernel image" in first and "gradients" in second


# ---- the layouts and the critic -------------------------------------------------------------


def _nudged(real, steps: float):
    """`packed_positions` with each completion token's logit raised by `steps` bf16 rounding
    steps of the log-probs' scale: what another kernel's summation order does on a GPU."""

    def packed_positions(model, batch, share_prompts, read, **kwargs):
        out = real(model, batch, share_prompts, read, **kwargs)
        ids = torch.nn.functional.one_hot(batch.completion_ids, out.shape[-1]).to(out.dtype)
        return out + steps * BF16_EPS * 10.0 * ids

    return packed_positions


def test_half_precision_layouts_allow_its_rounding_and_refuse_more_with_one_warning(monkeypatch, capsys):
    model = build("llama").to(torch.bfloat16)
    real = layouts.packed_positions
    monkeypatch.setattr(layouts, "packed_positions", _nudged(real, 2))  # more than 5e-2 a token
    assert decide_layouts(model, False).plain == PACKED
    assert warnings(capsys) == []
    model = build("llama").to(torch.bfloat16)
    monkeypatch.setattr(layouts, "packed_positions", _nudged(real, 100))
    assert decide_layouts(model, False).plain == SHARED
    (line,) = warnings(capsys)
    assert "train.layout: LlamaForCausalLM's passes run shared (packed: gives other log-probs" in line


def _rounded_states(real, steps: float):
    def completion_states(backbone, batch, packed):
        out = real(backbone, batch, packed)
        return out * (1 + steps * BF16_EPS) if packed else out

    return completion_states


def test_the_critic_s_probe_allows_its_dtype_s_rounding_and_refuses_more_with_one_warning(monkeypatch, capsys):
    from grpo.train import networks

    backbone = build("llama").model.to(torch.bfloat16)
    real = networks.completion_states
    monkeypatch.setattr(networks, "completion_states", _rounded_states(real, 2))  # a relative 1e-4 refused it
    assert backbone_packs(backbone)
    monkeypatch.setattr(networks, "completion_states", _rounded_states(real, 100))
    assert not backbone_packs(backbone)
    (line,) = warnings(capsys)
    assert "the critic's LlamaModel runs padded (packed: gives other hidden states" in line


# ---- one verdict for every process ------------------------------------------------------------


class _TwoProcesses(SingleProcess):
    """A world of two processes, the other one's probes all finding `other` (a fake: every
    collective is a sum with its flag)."""

    world_size = 2

    def __init__(self, other: bool):
        self.other = other
        self.sums = 0

    def sum(self, x):
        self.sums += 1
        return x + int(self.other)


def test_a_layout_is_taken_only_where_every_process_found_it_serves(capsys):
    model = build("llama")
    assert enable_checkpointing(model)
    world = _TwoProcesses(other=True)
    decided = decide_layouts(model, True, world=world)
    assert (decided.plain, decided.checkpointed) == (PACKED, PACKED) and getattr(model, attention._ENABLED)
    assert world.sums == 4  # checkpointing, packed in each mode, the attention switch
    model = build("llama")
    assert enable_checkpointing(model)
    world = _TwoProcesses(other=False)
    decided = decide_layouts(model, True, world=world)  # the other declines everything: every row in full
    assert (decided.plain, decided.checkpointed) == (PADDED, PADDED)
    assert not getattr(model, attention._ENABLED, False)
    lines = warnings(capsys)
    assert len(lines) == 2 and "another process's probe declined it" in lines[1]
    model = build("llama")
    assert not attention.enable(model, _TwoProcesses(other=False))
    assert model.config._attn_implementation == "sdpa"
    assert not backbone_packs(build("llama").model, _TwoProcesses(other=False))


@pytest.mark.torchrun
def test_two_processes_whose_probes_disagree_take_the_same_verdicts(tmp_path):
    """torchrun, gloo, 2 processes; process 1's packed layout, attention registration and
    critic packing planted broken (tests/infra/probe_worker.py): both take the same verdicts,
    and neither waits for the other."""
    from tests.train.test_distributed import torchrun

    out = tmp_path / "verdicts.json"
    run = torchrun("-m", "tests.infra.probe_worker", str(out))
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads(out.read_text()) == [[["shared", "padded"], False, False]] * 2
