"""The networks a run holds beside the policy: the reference and the critic.

GRPO holds three models (policy, reference, reward: a reward *function* here, or a reward
model); PPO holds four (plus the critic, a value model). The reference is a frozen copy of
the policy, or, with LoRA, the same weights with the adapter switched off (no second copy).
With beta = 0 there is no reference at all.
"""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Protocol

import torch
from torch import Tensor, nn

from grpo.infra import attention as segments
from grpo.errors import UserError, first_line
from grpo.infra.devices import native
from grpo.infra.hf import load_error, quiet_loading, torch_dtype
from grpo.infra.packing import mask_dtype
from grpo.infra.probes import agreed, close, warn
from grpo.rollout import Rollout
from grpo.train.layouts import PACKED, Layout, SharedPrompt, padded_pass, policy_logprobs, probe_batch, windowed
from grpo.train.packed_layout import packed_positions


# ---- the reference ----------------------------------------------------------------------------


class Reference(Protocol):
    held: bool  # whether a network is held for it (for the "models held" count)
    networks: list  # the networks it holds beside the policy (for the parameter count)
    runs_policy: bool  # whether its passes run the policy's own weights (sharded: gathered for them)

    def logprobs(self, batch: Rollout, temperature: float, repetition_penalty: float = 1.0) -> Tensor | None: ...
    def reset_to(self, policy) -> None: ...
    def state_dict(self) -> dict: ...
    def load_state_dict(self, state: dict) -> None: ...


class NoReference:
    """beta = 0: no KL term, so no reference model is loaded."""

    held = False
    networks: list = []
    runs_policy = False

    def logprobs(self, batch, temperature, repetition_penalty=1.0):
        return None

    def reset_to(self, policy):
        pass

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


class FrozenCopy:
    """A frozen copy of the policy's weights.

    With `matmul_dtype` (train.autocast), the copy's linear layers are stored in that dtype:
    autocast would round their weights to it before every matmul anyway, so the numbers are
    the same, the copy holds half the memory, and no forward pass re-casts them. Norms and
    embeddings stay in the policy's dtype, as autocast computes them.

    With `stored` (train.reference_dtype: bfloat16), every weight of the copy is in that
    dtype: the whole copy in half the memory (buffers, such as rotary frequencies, keep
    theirs). Each weight is cast as it is copied: the policy is never held twice in its own
    dtype. Its forward runs in that dtype where the device computes it natively (`native`);
    elsewhere (a CPU without AVX-512 BF16 or AMX, where bf16 matmuls run several times slower
    than float32 ones) in the policy's dtype, each module's weights cast up as it runs
    (`_computed_in`): the log-probs of the bf16-rounded weights, at the policy's speed.

    `layout`: the layout of the policy's passes without a gradient, with what was decided for
    its head (grpo.train.layouts.Verdicts): the copy runs as the policy does; None for the
    shared prompt, undecided. The dtype the copy computes in goes with it (`computes_in`)."""

    held = True
    runs_policy = False

    def __init__(
        self,
        policy,
        matmul_dtype: torch.dtype | None = None,
        full_state_dict=None,
        chunked_head: bool = True,
        stored: torch.dtype | None = None,
        layout: Layout | None = None,
    ):
        # With `stored`, deepcopy takes each weight from the memo: a copy in that dtype (tied where
        # the policy's is: parameters() lists a tied weight once).
        memo = None
        if stored is not None:
            memo = {
                id(p): nn.Parameter(p.detach().to(stored, copy=True), requires_grad=False) for p in policy.parameters()
            }
        self.model = copy.deepcopy(policy, memo).eval().requires_grad_(False)
        self.layout = layout or SharedPrompt()
        if stored is not None and not native(stored, next(policy.parameters()).device):
            computes_in = next(policy.parameters()).dtype
            _computed_in(self.model, computes_in)
            self.layout = replace(self.layout, computes_in=computes_in)  # what its packed mask is made in
        self.chunked_head = chunked_head
        # The policy's whole weights (sharded under FSDP, the reference is a full replica).
        self.full_state_dict = full_state_dict or (lambda model: model.state_dict())
        self.networks = [self.model]
        if matmul_dtype is not None and stored is None:
            embedding = self.model.get_input_embeddings().weight
            for module in self.model.modules():
                if isinstance(module, nn.Linear) and module.weight is not embedding:  # a tied head stays
                    module.to(matmul_dtype)

    @torch.no_grad()
    def logprobs(self, batch, temperature, repetition_penalty=1.0):
        return policy_logprobs(
            self.model, batch, temperature, repetition_penalty, self.chunked_head, layout=self.layout
        )

    @torch.no_grad()
    def reset_to(self, policy):
        self.model.load_state_dict(self.full_state_dict(policy))

    def state_dict(self):
        return self.model.state_dict()

    def load_state_dict(self, state):
        self.model.load_state_dict(state)


def _computed_in(model: nn.Module, dtype: torch.dtype) -> None:
    """Run `model`'s forward in `dtype` while its weights stay stored in theirs: each module's own
    parameters are cast up as the module runs and put back after (forward hooks), an embedding's
    looked-up rows cast instead of its whole table (the same numbers). Casting up is exact, so
    the forward computes what a `dtype` model with these (rounded) weights computes. What a
    pass's own tensors (the packed layout's mask) are made in is the caller's to hand on
    (grpo.train.layouts.Verdicts.computes_in)."""
    stored = {}  # module -> its own parameters, while it runs

    def cast_in(module, args):
        stored[module] = dict(module._parameters)
        for name, p in stored[module].items():
            if p is not None:
                module._parameters[name] = p.to(dtype)

    def put_back(module, args, output):
        module._parameters.update(stored.pop(module))

    for module in model.modules():
        if not any(p is not None for p in module._parameters.values()):
            continue
        if type(module) is nn.Embedding:
            module.register_forward_hook(lambda m, args, out: out.to(dtype))
        else:
            module.register_forward_pre_hook(cast_in)
            module.register_forward_hook(put_back, always_call=True)


class AdapterOff:
    """LoRA: the reference is the base weights, i.e. the policy with its adapter disabled.
    Resetting the reference to the policy merges the adapter into the base and starts a
    fresh (zero) adapter, so the policy is unchanged and the reference catches up (and no
    adapter of the starting base is left to save: lora.save adapter refuses it). An adapter
    the run started from (lora.init_adapter) is switched off too: the reference is the base."""

    held = True
    networks: list = []  # the policy's own weights
    runs_policy = True

    def __init__(self, policy, chunked_head: bool = True, layout: Layout | None = None):
        self.policy = policy
        self.chunked_head = chunked_head
        self.layout = layout  # as FrozenCopy's

    @torch.no_grad()
    def logprobs(self, batch, temperature, repetition_penalty=1.0):
        with self.policy.disable_adapter():
            return policy_logprobs(
                self.policy, batch, temperature, repetition_penalty, self.chunked_head, layout=self.layout
            )

    @torch.no_grad()
    def reset_to(self, policy):
        for module in policy.modules():
            if hasattr(module, "merge") and hasattr(module, "lora_B"):
                module.merge()
                module.merged_adapters = []  # keep the merge: it is the new base
                for b in module.lora_B.values():
                    nn.init.zeros_(b.weight)

    def state_dict(self):
        return {}  # the base weights are part of the policy's own state

    def load_state_dict(self, state):
        pass


def build_reference(
    policy,
    *,
    beta: float,
    lora: bool,
    dtype: torch.dtype | None,
    full_state_dict=None,
    chunked_head: bool = True,
    stored: torch.dtype | None = None,
    layout: Layout | None = None,
) -> Reference:
    """No reference when beta = 0 (no KL to measure: no copy, no pass); with LoRA the
    policy's adapter switched off (nothing copied, so `stored` has nothing to shrink); else a
    frozen copy (its linear weights in `dtype` under train.autocast; every weight in `stored`,
    train.reference_dtype's, when given), reset from `full_state_dict(policy)` (default: the
    policy's own state dict). `chunked_head`: train.chunked_head, for its log-probs; `layout`:
    the layout of the policy's passes without a gradient, with what was decided for its head
    (grpo.train.layouts.Verdicts), which the reference's passes run."""
    if beta == 0:
        return NoReference()
    if lora:
        return AdapterOff(policy, chunked_head, layout)
    return FrozenCopy(policy, dtype, full_state_dict, chunked_head, stored=stored, layout=layout)


# ---- the critic -------------------------------------------------------------------------------


class ValueModel(nn.Module):
    """PPO's critic: a causal LM's backbone with a scalar head, V(prefix) per position. With
    `packed` (train.layout, where its backbone serves it: `backbone_packs`), its passes run in
    the packed layout (grpo.train.packed_layout), a group's prompt once."""

    def __init__(self, backbone, hidden_size: int, packed: bool = False):
        super().__init__()
        self.backbone = backbone
        self.head = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.head.weight)  # start at V = 0: no opinion before any data
        nn.init.zeros_(self.head.bias)
        self.packed = packed

    def forward(self, batch: Rollout) -> Tensor:
        """(N, T): the value of the state before each completion token."""
        hidden = completion_states(self.backbone, batch, self.packed)  # (N, T, H)
        # A tensor of its own, not a view: FSDP2 hooks a sharded module's output for its backward.
        return self.head(hidden.float()).squeeze(-1).clone()


def completion_states(backbone, batch: Rollout, packed: bool) -> Tensor:
    """(N, T, H) the backbone's last hidden states at the positions before each completion
    token: from one packed pass (a group's prompt once), or from every row in full."""
    if packed:
        hidden = packed_positions(backbone, batch, True, _last_hidden)
        if hidden is not None:
            return hidden
    t_len = batch.completion_mask.shape[1]
    return padded_pass(backbone, batch).last_hidden_state[:, -t_len - 1 : -1]  # of (N, P + T, H)


def _last_hidden(output) -> Tensor:
    return output.last_hidden_state


def backbone_packs(backbone, world=None) -> bool:
    """Whether `backbone` gives the same hidden states in the packed layout as with every row in
    full, within the rounding of the dtype it computes in (grpo.infra.probes.close, as the
    policy's layouts are probed), on a small batch of its own (tried once, when the critic
    loads; under torchrun, `world`, only where every process's probe found it serves); never
    for windowed attention (see `grpo.train.layouts.decide_layouts`). Where the probe declines
    it, one warning line."""
    if windowed(backbone):
        return False
    batch = probe_batch(backbone)
    try:
        with torch.no_grad():
            plain = completion_states(backbone, batch, packed=False)
            packed = completion_states(backbone, batch, packed=True)
    except Exception as err:  # noqa: BLE001 (a layout the backbone's code cannot run: not taken)
        problem = f"cannot run ({type(err).__name__}: {first_line(err)})"
    else:
        same = close(packed, plain, mask_dtype(backbone), where=batch.loss_mask)
        problem = None if same else "gives other hidden states than every row in full"
    if agreed(world, problem is None):
        return True
    why = problem or "another process's probe declined it"
    warn(f"train.layout: the critic's {type(backbone).__name__} runs padded (packed: {why})")
    return False


def load_value_model(
    path: str,
    dtype: str,
    attention: str | None = None,
    device: torch.device | str = "cpu",
    layout: str = "auto",
    world=None,
) -> ValueModel:
    from transformers import AutoModel

    # The checkpoint's language-model head is not part of the backbone: its keys are "unexpected".
    try:
        with quiet_loading():
            backbone = AutoModel.from_pretrained(
                path, dtype=torch_dtype(dtype, "value.model"), attn_implementation=attention
            )
    except Exception as err:
        raise UserError(f"value.model: cannot load a model from '{path}' ({load_error(err)})") from None
    backbone = backbone.to(device).eval()
    packed = layout in ("auto", PACKED) and backbone_packs(backbone, world)
    if packed:
        segments.enable(backbone, world)  # its packed passes attend within each sequence only, where that serves
    return ValueModel(backbone, backbone.config.hidden_size, packed).to(device).eval()
