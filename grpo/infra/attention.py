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
written on transformers' attention interface, eager or sdpa, and no sliding window) and by a
probe against the mask (`_serves`), never by catching an error mid-step. A bin whose scores
through the mask (heads x L x L a layer) number under `SEGMENTED_FROM` keeps the mask: there
the scores are small, and a call a segment costs about what it saves (measured on the demo's
model, benchmarks/README.md#attention-by-segments-bench_segmentspy-issue-39), so its numbers stay as they were.

On a GPU, in half precision, the segments go through one call a layer instead of one a
segment: torch's variable-length flash attention (`torch.nn.attention.varlen.varlen_attn`),
given each segment's queries and keys gathered end to end (`Varlen`: a completion's keys are
its prompt's, then its own), causal within each. It is used where a one-time check on the
device (`_varlen_serves`) finds it gives what the call per segment gives; otherwise, and on
a CPU (where torch has no such kernel), a call per segment.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

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
_varlen_kernels: dict = {}  # (device, dtype) -> the kernel `_varlen_serves` found right there, or None


def _varlen_function() -> Callable | None:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def _varlen_kernel(query: Tensor) -> Callable | None:
    """torch's variable-length flash attention where it runs and was found right for `query`'s
    device and dtype (`_varlen_serves`, once per pair): a GPU, fp16 or bf16, a head size flash
    attention takes (a multiple of 8, at most 256). None: a call per segment."""
    d = query.shape[-1]
    if not query.is_cuda or query.dtype not in _VARLEN_DTYPES or d % 8 or d > 256:
        return None
    key = (str(query.device), query.dtype)
    if key not in _varlen_kernels:
        kernel = _varlen_function()
        _varlen_kernels[key] = (
            kernel if kernel is not None and _varlen_serves(kernel, query.device, query.dtype) else None
        )
    return _varlen_kernels[key]


# The probes' bin (`_serves`, `_varlen_serves`): a prompt of 3 tokens with completions of 3 and
# 2 behind it, a sequence of 5 of its own, 2 unused slots.
_PROBE_UNITS = torch.tensor([[0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, -1, -1]])
_PROBE_BRANCHES = torch.tensor([[0, 0, 0, 1, 1, 1, 2, 2, 0, 0, 0, 0, 0, -1, -1]])


def _varlen_serves(kernel, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `kernel` gives, on `device` in `dtype`, what a call per segment gives (to that
    dtype's rounding) on a bin of a prompt with two completions behind it, a sequence of its
    own and unused slots, with grouped-query heads; a kernel that fails is not used."""
    found = plan(_PROBE_UNITS.to(device), _PROBE_BRANCHES.to(device), smallest=0)  # its masks on the device
    g = torch.Generator().manual_seed(0)
    slots = _PROBE_UNITS.shape[1]
    query, key, value = (torch.randn(1, heads, slots, 64, generator=g) for heads in (4, 2, 2))
    query, key, value = (t.to(device=device, dtype=dtype) for t in (query, key, value))
    try:
        got = _attend_varlen(query, key, value, found, None, kernel)
        want = _attend(query, key.repeat_interleave(2, 1), value.repeat_interleave(2, 1), found, None)
    except Exception:  # noqa: BLE001 (a kernel that cannot run here: the call per segment)
        return False
    return bool((got.float() - want.float()).abs().max() <= 2e-2 * float(want.float().abs().max()))


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


def enable(model) -> bool:
    """Switch `model` (a causal LM, a backbone or a sequence classifier) to attend by segments
    in packed passes where it can and where that gives what the mask gives (`_serves`); leave
    it as it was otherwise. Returns whether it is on. The frozen reference, a copy of the
    policy, inherits it."""
    if getattr(model, _ENABLED, False):
        return True
    config = model.config
    base = getattr(config, "_attn_implementation", None)
    can = getattr(model, "_can_set_attn_implementation", None)
    if base not in _BASES or can is None or not can():
        return False
    from grpo.infra.packing import windowed

    if windowed(model):
        return False
    _register()
    model.set_attn_implementation(_NAME.format(base))
    setattr(model, _ENABLED, True)
    if _serves(model):
        return True
    model.set_attn_implementation(base)
    setattr(model, _ENABLED, False)
    return False


def _serves(model) -> bool:
    """Whether `model` gives the same outputs by segments as through the mask, to float
    rounding, on a bin of its own: a prompt with two completions behind it, then a sequence of
    its own, then unused slots; and whether the plan reached its attention at all (a model
    whose layers do not pass their keywords on would silently use the mask)."""
    from grpo.infra.packing import Packed, mask_dtype

    units, branches = _PROBE_UNITS, _PROBE_BRANCHES
    positions = torch.tensor([[0, 1, 2, 3, 4, 5, 3, 4, 0, 1, 2, 3, 4, 0, 0]])
    device = next(model.parameters()).device
    vocab = model.get_input_embeddings().num_embeddings
    ids = torch.randint(1, vocab, units.shape, generator=torch.Generator().manual_seed(0))
    slots = torch.arange(units.numel()).view_as(units)  # each token's own slot, as pack_sequences' index
    packed = Packed(ids.to(device), positions.to(device), units.to(device), branches.to(device), slots.to(device))
    found = plan(packed.units, packed.branches, smallest=0)
    inputs = dict(
        input_ids=packed.input_ids,
        attention_mask=packed.attention_mask(mask_dtype(model)),
        position_ids=packed.position_ids,
        use_cache=False,
    )
    base = getattr(model, model.base_model_prefix, model)  # the body: (1, L, H) out, whatever head is on top
    try:
        with torch.no_grad():
            masked = base(**inputs)[0]
            before = _segmented_calls[0]
            segmented = base(**inputs, **{SEGMENTS: found})[0]
            reached = _segmented_calls[0] > before
    except Exception:  # noqa: BLE001 (a model whose code cannot take the plan: not switched)
        return False
    real = (units >= 0).to(device).view(1, -1, *([1] * (masked.dim() - 2)))
    scale = float(masked.abs().max()) or 1.0
    tolerance = 1e-4 if masked.dtype in (torch.float32, torch.float64) else 5e-2
    close = bool((((segmented - masked).abs() * real).max() <= tolerance * scale))
    return close and reached
