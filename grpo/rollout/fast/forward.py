"""The fast loop's forward pass: the model's weights fused once per policy version
(`fuse_weights`: q/k/v and gate/up stacked into one matmul each), a preallocated KV cache, and
one decoding step over it (`_forward`), its matmuls laid out for a handful of rows on a CPU
(`_linear`). What it computes, and why, is in `grpo.rollout.fast`'s docstring."""

from __future__ import annotations

import functools
import math
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from grpo.errors import first_line


@dataclass(frozen=True)
class _Packed:
    """A linear layer's weight in oneDNN's blocked layout for a few rows (`pack`), in place of
    the (out, in) matrix; `_linear` runs it through oneDNN's inner product."""

    weight: Tensor
    out_features: int


@dataclass
class _Layer:
    norm_attn: Tensor
    qkv: Tensor | _Packed  # (q + k + v outputs, H): the three projections stacked
    qkv_bias: Tensor | None
    out: Tensor | _Packed
    out_bias: Tensor | None
    norm_mlp: Tensor
    gate_up: Tensor | _Packed  # (2 * I, H)
    gate_up_bias: Tensor | None
    down: Tensor | _Packed
    down_bias: Tensor | None
    q_norm: Tensor | None = None  # Qwen3: RMSNorm over each query head (carrying the 1/sqrt(D))
    k_norm: Tensor | None = None  # Qwen3: RMSNorm over each key head


@dataclass
class _Weights:
    embed: Tensor
    layers: list[_Layer]
    norm: Tensor
    head: Tensor | _Packed
    head_bias: Tensor | None
    eps: float
    heads: int
    kv_heads: int
    head_dim: int

    packing: bool = False  # built to be packed (`fuse_weights(pack=True)` where `packs`)

    @property
    def packed(self) -> bool:
        """Whether any matrix is oneDNN-packed (`fuse_weights(pack=True)`, `pack_single_matrices`):
        only for the fast draw, whose tokens need not be generate's bit for bit."""
        layers = (m for layer in self.layers for m in (layer.qkv, layer.out, layer.gate_up, layer.down))
        return isinstance(self.head, _Packed) or any(isinstance(m, _Packed) for m in layers)


def out_features(weight: Tensor | _Packed) -> int:
    """The outputs of a linear layer's weight, packed (`pack_weight`) or plain (out, in)."""
    return weight.out_features if isinstance(weight, _Packed) else weight.shape[0]


def _stack(linears, dtype, scales=None) -> tuple[Tensor, Tensor | None]:
    """The weights of `linears` stacked along the output dimension (linear j's scaled by
    scales[j]), in `dtype`, and their biases likewise (zeros for one without; None if none has)."""
    scales = scales or [1.0] * len(linears)

    def scaled(t: Tensor, scale: float) -> Tensor:
        return t.detach() * scale if scale != 1.0 else t.detach()

    def joined(tensors: list[Tensor]) -> Tensor:  # no copy for a single tensor already in dtype
        return (tensors[0] if len(tensors) == 1 else torch.cat(tensors)).to(dtype)

    weight = joined([scaled(lin.weight, sc) for lin, sc in zip(linears, scales)])
    if all(lin.bias is None for lin in linears):
        return weight, None
    return weight, joined(
        [
            scaled(lin.bias, sc) if lin.bias is not None else lin.weight.new_zeros(lin.out_features)
            for lin, sc in zip(linears, scales)
        ]
    )


def fuse_weights(model, dtype: torch.dtype, pack: bool = False) -> _Weights:
    """The model's current weights, in `dtype`, with the fused projections built; with `pack`
    (the fast draw's few-row layout), the stacked q/k/v and gate/up matrices of at least
    PACK_FROM values in oneDNN's packed layout where `packs` says it serves (`pack_weight`).
    Those two are copies in either layout, so packing them holds no more memory; the single
    matrices (the attention's output, the MLP's down projection, the LM head) stay views of
    the model's own weights, which a packed copy would add to what sampling holds: packed
    only where the caller has that room (`pack_single_matrices`)."""
    packed = pack and packs(dtype, model.model.embed_tokens.weight.device)

    def linear(weight: Tensor) -> Tensor | _Packed:
        return pack_weight(weight) if packed and weight.numel() >= PACK_FROM else weight

    config = model.config
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    layers = []
    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        # The attention's 1/sqrt(D) is folded into the query projection (RoPE is linear, so
        # rotating the scaled query scales the rotated one): one op fewer per layer and step.
        # With Qwen3's per-head query norm, which would undo that scale, it goes into the norm's weight.
        scale = getattr(a, "scaling", None) or head_dim**-0.5
        q_norm, k_norm = getattr(a, "q_norm", None), getattr(a, "k_norm", None)
        q_scale = 1.0 if q_norm is not None else scale
        qkv, qkv_bias = _stack([a.q_proj, a.k_proj, a.v_proj], dtype, [q_scale, 1.0, 1.0])  # Qwen2 has q/k/v biases
        out, out_bias = _stack([a.o_proj], dtype)
        gate_up, gate_up_bias = _stack([m.gate_proj, m.up_proj], dtype)
        down, down_bias = _stack([m.down_proj], dtype)
        layers.append(
            _Layer(
                norm_attn=layer.input_layernorm.weight.detach().to(dtype),
                qkv=linear(qkv),
                qkv_bias=qkv_bias,
                out=out,
                out_bias=out_bias,
                norm_mlp=layer.post_attention_layernorm.weight.detach().to(dtype),
                gate_up=linear(gate_up),
                gate_up_bias=gate_up_bias,
                down=down,
                down_bias=down_bias,
                q_norm=None if q_norm is None else (q_norm.weight.detach() * scale).to(dtype),
                k_norm=None if k_norm is None else k_norm.weight.detach().to(dtype),
            )
        )
    head, head_bias = _stack([model.lm_head], dtype)
    return _Weights(
        embed=model.model.embed_tokens.weight.detach().to(dtype),
        layers=layers,
        norm=model.model.norm.weight.detach().to(dtype),
        head=head,
        head_bias=head_bias,
        eps=getattr(model.model.norm, "variance_epsilon", None) or config.rms_norm_eps,
        heads=heads,
        kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        packing=packed,
    )


def pack_single_matrices(w: _Weights, room: int) -> list[str]:
    """Pack the fast draw's single matrices (`fuse_weights(pack=True)` packs only the stacked
    ones, which are copies anyway) where their packed copies fit in `room` bytes: the LM head
    first (the largest, the most time a step, and where packing pays most:
    benchmarks/README.md), then the MLP's down
    projections, then the attention's outputs, each kind for every layer or none. Their
    plain matrices are the model's own weights, so each packed copy is memory the sampling
    holds in addition: `room` is what the caller found it may spend (the gradients the
    update holds and the sampling does not, less the sampling's own cache and logits:
    `FastDecoder`). Returns the kinds packed, in order. The logits differ from the plain
    layout's by float rounding, as the stacked matrices' packing does (the fast draw's tokens
    need not be generate's bit for bit)."""
    if not w.packing:  # not the fast draw, or no oneDNN packing on this device or dtype
        return []
    kinds = [
        ("head", [w], "head"),
        ("down", w.layers, "down"),
        ("out", w.layers, "out"),
    ]
    done = []
    for kind, owners, name in kinds:
        matrices = [getattr(o, name) for o in owners]
        if any(isinstance(m, _Packed) or m.numel() < PACK_FROM for m in matrices):
            continue
        size = sum(m.numel() * m.element_size() for m in matrices)
        if size > room:
            continue
        for owner, matrix in zip(owners, matrices):
            setattr(owner, name, pack_weight(matrix))
        room -= size
        done.append(kind)
    return done


def _rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """LlamaRMSNorm (x / sqrt(mean(x^2) + eps) * weight) as one fused op."""
    return F.rms_norm(x, weight.shape, weight, eps)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE as Llama applies it: x * cos + rotate_half(x) * sin (cos, sin: (B, 1, S, D))."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), -1)
    return x * cos + rotated * sin


def cache_dtype(w: _Weights) -> torch.dtype:
    """The KV cache's dtype: float32 on a CPU (its per-length matmuls then use float32 kernels;
    bf16 ones JIT one kernel per shape, which costs memory: benchmarks/README.md); on a GPU
    the compute dtype (bf16 halves the cache, and the GPU's kernels take any shape)."""
    return torch.float32 if w.embed.device.type == "cpu" else w.embed.dtype


def cache_bytes(w: _Weights, positions: int) -> int:
    """The bytes of one layer's keys and values over `positions` cache positions (`cache_dtype`)."""
    return 2 * positions * w.kv_heads * w.head_dim * cache_dtype(w).itemsize


@dataclass
class _Prefix:
    """The prompts' keys and values, one copy a prompt, that its rows read instead of a copy
    each (`_Cache.share`): (layers, P, kv_heads, Lp, head_dim) each; `owner` (rows,) is each
    row's prompt, `slot` (rows,) its place among that prompt's at most `group` rows."""

    keys: Tensor
    values: Tensor
    owner: Tensor
    slot: Tensor
    group: int

    def keep(self, rows: Tensor) -> None:
        """Keep rows `rows` (in that order); a prompt none of them reads is dropped."""
        self.owner, self.slot = self.owner[rows], self.slot[rows]
        live = torch.unique(self.owner)  # sorted
        if len(live) < self.keys.shape[1]:
            self.keys, self.values = self.keys[:, live], self.values[:, live]
            self.owner = torch.searchsorted(live, self.owner)


class _Cache:
    """Preallocated keys and values: (layers, B, kv_heads, length, head_dim) each, in `cache_dtype`.
    Once shared (`share`), it holds the rows' own positions only, from `offset` on, and
    `prefix` the prompts' positions before it, read by all of a prompt's rows."""

    def __init__(self, w: _Weights, rows: int, length: int):
        shape = (len(w.layers), rows, w.kv_heads, length, w.head_dim)
        self.keys = torch.empty(shape, device=w.embed.device, dtype=cache_dtype(w))
        self.values = torch.empty_like(self.keys)
        self.prefix: _Prefix | None = None
        self.offset = 0  # the cache's first position (positions before it are the prefix's)

    def repeat(self, counts: Tensor, filled: int) -> None:
        """Repeat cache row i counts[i] times (the G completions of a prompt share its prefix)."""
        rows = int(counts.sum())
        keys = self.keys.new_empty(self.keys.shape[:1] + (rows,) + self.keys.shape[2:])
        values = torch.empty_like(keys)
        keys[:, :, :, :filled] = self.keys[:, :, :, :filled].repeat_interleave(counts, 1)
        values[:, :, :, :filled] = self.values[:, :, :, :filled].repeat_interleave(counts, 1)
        self.keys, self.values = keys, values

    def share(self, counts: Tensor, filled: int, length: int) -> None:
        """Prompt i's counts[i] rows go on from its first `filled` positions, which stay here
        once as the prefix (not copied to every row, as `repeat` does: a step's attention
        then reads a prompt's keys and values once for its G rows), and the rows get their
        own cache of `length` positions after them."""
        rows, device = int(counts.sum()), self.keys.device
        owner = torch.arange(len(counts), device=device).repeat_interleave(counts)  # (rows,)
        first = (counts.cumsum(0) - counts).repeat_interleave(counts)  # each row's prompt's first row
        self.prefix = _Prefix(
            self.keys[:, :, :, :filled],
            self.values[:, :, :, :filled],
            owner,
            torch.arange(rows, device=device) - first,
            int(counts.max()),
        )
        self.prefix.keep(torch.arange(rows, device=device))  # a prompt without rows dropped
        layers, _, kv_heads, _, head_dim = self.keys.shape
        self.keys = self.keys.new_empty(layers, rows, kv_heads, length, head_dim)
        self.values = torch.empty_like(self.keys)
        self.offset = filled

    def keep(self, rows: Tensor, filled: int) -> None:
        """Keep cache rows `rows` only (in that order), moved to the front of the same buffers
        (their first `filled` positions): no second cache is allocated."""
        k, own = len(rows), filled - self.offset
        self.keys[:, :k, :, :own] = self.keys[:, rows, :, :own]
        self.values[:, :k, :, :own] = self.values[:, rows, :, :own]
        self.keys, self.values = self.keys[:, :k], self.values[:, :k]
        if self.prefix is not None:
            self.prefix.keep(rows)


def _attend_one(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor | None) -> Tensor:
    """Attention of one new query per row over the cache: (B, heads, 1, D). Two batched
    matmuls, which for a single query beat the fused scaled_dot_product_attention kernel on
    a CPU. Grouped-query heads share their key/value head."""
    b, heads, _, d = q.shape
    kv_heads = keys.shape[1]
    q = q.reshape(b, kv_heads, heads // kv_heads, d)  # the query heads of each key/value head
    scores = torch.matmul(q, keys.transpose(-1, -2))  # (B, kv_heads, group, L); q carries the 1/sqrt(D)
    return torch.matmul(_weights_of(scores, mask, values.dtype), values).view(b, heads, 1, d)


def _weights_of(scores: Tensor, mask: Tensor | None, dtype: torch.dtype) -> Tensor:
    """The attention weights of a query per row's `scores` (B, kv_heads, group, L): a softmax in
    float32 over the positions `mask` (B, ..., L) allows (all where None), cast to `dtype`."""
    if mask is not None:
        scores = scores.masked_fill(~mask.view(scores.shape[0], 1, 1, scores.shape[-1]), -math.inf)
    return torch.softmax(scores, -1, dtype=torch.float32).to(dtype)


def _attend_shared(q: Tensor, prefix: _Prefix, layer: int, keys: Tensor, values: Tensor, mask: Tensor | None) -> Tensor:
    """`_attend_one` for rows whose context starts with their prompt's positions in `prefix`
    and goes on in their own `keys` and `values` (B, kv_heads, L, D). Each prompt's rows'
    queries are laid side by side (a prompt's `group` slots, a slot without a row zero), so
    that one batched matmul a prompt reads its keys and values once for all of its rows.
    The same attention as over each row's own copy of the prompt, to float rounding."""
    b, heads, _, d = q.shape
    pk, pv = prefix.keys[layer], prefix.values[layer]  # (P, kv_heads, Lp, D)
    prompts, kv_heads, lp = pk.shape[:3]
    group, per_kv = prefix.group, heads // kv_heads
    q = q.reshape(b, kv_heads, per_kv, d)
    side = q.new_zeros(prompts, kv_heads, group, per_kv, d)  # (P, kv_heads, G, heads/kv_heads, D)
    side[prefix.owner, :, prefix.slot] = q
    scores = torch.matmul(side.view(prompts, kv_heads, group * per_kv, d), pk.transpose(-1, -2))
    scores = scores.view(prompts, kv_heads, group, per_kv, lp)[prefix.owner, :, prefix.slot]  # (B, kv, g, Lp)
    scores = torch.cat([scores, torch.matmul(q, keys.transpose(-1, -2))], -1)  # (B, kv, g, Lp + L)
    weights = _weights_of(scores, mask, values.dtype)
    side = weights.new_zeros(prompts, kv_heads, group, per_kv, lp)
    side[prefix.owner, :, prefix.slot] = weights[..., :lp]
    out = torch.matmul(side.view(prompts, kv_heads, group * per_kv, lp), pv)
    out = out.view(prompts, kv_heads, group, per_kv, d)[prefix.owner, :, prefix.slot]  # (B, kv, g, D)
    return out.add_(torch.matmul(weights[..., lp:], values)).view(b, heads, 1, d)


def _forward(
    w: _Weights,
    ids: Tensor,
    cos: Tensor,
    sin: Tensor,
    cache: _Cache,
    start: int,
    mask: Tensor | None,
    heads: Tensor | None = None,
    few_rows_layout: bool = False,
) -> Tensor:
    """Run tokens `ids` (B, S) at cache positions start..start+S-1; the last position's logits
    (B, V), or with `heads` (indices into the B rows) those rows' logits only (len(heads), V).
    `few_rows_layout`: the matmuls in the layout fastest for a few rows (`_linear`; rollout.draw: fast or auto)."""
    b, s = ids.shape
    q_width, kv_width = w.heads * w.head_dim, w.kv_heads * w.head_dim
    gqa = w.kv_heads != w.heads
    h = F.embedding(ids, w.embed)  # (B, S, H)
    for i, layer in enumerate(w.layers):
        x = _rms_norm(h, layer.norm_attn, w.eps)
        qkv = _linear(x, layer.qkv, layer.qkv_bias, few_rows_layout)  # (B, S, q + 2 kv), q already scaled by 1/sqrt(D)
        # RoPE in float32 whatever the weights' dtype (more accurate in bf16); attention in the
        # cache's dtype (`cache_dtype`: float32 on a CPU, the compute dtype on a GPU).
        qk = qkv[..., : q_width + kv_width].view(b, s, w.heads + w.kv_heads, w.head_dim)
        if layer.q_norm is not None:
            qk = torch.cat(
                [
                    _rms_norm(qk[:, :, : w.heads], layer.q_norm, w.eps),
                    _rms_norm(qk[:, :, w.heads :], layer.k_norm, w.eps),
                ],
                2,
            )
        qk = _rotate(qk.transpose(1, 2).float(), cos, sin)
        q, k = qk[:, : w.heads].to(cache.keys.dtype), qk[:, w.heads :]  # (B, heads, S, D), (B, kv_heads, S, D)
        v = qkv[..., q_width + kv_width :].view(b, s, w.kv_heads, w.head_dim).transpose(1, 2)
        keys, values = cache.keys[i], cache.values[i]
        first = start - cache.offset  # in this cache's positions (the prefix's are before them)
        last = first + s
        keys[:, :, first:last] = k
        values[:, :, first:last] = v
        keys, values = keys[:, :, :last], values[:, :, :last]
        if s == 1 and cache.prefix is not None:
            attn = _attend_shared(q, cache.prefix, i, keys, values, mask)
        elif s == 1:
            attn = _attend_one(q, keys, values, mask)
        else:
            attn = F.scaled_dot_product_attention(
                q, keys, values, attn_mask=mask, enable_gqa=gqa, scale=1.0
            )  # (B, heads, S, D)
        h = h + _linear(
            attn.transpose(1, 2).reshape(b, s, q_width).to(h.dtype), layer.out, layer.out_bias, few_rows_layout
        )
        x = _rms_norm(h, layer.norm_mlp, w.eps)
        gate, up = _linear(x, layer.gate_up, layer.gate_up_bias, few_rows_layout).chunk(2, -1)
        h = h + _linear(F.silu(gate) * up, layer.down, layer.down_bias, few_rows_layout)
    last = h[:, -1] if heads is None else h[heads, -1]
    return _linear(_rms_norm(last, w.norm, w.eps), w.head, w.head_bias, few_rows_layout)  # (B or len(heads), V)


# Below this many rows, rollout.draw: fast computes each matmul of the loop as W @ x^T: on a
# CPU, MKL takes a slow path for x @ W^T (F.linear) with a handful of rows when the weights
# come from memory (benchmarks/README.md, `bench_sampling.py`, has the timings); from about
# 12 rows up both take the same kernel. The two differ in float rounding, so not under
# rollout.draw: generate, whose tokens are generate's bit for bit.
FEW_ROWS = 12


# The rows oneDNN's packed layout is chosen for (`pack_weight`): the fast loop's decoding steps
# run a handful of rows (a prompt's G completions, a few prompts); its prefill runs more, on
# the same packed weights.
PACK_ROWS = 8
# The smallest matrix packed (values): packing pays where a matrix streams from memory; one of
# a tiny model stays in the cache, where oneDNN's call costs more than it saves (the demo's
# 192 x 64 at 8 rows is slower packed than as W @ x^T), and its runs' numbers stay as they
# were.
PACK_FROM = 1 << 18


def packs(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the few-row layout packs its stacked weights for oneDNN (`pack_weight`): float32
    on a CPU whose torch has oneDNN's packed inner product, with oneDNN enabled
    (`torch.backends.mkldnn.enabled`), and where the packed product was seen to give
    F.linear's values (`_packing_serves`). Few-row matmuls from memory run there faster than
    either plain layout (benchmarks/README.md)."""
    mkldnn = torch.ops.mkldnn
    return (
        device.type == "cpu"
        and dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and torch.backends.mkldnn.enabled
        and hasattr(mkldnn, "_reorder_linear_weight")
        and hasattr(mkldnn, "_linear_pointwise")
        and _packing_serves(dtype, device)
    )


@functools.cache  # once per process and (dtype, device): the ops and the CPU do not change
def _packing_serves(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether oneDNN's packed inner product (private ops, trusted by function, not by presence)
    gives F.linear's values here: a small weight packed and run once at a few rows and at more
    than PACK_ROWS, with and without a bias. Where it fails or differs, one warning line and
    the fast draw samples with plain weights (its tokens are then drawn from the same
    distribution, only more slowly)."""
    generator = torch.Generator().manual_seed(0)  # the run's own random stream untouched
    weight = torch.randn(24, 40, generator=generator).to(device, dtype)
    bias = torch.randn(24, generator=generator).to(device, dtype)
    try:
        with torch.no_grad():
            packed = pack_weight(weight)
            for rows in (3, 2 * PACK_ROWS + 1):
                x = torch.randn(rows, 40, generator=generator).to(device, dtype)
                for b in (None, bias):
                    got = _linear(x, packed, b, few_rows_layout=True)
                    expected = F.linear(x, weight, b)
                    # A float dot product of n terms rounds by at most about n * eps * sum |x_i w_i| (+ |b|).
                    scale = x.abs() @ weight.abs().T + (0 if b is None else b.abs())
                    bound = weight.shape[1] * torch.finfo(dtype).eps * scale
                    if got.shape != expected.shape or not bool(((got - expected).abs() <= bound).all()):
                        raise ValueError("its values differ from F.linear's")
    except Exception as err:  # noqa: BLE001 - any failure of a private op: sample with plain weights
        print(
            f"grpo: warning: rollout.draw: fast: oneDNN's packed matmul does not serve on this {device.type} "
            f"({first_line(err)}); sampling with plain weights",
            file=sys.stderr,
        )
        return False
    return True


def pack_weight(weight: Tensor) -> _Packed:
    """`weight` (out, in) reordered into oneDNN's blocked layout for PACK_ROWS rows: a copy of
    the same size (the plain one can go)."""
    return _Packed(torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PACK_ROWS), weight.shape[0])


def _linear(x: Tensor, weight: Tensor | _Packed, bias: Tensor | None, few_rows_layout: bool) -> Tensor:
    """F.linear(x, weight, bias): through oneDNN's inner product for a packed weight (`pack_weight`),
    else as W @ x^T where `few_rows_layout` and x has fewer than FEW_ROWS rows (all dimensions
    but the last) on a CPU."""
    rows = x.numel() // x.shape[-1]
    if isinstance(weight, _Packed):
        out = torch.ops.mkldnn._linear_pointwise(x.reshape(rows, x.shape[-1]), weight.weight, bias, "none", [], "")
        return out.view(*x.shape[:-1], weight.out_features)
    if not (few_rows_layout and rows < FEW_ROWS and x.device.type == "cpu"):
        return F.linear(x, weight, bias)
    out = torch.mm(weight, x.reshape(rows, x.shape[-1]).T).T.contiguous()
    if bias is not None:
        out += bias
    return out.view(*x.shape[:-1], weight.shape[0])
