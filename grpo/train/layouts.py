"""The forward passes over a Rollout, to the completion tokens' log-probs, and which layouts
serve a model.

A layout is how a pass lays out its rows (train.layout): packed (the real tokens end to end,
a group's prompt once, no padding: grpo.train.packing), a group's prompt in a pass of its own
(its KV cache indexed out to the group's rows), or every row in full; with or without
activation checkpointing; through the full logits or the LM head chunk by chunk
(train.chunked_head, `grpo.algo.head_logprobs`: the hidden states taken by a hook where the
head receives them, so that no (N, T, V) logits exist). Each gives the same log-probs;
`decide_layouts` tries them once on a model before the first step and takes the first that
does (tests/train/test_architectures.py). A model whose logits are not its plain nn.Linear
head's output (softcapping, logit scales, a LoRA or quantized head) runs the plain head
(`chunkable_head`).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable

import torch
from torch import Tensor, nn

from grpo.algo import entropy, head_logprobs, token_logprobs
from grpo.errors import UserError, first_line
from grpo.infra import attention as segments
from grpo.infra.packing import mask_dtype, windowed
from grpo.infra.probes import agreed, close, warn
from grpo.rollout import Rollout
from grpo.train.models import activation_checkpointing, disable_checkpointing
from grpo.train.packing import packed_positions, prompt_groups, real_lengths


def completion_logits(model, batch: Rollout, share_prompts: bool = True, *, layout: str | None = None) -> Tensor:
    """Logits that predict each completion token: (N, T, V).

    With `share_prompts`, the G completions of a prompt share its tokens: the prompt runs
    once per group, in the packed layout within the one pass, in the shared-prompt layout as
    a pass of its own (its KV cache then indexed out to the group's rows, which autograd
    turns into a sum of the rows' gradients) with the completions run on top of it. The same
    numbers as one pass over every full row (tests/train/test_models.py,
    tests/train/test_packing.py), with G - 1 fewer passes over each prompt. `layout`: one of
    LAYOUTS, or None for the one `decide_layouts` took for the model."""
    return _completion_positions(model, batch, share_prompts, lambda out: out.logits, layout)


def completion_hidden(model, batch: Rollout, share_prompts: bool = True, *, layout: str | None = None) -> Tensor:
    """What the LM head receives at the positions that predict each completion token:
    (N, T, H), from the same passes as `completion_logits` (prompts shared alike), with the
    head computing nothing (`_head_inputs`)."""
    with _head_inputs(model) as read:
        return _completion_positions(model, batch, share_prompts, read, layout)


def _completion_positions(model, batch: Rollout, share_prompts: bool, read: Callable, layout: str | None) -> Tensor:
    """(N, T, ...) `read(output)` of the passes at the positions that predict completion tokens:
    the logits, or the head's input. A layout that cannot run this batch (a batch the packer
    cannot lay out, a model whose cache rows cannot be selected) leaves it to the padded one."""
    checkpointed = _checkpointed_layers(model)
    layout = layout or layout_of(model, checkpointed is not None)
    if layout == PACKED:
        out = packed_positions(model, batch, share_prompts, read)
        if out is not None:
            return out
    elif layout == SHARED and share_prompts and (groups := prompt_groups(batch)) is not None:
        out = _shared_prompt_positions(model, batch, *groups, read, checkpointed=checkpointed)
        if out is not None:
            return out
    t_len = batch.completion_mask.shape[1]
    out = padded_pass(model, batch, logits_to_keep=t_len + 1)  # only the positions that predict completion tokens
    return read(out)[:, :-1]  # position P-1+t predicts completion token t


def padded_pass(model, batch: Rollout, **kwargs):
    """`model`'s output over every row of `batch` in full (left-padded prompts, right-padded
    completions; positions counting real tokens only)."""
    return model(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        position_ids=batch.position_ids,
        use_cache=False,
        **kwargs,
    )


def _cache_argument(model) -> str:
    """The forward's name for a KV cache: `cache` in recent transformers, `past_key_values` before."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft
    return "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"


def _shared_prompt_positions(
    model, batch: Rollout, first: Tensor, group: Tensor, read: Callable, *, checkpointed: _CheckpointedLayers | None
) -> Tensor | None:
    """`checkpointed`: the layers checkpointed in this forward (`_checkpointed_layers`). None when the model returns no KV cache that rows can be selected from (then the caller
    runs every row in full).

    Under activation checkpointing (a model in training mode with it on) both passes are
    checkpointed, layer by layer, and each layer is handed a cache that its forward may run
    through twice (the backward pass runs a checkpointed layer's forward again): the prompt's
    pass writes its keys and values into a cache that keeps the last ones written (`_SET`),
    the completions' pass reads them through one that stores nothing (`_READ`). Where that
    cannot be arranged (a cache layer of another kind, a transformers without the switch),
    None: every row in full, as before."""
    t_len = batch.completion_mask.shape[1]
    p_len = batch.input_ids.shape[1] - t_len
    positions = batch.position_ids
    argument, written = None, None  # under checkpointing, the prompt pass's own cache, handed to it
    if checkpointed is not None:
        argument, written = _cache_argument(model), checkpointed.new_cache(model)
        if written is None:
            return None
    handed = checkpointed.handed_a_cache if checkpointed is not None else contextlib.nullcontext
    with handed():
        prompt = model(
            input_ids=batch.input_ids[first, :p_len],
            attention_mask=batch.attention_mask[first, :p_len],
            position_ids=positions[first, :p_len],
            logits_to_keep=1,
            use_cache=True,
            **({} if written is None else {argument: written}),
        )  # the distinct prompts: (B, P)
    first_out = read(prompt)[:, -1][group].unsqueeze(1)  # (N, 1, ...): predicts completion token 0
    if t_len == 1:
        return first_out
    cache = written
    if cache is None:  # the one the model returned, under the name of its transformers version
        cache = getattr(prompt, "cache", None)
        if cache is None:
            cache = getattr(prompt, "past_key_values", None)
    if not hasattr(cache, "batch_select_indices"):  # no cache, or one of another kind
        return None
    argument = argument or _cache_argument(model)
    if checkpointed is not None:  # a cache of its own: the prompt's layers write theirs again in the backward
        cache = checkpointed.reading(cache, model, group)
    else:
        cache.batch_select_indices(group)  # each row continues from its prompt's keys and values
    with handed():
        rest = model(
            input_ids=batch.input_ids[:, p_len:-1],  # completion tokens 0..T-2 predict 1..T-1
            attention_mask=batch.attention_mask[:, :-1],
            position_ids=positions[:, p_len:-1],
            use_cache=True,
            **{argument: cache},
        )
    return torch.cat([first_out, read(rest)], 1)


_SET, _READ = "set", "read"  # the kinds of cache layer a checkpointed forward can run through twice


class _CheckpointedLayers:
    """The decoder layers that transformers checkpoints in this forward (its
    GradientCheckpointingLayer with gradient_checkpointing on, the model in training mode and
    gradients on), and what the shared prompt needs of them."""

    def __init__(self, layers: list[nn.Module], model_level: list[nn.Module]):
        self.layers = layers
        self.model_level = model_level  # modules with a gradient_checkpointing flag of their own

    def new_cache(self, model, kind: str = _SET):
        """An empty DynamicCache for the model, its layers of `kind` (`_turn`); None where that
        cannot be: no switch for a layer that takes a cache under checkpointing, or a cache
        layer of another kind (sliding-window, ...)."""
        if not all(hasattr(type(layer), "_can_checkpoint_with_cache") for layer in self.layers):
            return None
        try:
            from transformers.cache_utils import DynamicCache

            config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
            cache = DynamicCache(config=config)
        except Exception:  # noqa: BLE001 (a model whose config builds no cache: the full rows)
            return None
        return cache if _turn(cache, kind) else None

    def reading(self, written, model, group: Tensor):
        """A read-only cache holding, for every row, its prompt's keys and values from the
        prompt pass's cache `written` (rows `group` of it)."""
        cache = self.new_cache(model, _READ)
        for source, target in zip(written.layers, cache.layers, strict=True):
            target.lazy_initialization(source.keys, source.values)
            target.keys, target.values = source.keys[group], source.values[group]
        return cache

    @contextlib.contextmanager
    def handed_a_cache(self):
        """Checkpointed, and handed the cache (transformers drops it otherwise, since a layer
        that appends to it would append twice). Some models (GPT-2) drop it one level up, in
        the loop over their layers, when their own `gradient_checkpointing` flag is on: that
        flag checkpoints nothing there (the layers' flags do), so it is off for the duration."""
        outer = [m for m in self.model_level if m.gradient_checkpointing is True]
        for layer in self.layers:
            layer._can_checkpoint_with_cache = True
        for module in outer:
            module.gradient_checkpointing = False
        try:
            yield
        finally:
            for layer in self.layers:
                del layer._can_checkpoint_with_cache  # the class's value again
            for module in outer:
                module.gradient_checkpointing = True


def _checkpointed_layers(model) -> _CheckpointedLayers | None:
    if not (getattr(model, "training", False) and torch.is_grad_enabled()):
        return None
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:  # an older transformers: no layer takes a cache under checkpointing
        return None
    layers, model_level = [], []
    for m in model.modules():
        if getattr(m, "gradient_checkpointing", False) is True:
            (layers if isinstance(m, GradientCheckpointingLayer) else model_level).append(m)
    return _CheckpointedLayers(layers, model_level) if layers else None


def _turn(cache, kind: str) -> bool:
    """Turn each layer of a DynamicCache into the `kind` of layer that a checkpointed forward
    can run through twice: _SET keeps the keys and values last written (the prompt's pass:
    its second run writes the same ones again), _READ returns the cached ones with the new
    ones after them and stores nothing (the completions' pass). False (nothing changed) when
    a layer is of another kind (sliding-window, quantized, ...)."""
    from transformers.cache_utils import DynamicLayer

    layers = getattr(cache, "layers", None)
    classes = _cache_layer_classes()
    if not layers or any(type(layer) not in (DynamicLayer, *classes.values()) for layer in layers):
        return False
    for layer in layers:
        layer.__class__ = classes[kind]
    return True


@functools.cache
def _cache_layer_classes() -> dict[str, type]:
    from transformers.cache_utils import DynamicLayer

    class SetOnceLayer(DynamicLayer):
        """Keeps the keys and values last written: one write per forward of the prompt."""

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            self.keys, self.values = key_states, value_states
            return key_states, value_states

    class ReadOnlyLayer(DynamicLayer):
        """A prompt's keys and values, read by each forward of a checkpointed layer alike."""

        def update(self, key_states, value_states, *args, **kwargs):
            return torch.cat([self.keys, key_states], dim=-2), torch.cat([self.values, value_states], dim=-2)

    return {_SET: SetOnceLayer, _READ: ReadOnlyLayer}


@contextlib.contextmanager
def _head_inputs(model):
    """For the duration, the LM head computes nothing: a pre-hook keeps the input of each call
    (the final hidden states at the kept positions, (N, k, H)) and hands the head an empty
    slice of it, so the model's logits come out (N, 0, V). Yields `read(output)`, which
    returns the input kept by the forward that made `output`."""
    kept = []

    def keep(module, args):
        kept.append(args[0])
        return (args[0][..., :0, :], *args[1:])

    def read(output) -> Tensor:
        if len(kept) != 1:
            raise UserError(
                f"train.chunked_head: {type(model).__name__} ran its LM head {len(kept)} times in one forward pass; set it to false"
            )
        return kept.pop()

    handle = model.get_output_embeddings().register_forward_pre_hook(keep)
    try:
        yield read
    finally:
        handle.remove()


_VERDICT = "_grpo_logits_are_the_heads"  # the attribute chunkable_head keeps its verdict in


def chunkable_head(model) -> nn.Linear | None:
    """The model's LM head when its logits are exactly `head(hidden)` for a plain nn.Linear
    head (then grpo.algo.head_logprobs computes them chunk by chunk); None otherwise (the
    plain path). Decided once per model, by one forward pass over two tokens: the model's
    logits must be the very tensor its head returned, with no soft-capping, scaling or
    masking after it. The verdict is kept on the model, so that a copy of it (the frozen
    reference) inherits it; build_engine asks before the first step."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if not (
        isinstance(head, nn.Linear) and type(head).forward is nn.Linear.forward and head.weight.is_floating_point()
    ):
        return None
    if not hasattr(model, _VERDICT):
        setattr(model, _VERDICT, _logits_are_the_heads(model, head))
    return head if getattr(model, _VERDICT) else None


def _logits_are_the_heads(model, head: nn.Linear) -> bool:
    outputs = []
    handle = head.register_forward_hook(lambda module, args, output: outputs.append(output))
    device = next(model.parameters()).device
    ids = torch.arange(2, device=device).remainder(head.out_features).unsqueeze(0)  # (1, 2)
    try:
        with torch.no_grad():  # under the caller's autocast: a bf16 reference copy needs it
            logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits
    finally:
        handle.remove()
    return len(outputs) == 1 and torch.equal(outputs[0].float(), logits.float())


def completion_logprobs(
    model,
    batch: Rollout,
    temperature: float,
    repetition_penalty: float = 1.0,
    *,
    share_prompts: bool = True,
    chunked_head: bool = True,
    with_entropy: bool = False,
    layout: str | None = None,
) -> tuple[Tensor, Tensor | None]:
    """(N, T) float32 log-probabilities of the completion tokens under `model`, at the
    sampler's temperature and repetition penalty, and with `with_entropy` the (N, T) entropy
    of each position's distribution (a metric, without a gradient; else None).

    With `chunked_head` (train.chunked_head) and a model that allows it (`chunkable_head`),
    from the hidden states through the head chunk by chunk, at the tokens in the loss only
    (`loss_mask`: the policy's actions; the padding after a row's end, and a tool's tokens
    inside it, get 0 and no gradient, and no loss or metric reads them); else from the full
    logits. The same numbers at every token in the loss either way
    (tests/algo/test_chunked_head.py)."""
    context = prompt_context(batch) if repetition_penalty != 1.0 else None  # only the penalty reads it
    scoring = dict(temperature=temperature, repetition_penalty=repetition_penalty, context=context)
    ids = batch.completion_ids
    head = chunkable_head(model) if chunked_head else None
    if head is not None:
        hidden = completion_hidden(model, batch, share_prompts, layout=layout)  # (N, T, H)
        # The head's weights as the forward left them (under FSDP2, the root's gathered ones).
        return head_logprobs(
            hidden,
            head.weight,
            ids,
            bias=head.bias,
            with_entropy=with_entropy,
            mask=batch.loss_mask.bool(),
            **scoring,
        )
    logits = completion_logits(model, batch, share_prompts, layout=layout)  # (N, T, V)
    logprobs = token_logprobs(logits, ids, **scoring)
    if not with_entropy:
        return logprobs, None
    with torch.no_grad():
        return logprobs, entropy(logits, ids=ids, **scoring)


def micro_batches(
    batch: Rollout, rows: Tensor, size: int, *, by_length: bool = False, whole_groups: bool = True, tokens: int = 0
) -> list[Tensor]:
    """`rows` (indices of `batch`) split into micro-batches of `size` (0 = all in one), or with
    `tokens` (train.micro_batch_tokens) into micro-batches of at most that many real tokens
    (`token_budget_split`).

    With `by_length` (train.length_grouping), ordered by completion length first, longest
    first, so that each micro-batch holds rows of similar length and trims (`Rollout.trimmed`)
    to little padding. With `whole_groups`, the rows of a group (a prompt's G completions,
    rows g*G .. g*G+G-1) stay together, the groups ordered by their longest completion and
    the rows within a group by theirs: a micro-batch that holds a group's rows side by side
    runs its prompt once (`prompt_groups`). The number of micro-batches is the same either
    way; only which rows share one changes."""
    if by_length and len(rows) > 1:
        lengths = batch.completion_lengths.cpu()  # the completion columns each row needs
        rows = rows[torch.sort(lengths[rows], descending=True, stable=True).indices]
        if whole_groups:  # stable sorts, least significant key first
            rows = rows[torch.sort(rows // batch.group_size, stable=True).indices]
            group = rows // batch.group_size
            longest = lengths.new_zeros(int(group.max()) + 1).scatter_reduce(0, group, lengths[rows], "amax")
            rows = rows[torch.sort(longest[group], descending=True, stable=True).indices]
    if tokens:
        return token_budget_split(batch, rows, tokens, whole_groups)
    return [m for m in rows.split(size or max(len(rows), 1)) if len(m)]


def token_budget_split(batch: Rollout, rows: Tensor, tokens: int, whole_groups: bool) -> list[Tensor]:
    """`rows` in their order, cut into consecutive micro-batches of at most `tokens` real tokens
    each (a row's prompt and completion, not their padding; with `whole_groups`, a prompt once
    for each run of adjacent rows of its group, as the packed layout runs it: `prompt_groups`
    shares a prompt between neighbours only). A row longer than the budget is a micro-batch of
    its own. verl's dynamic batch size: passes of similar cost whatever the lengths, and the
    gradient is the same as any other split's (the loss's denominators are the minibatch's)."""
    prompt, completion = (lengths.tolist() for lengths in real_lengths(batch))
    parts, current, used = [], [], 0
    for row in rows.tolist():
        shared = whole_groups and current and current[-1] // batch.group_size == row // batch.group_size
        cost = completion[row] + (0 if shared else prompt[row])
        if current and used + cost > tokens:
            parts.append(current)
            current, used = [], 0
            cost = prompt[row] + completion[row]
        current.append(row)
        used += cost
    if current:
        parts.append(current)
    return [torch.tensor(part, dtype=rows.dtype) for part in parts]


def no_grad_pass(
    forward, batch: Rollout, size: int, *, by_length: bool = False, whole_groups: bool = True
) -> Tensor | None:
    """forward(rows) of `batch` without autograd, `size` rows at a time (all at once when size
    is 0), so that no pass holds a whole large batch's activations. Each micro-batch
    (`micro_batches`: ordered by length with `by_length`) is trimmed to its own longest
    completion and prompt (`Rollout.trimmed`); its (n, T') result is put back at its rows and
    padded with zeros to T, past every row's completion mask. In inference mode (no autograd
    bookkeeping per op); the result is copied out of it, since the update's graph uses it."""
    with torch.inference_mode():
        parts = [
            (rows, forward(batch.select(rows, trim=True)))
            for rows in micro_batches(
                batch, torch.arange(len(batch)), size, by_length=by_length, whole_groups=whole_groups
            )
        ]
        if not parts or parts[0][1] is None:
            return None
        first = parts[0][1]
        out = first.new_zeros((len(batch), *batch.completion_mask.shape[1:], *first.shape[2:]))
        for rows, part in parts:
            out[rows.to(out.device), : part.shape[1]] = part
    return out.clone()


def prompt_context(batch: Rollout) -> Tensor:
    """(N, P) the prompt tokens, -1 on padding: what the repetition penalty counts as already
    seen before the first completion token (generate counts the prompt but not its padding)."""
    p_len = batch.input_ids.shape[1] - batch.completion_mask.shape[1]
    return batch.input_ids[:, :p_len].masked_fill(batch.attention_mask[:, :p_len] == 0, -1)


def policy_logprobs(
    model, batch: Rollout, temperature: float, repetition_penalty: float = 1.0, chunked_head: bool = True
) -> Tensor:
    """(N, T) float32 log-probabilities of the completion tokens under `model`, at the
    sampler's temperature and repetition penalty (see `completion_logprobs`)."""
    return completion_logprobs(model, batch, temperature, repetition_penalty, chunked_head=chunked_head)[0]


# ---- which layouts serve a model: decided once, before the first step ----------------------

PACKED, SHARED, PADDED = "packed", "shared", "padded"
LAYOUTS = (PACKED, SHARED, PADDED)  # the first that serves a model is taken
_LAYOUTS = "_grpo_layouts"  # the attribute decide_layouts keeps its verdicts in


def layout_of(model, checkpointed: bool) -> str:
    """The layout `decide_layouts` took for `model`'s passes in the mode it is in
    (`checkpointed` or not). A model never asked runs the shared prompt (what the tests build
    before any step)."""
    verdicts = getattr(model, _LAYOUTS, None)
    return SHARED if verdicts is None else verdicts[checkpointed]


def decide_layouts(model, checkpointing: bool, layout: str = "auto", key: str = "train.layout", *, world=None) -> bool:
    """Decide, once and before any step, which forward layout serves `model`, by running each on
    a small batch of its own against the plain forward (every row in full, eval mode, the full
    logits): checkpointing (training mode, recomputed in the backward), and the packed and the
    shared-prompt layouts, with and without checkpointing, must give its log-probs within the
    rounding of the dtype it computes in (grpo.infra.probes.close), and the backward must run.
    For each mode the first of LAYOUTS that does is taken (the padded one, every row in full,
    serves every model), with one warning line naming what was passed over and why; the
    verdicts are kept on the model, so that a copy of it, the frozen reference, inherits them.
    Under torchrun (`world`, grpo.infra.distributed) a layout is taken only where every
    process's probe found it serves: processes that took different layouts would run
    different passes, and wait for each other in a collective. Returns whether checkpointing
    stays on (with a warning when it goes: more activation memory, the same numbers).
    `layout` (train.layout, or the setting `key` names): auto, or the one layout to try (the
    padded one, with a warning, where it does not serve)."""
    dtype = mask_dtype(model)  # what the model computes in: the tolerance's unit
    batch = probe_batch(model)
    with torch.no_grad():
        plain = completion_logprobs(model, batch, 1.0, chunked_head=False, layout=PADDED)[0]
    passed_over = {}  # layout -> why, for auto's warning

    def serves(candidate: str, checkpointed: bool) -> bool:
        problem = _layout_problem(model, batch, plain, dtype, candidate, checkpointed)
        if agreed(world, problem is None):
            return True
        passed_over.setdefault(candidate, problem or "another process's probe declined it")
        return False

    asked = LAYOUTS[:-1] if layout == "auto" else [layout]
    candidates = [each for each in asked if each != PACKED or not windowed(model)]

    def first_serving(checkpointed: bool) -> str:
        taken = next((each for each in candidates if each == PADDED or serves(each, checkpointed)), PADDED)
        if layout not in ("auto", taken):
            why = passed_over.get(layout, "its attention is windowed, which the packed mask does not cut")
            warn(
                f"{key}: {layout} does not give {type(model).__name__}'s own log-probs"
                f"{' under checkpointing' if checkpointed else ''} ({why}); every row runs in full (padded)"
            )
        return taken

    setattr(model, _LAYOUTS, {False: PADDED, True: PADDED})  # while probing, each layout as asked
    if checkpointing and not serves(PADDED, checkpointed=True):
        warn(
            f"train.gradient_checkpointing: {type(model).__name__} computes other log-probs in "
            "training mode than in eval mode; training without checkpointing (more activation memory)"
        )
        disable_checkpointing(model)
        checkpointing = False
    passed_over.pop(PADDED, None)
    verdicts = {False: first_serving(False)}
    verdicts[True] = first_serving(True) if checkpointing else PADDED
    setattr(model, _LAYOUTS, verdicts)
    if layout == "auto" and passed_over:
        runs = verdicts[False]
        if checkpointing and verdicts[True] != runs:
            runs += f", {verdicts[True]} under checkpointing"
        reasons = "; ".join(f"{each}: {why}" for each, why in passed_over.items())
        warn(f"{key}: {type(model).__name__}'s passes run {runs} ({reasons})")
    if PACKED in verdicts.values():
        segments.enable(model, world)  # packed passes attend within each sequence only, where that serves
    return checkpointing


def _layout_problem(
    model, batch: Rollout, plain: Tensor, dtype: torch.dtype, candidate: str, checkpointed: bool
) -> str | None:
    """What `candidate` gets wrong on `batch` against the `plain` log-probs (`decide_layouts`),
    or None where it serves."""
    embedded = []  # the input embeddings of each pass: where the probe's backward stops
    handle = model.get_input_embeddings().register_forward_hook(lambda m, a, out: embedded.append(out))
    try:
        with activation_checkpointing(model, checkpointed), torch.enable_grad():
            logprobs = completion_logprobs(model, batch, 1.0, chunked_head=False, layout=candidate)[0]
        if checkpointed:  # the recomputation runs in the backward, after the forward's mode is gone
            _backward(model, logprobs, embedded)
    except Exception as err:  # noqa: BLE001 (a layout the model's code cannot run: not taken)
        return f"cannot run ({type(err).__name__}: {first_line(err)})"
    finally:
        handle.remove()
    if not close(logprobs, plain, dtype, where=batch.loss_mask):
        return "gives other log-probs than every row in full"
    return None


def probe_batch(model) -> Rollout:
    """Two prompts of different lengths (one left-padded), two completions each (one ending
    early): what a step's batch holds, in 7 token columns."""
    vocab = model.get_input_embeddings().num_embeddings
    device = next(model.parameters()).device
    ids = (torch.arange(4 * 7).view(4, 7) * 7 + 5).remainder(vocab)  # (N, P + T)
    attention = torch.ones(4, 7, dtype=torch.long)
    attention[2:, 0] = 0  # the second prompt is one token shorter
    completion = torch.ones(4, 3)
    completion[1, 2] = completion[3, 1:] = 0
    attention[:, 4:] = completion.long()
    ids[2:, :4] = ids[2, :4]  # the rows of a group share their prompt
    ids[:2, :4] = ids[0, :4]
    ids = ids.masked_fill(attention == 0, 0)
    return Rollout(
        input_ids=ids.to(device),
        attention_mask=attention.to(device),
        completion_mask=completion.to(device),
        prompts=[""] * 4,
        completions=[""] * 4,
        rows=[{}] * 4,
        group_size=2,
    )


def _backward(model, logprobs: Tensor, embedded: list[Tensor]) -> None:
    """Run the backward of `logprobs.sum()` through every layer (a checkpointed layer recomputes
    there), to the input embeddings when they take a gradient, else to the trainable weights
    (LoRA's, small): nothing is stored in any `.grad`."""
    inputs = [e for e in embedded if e.requires_grad] or [p for p in model.parameters() if p.requires_grad]
    if inputs:
        torch.autograd.grad(logprobs.sum(), inputs, allow_unused=True)
