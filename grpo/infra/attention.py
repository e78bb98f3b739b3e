"""Attention within each packed sequence only: the packed layout's kernel.

A packed pass (grpo.infra.packing) lays several sequences end to end in a row ("bin") and
keeps each within itself with a 4-D mask. Through that mask, attention scores every pair of
the bin's L slots, (L, L) a head, and eager attention keeps those scores for the backward;
most of the pairs are ones the mask then throws away (for eight completions of 50 tokens
behind a shared prompt of 12, a 412-slot bin, the segments below score 25k pairs of the
bin's 170k). Here each segment attends over its own keys only, one scaled-dot-product call a
segment:
- a prompt, or a whole sequence (SFT's, the reward model's), attends causally within itself;
- a completion attends to every key of its unit's prompt and causally within itself.
A bin's slots past its last sequence get zeros: no real token sees them, and no output there
is read. The same attention as through the mask, to float rounding; fewer operations, and
no (L, L) scores held.

How a model gets it (`enable`): its attention implementation (eager or sdpa) becomes one
registered here under another name, which computes by segments when a pass hands it the
plan (keyword `SEGMENTS`: transformers carries a model's extra keywords down to its
attention functions, and through activation checkpointing's recomputation) and otherwise
calls the implementation the model had, with the mask, as before: the padded passes and
`generate` are unchanged. Whether a model gets it is decided once, by capability (a model
written on transformers' attention interface, eager or sdpa, and no sliding or chunked
window) and by a probe against the implementation it had (`_serves`: its padded pass under
the new name, where model code that branches on the name would compute otherwise, and the
packed pass by segments against the mask), never by catching an error mid-step; where the
registration or the probe fails, the model keeps its implementation, with one warning line
(grpo.infra.probes). A bin whose scores
through the mask (heads x L x L a layer) number under `SEGMENTED_FROM` keeps the mask: there
the scores are small, and a call a segment costs about what it saves (measured on the demo's
model: benchmarks/README.md, `bench_segments.py`), so its numbers stay as they were.

On a GPU, in half precision, the segments go through one call a layer instead of one a
segment: torch's variable-length flash attention (`torch.nn.attention.varlen.varlen_attn`),
given each segment's queries and keys gathered end to end (`Varlen`: a completion's keys are
its prompt's, then its own), causal within each. It is used where a one-time check on the
device at the model's heads and head size (`_varlen_problem`) finds that it gives the outputs
and gradients a call per segment gives; otherwise (with one warning line), and on a CPU
(where torch has no such kernel), a call per segment.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from grpo.errors import first_line
from grpo.infra.probes import agreed, close, warn

SEGMENTS = "grpo_segments"  # the keyword a packed pass hands the plan in
SEGMENTED_FROM = 1 << 19  # a bin whose masked scores (heads x L x L) are at least this many goes by segments
_ENABLED = "_grpo_segments"  # the attribute that marks a model switched to segments
_NAME = "grpo_segments_{}"  # the registered implementation that wraps `{}` (eager or sdpa)
_BASES = ("eager", "sdpa")
_segmented_calls = [0]  # attention calls that went by segments (the probe asks whether the plan arrived)


@dataclass(frozen=True)
class Segment:
    """Slots [start, start + length) of a bin, attending causally within themselves and, for a
    completion behind a shared prompt, to every slot of [prompt, prompt + prompt_length)."""

    start: int
    length: int
    prompt: int = 0
    prompt_length: int = 0
    mask: Tensor | None = None  # (length, prompt_length + length) bool where prompt_length > 0


@dataclass(frozen=True)
class Plan:
    """Each bin's segments in slot order, and how many of its L slots they cover."""

    bins: list[list[Segment]]
    used: list[int]
    length: int
    varlen_by_device: dict = field(default_factory=dict, compare=False, repr=False)  # `varlen`'s, built once

    def varlen(self, device: torch.device) -> Varlen:
        """The plan as a variable-length attention call takes it, on `device` (built once a
        plan: every layer of a pass attends by the same one)."""
        key = str(device)
        if key not in self.varlen_by_device:
            self.varlen_by_device[key] = Varlen.of(self, device)
        return self.varlen_by_device[key]


@dataclass(frozen=True)
class Varlen:
    """A plan's segments laid end to end, as `varlen_attn` takes them: segment i's queries are
    the bins' slots `query_slots[cu_q[i]:cu_q[i + 1]]` and its keys `key_slots[cu_k[i]:cu_k[i + 1]]`
    (a completion's: its prompt's slots, then its own), each slot a (bin, position) pair.
    Causal within a segment, aligned at the end (a completion's j-th query sees its prompt
    and its own first j + 1 keys), as flash attention aligns a segment with more keys than
    queries."""

    query_bins: Tensor  # (Tq,) long
    query_slots: Tensor  # (Tq,) long
    key_bins: Tensor  # (Tk,) long
    key_slots: Tensor  # (Tk,) long
    cu_q: Tensor  # (S + 1,) int32
    cu_k: Tensor  # (S + 1,) int32
    max_q: int
    max_k: int

    @staticmethod
    def of(found: Plan, device: torch.device) -> Varlen:
        qb, qs, kb, ks, lq, lk = [], [], [], [], [], []
        for b, segments in enumerate(found.bins):
            for s in segments:
                own = range(s.start, s.start + s.length)
                keys = [*range(s.prompt, s.prompt + s.prompt_length), *own]
                qb += [b] * s.length
                qs += own
                kb += [b] * len(keys)
                ks += keys
                lq.append(s.length)
                lk.append(len(keys))

        def longs(values):
            return torch.tensor(values, dtype=torch.long, device=device)

        def starts(lengths):
            return torch.tensor([0, *lengths], dtype=torch.long).cumsum(0).to(device=device, dtype=torch.int32)

        return Varlen(
            longs(qb), longs(qs), longs(kb), longs(ks), starts(lq), starts(lk), max(lq, default=0), max(lk, default=0)
        )


def plan(units: Tensor, branches: Tensor, *, heads: int = 1, smallest: int | None = None) -> Plan | None:
    """The segments of a packed layout (grpo.infra.packing.Packed's `units` and `branches`,
    (B, L)): each run of slots of one unit and branch; branch 0 a prompt (or a whole sequence),
    k > 0 a completion that also sees its unit's prompt. None where a bin's scores through the
    mask, `heads` x L x L, are fewer than `smallest` (`SEGMENTED_FROM` unless given)."""
    length = units.shape[1]
    if heads * length * length < (SEGMENTED_FROM if smallest is None else smallest):
        return None
    device = units.device
    bins, used = [], []
    for unit_row, branch_row in zip(units.cpu().tolist(), branches.cpu().tolist()):
        segments, at, prompt = [], 0, (0, 0)
        while at < length and unit_row[at] >= 0:
            end = at + 1
            while end < length and unit_row[end] == unit_row[at] and branch_row[end] == branch_row[at]:
                end += 1
            n = end - at
            if branch_row[at] == 0:
                prompt = (at, n)
                segments.append(Segment(at, n))
            else:
                p = prompt[1]
                keys = torch.arange(p + n, device=device)
                mask = keys.view(1, -1) <= torch.arange(n, device=device).view(-1, 1) + p
                segments.append(Segment(at, n, prompt[0], p, mask))
            at = end
        bins.append(segments)
        used.append(at)
    return Plan(bins, used, length)


def arguments(model, units: Tensor, branches: Tensor) -> dict:
    """The keyword arguments a packed pass of `model` adds to its call: the plan where the model
    attends by segments (`enable`) and its bins are long enough, else none."""
    if not getattr(model, _ENABLED, False):
        return {}
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    found = plan(units, branches, heads=getattr(config, "num_attention_heads", 1) or 1)
    return {} if found is None else {SEGMENTS: found}


def _attend(query: Tensor, key: Tensor, value: Tensor, found: Plan, scaling: float | None) -> Tensor:
    """(B, H, L, D) queries, keys and values (keys' heads already repeated to the queries') to
    the (B, L, H, D) output, segment by segment."""
    rows = []
    for b, segments in enumerate(found.bins):
        q_row, k_row, v_row = query[b : b + 1], key[b : b + 1], value[b : b + 1]
        pieces = []
        for s in segments:
            q = q_row[:, :, s.start : s.start + s.length]
            if s.prompt_length == 0:
                k = k_row[:, :, s.start : s.start + s.length]
                v = v_row[:, :, s.start : s.start + s.length]
                pieces.append(F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling))
            else:
                seen = (slice(s.prompt, s.prompt + s.prompt_length), slice(s.start, s.start + s.length))
                k = torch.cat([k_row[:, :, seen[0]], k_row[:, :, seen[1]]], 2)
                v = torch.cat([v_row[:, :, seen[0]], v_row[:, :, seen[1]]], 2)
                pieces.append(F.scaled_dot_product_attention(q, k, v, attn_mask=s.mask, scale=scaling))
        unused = found.length - found.used[b]
        if unused:
            pieces.append(query.new_zeros(1, query.shape[1], unused, query.shape[3]))
        rows.append(torch.cat(pieces, 2))
    return torch.cat(rows, 0).transpose(1, 2).contiguous()


def _attend_varlen(query: Tensor, key: Tensor, value: Tensor, found: Plan, scaling: float | None, kernel) -> Tensor:
    """`_attend` in one call of `kernel` (`varlen_attn`'s signature): (B, H, L, D) queries and
    (B, H_kv, L, D) keys and values (grouped-query heads not repeated) to the (B, L, H, D)
    output, zeros at the unused slots."""
    v = found.varlen(query.device)
    q = query.transpose(1, 2)[v.query_bins, v.query_slots]  # (Tq, H, D)
    k = key.transpose(1, 2)[v.key_bins, v.key_slots]  # (Tk, H_kv, D)
    vals = value.transpose(1, 2)[v.key_bins, v.key_slots]
    out = kernel(
        q,
        k,
        vals,
        v.cu_q,
        v.cu_k,
        v.max_q,
        v.max_k,
        scale=scaling,
        window_size=(-1, 0),
        enable_gqa=k.shape[1] != q.shape[1],
    )
    b, h, length, d = query.shape
    return out.new_zeros(b, length, h, d).index_put((v.query_bins, v.query_slots), out)


_VARLEN_DTYPES = (torch.float16, torch.bfloat16)
_varlen_kernels: dict = {}  # (device, dtype, heads, head size) -> the kernel `_varlen_serves` found right there, or None


def _varlen_function() -> Callable | None:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def _varlen_kernel(query: Tensor) -> Callable | None:
    """torch's variable-length flash attention where it runs and was found right for `query`'s
    device, dtype, heads and head size (`_checked_varlen`, once for each): a GPU, fp16 or bf16,
    a head size flash attention takes (a multiple of 8, at most 256). None: a call per
    segment."""
    d = query.shape[-1]
    if not query.is_cuda or query.dtype not in _VARLEN_DTYPES or d % 8 or d > 256:
        return None
    key = (str(query.device), query.dtype, query.shape[1], d)
    if key not in _varlen_kernels:
        _varlen_kernels[key] = _checked_varlen(_varlen_function(), query.device, query.dtype, query.shape[1], d)
    return _varlen_kernels[key]


def _checked_varlen(kernel, device: torch.device, dtype: torch.dtype, heads: int, head_dim: int) -> Callable | None:
    """`kernel` where `_varlen_problem` finds it right at these heads and head size; else None
    (a call per segment), with one warning line where torch has the kernel but it failed."""
    if kernel is None:
        return None
    problem = _varlen_problem(kernel, device, dtype, heads=heads, head_dim=head_dim)
    if problem is None:
        return kernel
    warn(
        f"packed passes attend with a call per segment, not torch's varlen_attn: on {device} in {dtype} "
        f"({heads} heads of {head_dim}) {problem}"
    )
    return None


# The probes' bin (`_serves`, `_varlen_serves`): a prompt of 3 tokens with completions of 3 and
# 2 behind it, a sequence of 5 of its own, 2 unused slots.
_PROBE_UNITS = torch.tensor([[0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, -1, -1]])
_PROBE_BRANCHES = torch.tensor([[0, 0, 0, 1, 1, 1, 2, 2, 0, 0, 0, 0, 0, -1, -1]])


def _varlen_serves(kernel, device: torch.device, dtype: torch.dtype, *, heads: int = 4, head_dim: int = 64) -> bool:
    """Whether `kernel` gives, on `device` in `dtype`, what a call per segment gives
    (`_varlen_problem`)."""
    return _varlen_problem(kernel, device, dtype, heads=heads, head_dim=head_dim) is None


def _varlen_problem(kernel, device: torch.device, dtype: torch.dtype, *, heads: int, head_dim: int) -> str | None:
    """What `kernel` gets wrong, on `device` in `dtype`, against a call per segment, or None:
    outputs and gradients of queries, keys and values within the dtype's rounding
    (grpo.infra.probes.close), on the probes' bin (a prompt with two completions behind it, a
    sequence of its own, unused slots) at `heads` heads of `head_dim`, with as many key heads
    and, where `heads` is even, half as many (grouped-query). A kernel that fails is not used.
    It runs where the first packed pass meets it, inside a layer's forward: with autograd on
    there whatever the pass's mode (inference mode, no_grad), and its own saved tensors kept as
    they are (not in a checkpointed layer's keeping)."""
    with torch.inference_mode(False), torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_same, _same):
        return _varlen_differences(kernel, device, dtype, heads, head_dim)


def _same(tensor: Tensor) -> Tensor:
    return tensor


def _varlen_differences(kernel, device: torch.device, dtype: torch.dtype, heads: int, head_dim: int) -> str | None:
    found = plan(_PROBE_UNITS.to(device), _PROBE_BRANCHES.to(device), smallest=0)  # its masks on the device
    g = torch.Generator().manual_seed(0)
    slots = _PROBE_UNITS.shape[1]
    for kv_heads in (heads, heads // 2) if heads % 2 == 0 else (heads,):
        query, key, value = (torch.randn(1, h, slots, head_dim, generator=g) for h in (heads, kv_heads, kv_heads))
        query, key, value = (t.to(device=device, dtype=dtype).requires_grad_() for t in (query, key, value))
        weights = torch.randn(1, slots, heads, head_dim, generator=g).to(device=device, dtype=dtype)
        repeat = heads // kv_heads
        try:
            got = _attend_varlen(query, key, value, found, None, kernel)
            got_grads = torch.autograd.grad((got * weights).sum(), (query, key, value))
            want = _attend(query, key.repeat_interleave(repeat, 1), value.repeat_interleave(repeat, 1), found, None)
            want_grads = torch.autograd.grad((want * weights).sum(), (query, key, value))
        except Exception as err:  # noqa: BLE001 (a kernel that cannot run here: the call per segment)
            return f"it fails ({type(err).__name__}: {first_line(err)})"
        if got.shape != want.shape or not close(got, want, dtype):
            return f"its outputs differ from a call per segment's ({kv_heads} key heads)"
        for name, a, b in zip(("queries", "keys", "values"), got_grads, want_grads):
            if not close(a, b, dtype):
                return f"its gradients of the {name} differ from a call per segment's ({kv_heads} key heads)"
    return None


def _base_function(name: str, module):
    """The implementation the model had: transformers' sdpa, or the eager function of the
    module's own modelling file (each architecture writes its own)."""
    if name == "sdpa":
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        return ALL_ATTENTION_FUNCTIONS["sdpa"]
    return getattr(sys.modules[type(module).__module__], "eager_attention_forward")


def _by_segments(base: str):
    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        found = kwargs.pop(SEGMENTS, None)
        plain = (
            found is None
            or dropout
            or query.shape[2] != found.length
            or key.shape[2] != found.length
            or kwargs.get("sliding_window")
            or kwargs.get("softcap")
            or kwargs.get("s_aux") is not None
            or not getattr(module, "is_causal", True)
        )
        if plain:
            return _base_function(base, module)(
                module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
            )
        _segmented_calls[0] += 1
        kernel = _varlen_kernel(query)
        if kernel is not None:
            return _attend_varlen(query, key, value, found, scaling, kernel), None
        repeat = query.shape[1] // key.shape[1]
        if repeat > 1:  # grouped-query attention: each key head serves `repeat` query heads
            key, value = key.repeat_interleave(repeat, 1), value.repeat_interleave(repeat, 1)
        return _attend(query, key, value, found, scaling), None

    return attention


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

    masks = {"eager": eager_mask, "sdpa": sdpa_mask}
    for base in _BASES:
        AttentionInterface.register(_NAME.format(base), _by_segments(base))
        AttentionMaskInterface.register(_NAME.format(base), masks[base])


def kernel(model) -> str | None:
    """The attention implementation `model` computes with (transformers' name: eager, sdpa,
    ...), whether or not it attends by segments in packed passes."""
    name = getattr(model.config, "_attn_implementation", None)
    for base in _BASES:
        if name == _NAME.format(base):
            return base
    return name


def enable(model, world=None) -> bool:
    """Switch `model` (a causal LM, a backbone or a sequence classifier) to attend by segments
    in packed passes where it can and where a probe finds that this changes none of its
    numbers (`_switch`); leave it as it was otherwise, with one warning line where a probe
    declined it. Under torchrun (`world`, grpo.infra.distributed) it is switched only where
    every process's probe found it serves. Returns whether it is on. The frozen reference, a
    copy of the policy, inherits it."""
    if getattr(model, _ENABLED, False):
        return True
    base = getattr(model.config, "_attn_implementation", None)
    can = getattr(model, "_can_set_attn_implementation", None)
    if base not in _BASES or can is None or not can():
        return False
    from grpo.infra.packing import windowed

    if windowed(model):
        return False
    problem = _switch(model, base)
    if agreed(world, problem is None):
        return True
    if problem is None:
        _switch_back(model, base)
        problem = "another process's probe declined it"
    warn(f"{type(model).__name__}'s packed passes attend through the mask, not by segments: {problem}")
    return False


def _switch(model, base: str) -> str | None:
    """Switch `model` from `base` to the implementation that wraps it, and keep it there where
    `_serves` finds no difference; otherwise leave `base`, and say why."""
    name = _NAME.format(base)
    try:
        _register()
    except Exception as err:  # noqa: BLE001 (a transformers whose interface refuses it: the mask)
        return f"transformers did not register {name} ({type(err).__name__}: {first_line(err)})"
    probe = _Probe.of(model)
    try:
        original = probe.outputs(model)
    except Exception as err:  # noqa: BLE001 (a model whose code cannot run the probe: not switched)
        return f"its {base} forward failed on the probe ({type(err).__name__}: {first_line(err)})"
    try:
        model.set_attn_implementation(name)
    except Exception as err:  # noqa: BLE001
        _switch_back(model, base)
        return f"transformers did not switch it to {name} ({type(err).__name__}: {first_line(err)})"
    setattr(model, _ENABLED, True)
    problem = _serves(model, probe, original)
    if problem is not None:
        _switch_back(model, base)
    return problem


def _switch_back(model, base: str) -> None:
    model.set_attn_implementation(base)
    setattr(model, _ENABLED, False)


@dataclass(frozen=True)
class _Probe:
    """`enable`'s probe for a model: the probes' bin packed (a prompt with two completions behind
    it, a sequence of its own, unused slots), and the same two sequences as padded rows (the
    second left-padded), on the model's device."""

    packed: dict  # a packed pass's keywords: ids, the 4-D mask, positions
    packed_real: Tensor  # (1, L) bool: the bin's used slots
    plan: Plan
    padded: dict  # a padded pass's keywords
    padded_real: Tensor  # (2, 6) bool: the rows' real tokens
    dtype: torch.dtype  # what the model computes in: the tolerances' unit

    @staticmethod
    def of(model) -> _Probe:
        from grpo.infra.packing import Packed, mask_dtype

        units, branches = _PROBE_UNITS, _PROBE_BRANCHES
        positions = torch.tensor([[0, 1, 2, 3, 4, 5, 3, 4, 0, 1, 2, 3, 4, 0, 0]])
        device = next(model.parameters()).device
        vocab = model.get_input_embeddings().num_embeddings
        ids = torch.randint(1, vocab, units.shape, generator=torch.Generator().manual_seed(0))
        slots = torch.arange(units.numel()).view_as(units)  # each token's own slot, as pack_sequences' index
        packed = Packed(ids.to(device), positions.to(device), units.to(device), branches.to(device), slots.to(device))
        rows = torch.stack([ids[0, :6], torch.cat([ids[0, :1], ids[0, 8:13]])])  # the first completion; the sequence
        real = torch.ones(2, 6, dtype=torch.bool)
        real[1, 0] = False  # left padding
        return _Probe(
            packed=dict(
                input_ids=packed.input_ids,
                attention_mask=packed.attention_mask(mask_dtype(model)),
                position_ids=packed.position_ids,
                use_cache=False,
            ),
            packed_real=(units >= 0).to(device),
            plan=plan(packed.units, packed.branches, smallest=0),
            padded=dict(
                input_ids=rows.to(device),
                attention_mask=real.long().to(device),
                position_ids=(real.long().cumsum(1) - 1).clamp(min=0).to(device),
                use_cache=False,
            ),
            padded_real=real.to(device),
            dtype=mask_dtype(model),
        )

    def outputs(self, model, segmented: bool = False) -> tuple[Tensor, Tensor]:
        """The body's last hidden states (whatever head is on top) over the padded rows and the
        packed bin, in eval mode (no dropout); with `segmented`, the packed pass is handed the
        plan."""
        body = getattr(model, model.base_model_prefix, model)
        extra = {SEGMENTS: self.plan} if segmented else {}
        modes = [(module, module.training) for module in model.modules()]
        model.eval()
        try:
            with torch.no_grad():
                return body(**self.padded)[0], body(**self.packed, **extra)[0]
        finally:
            for module, training in modes:
                module.training = training


def _serves(model, probe: _Probe, original: tuple[Tensor, Tensor]) -> str | None:
    """What `model`, switched, gets wrong against its `original` implementation's outputs
    (`_Probe.outputs`), or None: its padded pass must give the original's (a model whose code
    branches on the implementation's name, as GPT-2's reorder_and_upcast_attn does on "eager",
    may compute otherwise under another name), the packed pass by segments the original's
    through the mask, each within the dtype's rounding (grpo.infra.probes.close), and the plan
    must reach its attention (a model whose layers do not pass their keywords on would
    silently use the mask)."""
    try:
        before = _segmented_calls[0]
        padded, segmented = probe.outputs(model, segmented=True)
        reached = _segmented_calls[0] > before
    except Exception as err:  # noqa: BLE001 (a model whose code cannot take the plan: not switched)
        return f"its forward failed under {model.config._attn_implementation} ({type(err).__name__}: {first_line(err)})"
    if not close(padded, original[0], probe.dtype, where=probe.padded_real):
        return "its padded pass computes otherwise under another implementation name (its code branches on the name)"
    if not reached:
        return "its layers do not hand the plan on to its attention"
    if not close(segmented, original[1], probe.dtype, where=probe.packed_real):
        return "by segments its packed pass differs from the mask's"
    return None
