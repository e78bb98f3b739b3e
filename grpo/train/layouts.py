"""The forward passes over a Rollout, to the completion tokens' log-probs, and which layouts
serve a model.

A layout is how a pass lays out its rows (train.layout), one object behind the `Layout`
protocol: `Packed` (the real tokens end to end, a group's prompt once, no padding:
grpo.train.packed_layout), `SharedPrompt` (a group's prompt in a pass of its own, its KV cache
indexed out to the group's rows), or `Padded` (every row in full); with or without
activation checkpointing; through the full logits or the LM head chunk by chunk
(train.chunked_head, `grpo.algo.head_logprobs`: the hidden states taken by a hook where the
head receives them, so that no (N, T, V) logits exist). Each gives the same log-probs;
`decide_layouts` tries them once on a model before the first step and takes the first that
does (tests/train/test_architectures.py) and returns what it took (`Taken`); `update_layout`
hands the update the one it runs. A model whose logits are not its plain nn.Linear head's
output (softcapping, logit scales, a LoRA or quantized head) runs the plain head
(`chunkable_head`). What was decided for a model is held by its caller and by the layout
objects built from it (`Verdicts`), never set on the model.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import ClassVar, Protocol

import torch
from torch import Tensor, nn

from grpo.algo import entropy, head_logprobs, token_logprobs
from grpo.errors import UserError, first_line
from grpo.infra import attention as segments
from grpo.infra.packing import mask_dtype, windowed
from grpo.infra.probes import agreed, close, warn
from grpo.rollout import Rollout
from grpo.train.models import activation_checkpointing, disable_checkpointing
from grpo.train.packed_layout import packed_positions, prompt_groups, real_lengths
from grpo.train.shared_prompt import checkpointed_layers
from grpo.train.shared_prompt import shared_prompt_positions as _shared_prompt_positions

PACKED, SHARED, PADDED = "packed", "shared", "padded"
LAYOUTS = (PACKED, SHARED, PADDED)  # the first that serves a model is taken


@dataclass(frozen=True, kw_only=True)
class Verdicts:
    """What was decided for the model a layout object runs, held by the layout (built by the
    engine from its `Decisions`, grpo.train.step), not by the model. Left at None: undecided,
    as for a helper's call on a model nobody decided for."""

    # Whether its LM head runs chunk by chunk (train.chunked_head and `chunkable_head`'s verdict);
    # None: `chunkable_head` asked at each pass that wants it.
    chunked_head: bool | None = None
    # The dtype its forward computes in where that is not its weights' (a bf16-stored reference
    # cast up as it runs: grpo.train.networks): a packed pass's mask is made in it. None: mask_dtype's.
    computes_in: torch.dtype | None = None

    @property
    def verdicts(self) -> dict:
        """These verdicts as keywords, for a layout derived from this one (`unshared`)."""
        return dict(chunked_head=self.chunked_head, computes_in=self.computes_in)

    def head(self, model, asked: bool) -> nn.Linear | None:
        """The head that runs chunk by chunk where `asked` (train.chunked_head): as decided
        for the model, else as `chunkable_head` finds; None for the full logits."""
        if not asked or self.chunked_head is False:
            return None
        return model.get_output_embeddings() if self.chunked_head else chunkable_head(model)


class Layout(Protocol):
    """How a forward pass lays out a batch's rows (the module doc): what the step and the
    passes call. A layout gives (N, T, ...) outputs at the positions that predict each
    completion token (`positions`); the logits, the head's inputs and the log-probs are
    built on it alike for every layout. Taken once per model (`decide_layouts`); the object
    also holds what was decided for that model (`Verdicts`)."""

    name: str  # one of LAYOUTS (train.layout's values)
    shares_prompts: bool  # a group's prompt runs once for its rows side by side
    shares_in_one_pass: bool  # ...inside the one pass (the number of passes never depends on the rows)
    whole_groups: bool  # micro-batches keep a group's rows side by side (`micro_batches`)
    chunked_head: bool | None  # `Verdicts`
    computes_in: torch.dtype | None

    def head(self, model, asked: bool) -> nn.Linear | None: ...

    def positions(self, model, batch: Rollout, read: Callable) -> Tensor:
        """(N, T, ...) `read(output)` of its passes at the positions that predict completion
        tokens: the logits, or the head's input. Where it cannot run this batch (a batch the
        packer cannot lay out, a model whose cache rows cannot be selected), every row in full."""
        ...

    def unshared(self) -> Layout:
        """The layout that shares no prompt (every row with its own), micro-batches cut row by row."""
        ...

    def logits(self, model, batch: Rollout) -> Tensor:
        """Logits that predict each completion token: (N, T, V). The same numbers as one pass
        over every full row (tests/train/test_models.py, tests/train/test_packing.py)."""
        return self.positions(model, batch, lambda out: out.logits)

    def hidden(self, model, batch: Rollout) -> Tensor:
        """What the LM head receives at the positions that predict each completion token:
        (N, T, H), from the same passes as `logits`, with the head computing nothing
        (`_head_inputs`)."""
        with _head_inputs(model) as read:
            return self.positions(model, batch, read)

    def logprobs(
        self,
        model,
        batch: Rollout,
        temperature: float,
        repetition_penalty: float = 1.0,
        *,
        chunked_head: bool = True,
        with_entropy: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """(N, T) float32 log-probabilities of the completion tokens under `model`, at the
        sampler's temperature and repetition penalty, and with `with_entropy` the (N, T)
        entropy of each position's distribution (a metric, without a gradient; else None).

        With `chunked_head` (train.chunked_head) and a model that allows it (`Verdicts.head`),
        from the hidden states through the head chunk by chunk, at the tokens in the loss only
        (`loss_mask`: the policy's actions; the padding after a row's end, and a tool's tokens
        inside it, get 0 and no gradient, and no loss or metric reads them); else from the full
        logits. The same numbers at every token in the loss either way
        (tests/algo/test_chunked_head.py)."""
        context = prompt_context(batch) if repetition_penalty != 1.0 else None  # only the penalty reads it
        scoring = dict(temperature=temperature, repetition_penalty=repetition_penalty, context=context)
        ids = batch.completion_ids
        head = self.head(model, chunked_head)
        if head is not None:
            hidden = self.hidden(model, batch)  # (N, T, H)
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
        logits = self.logits(model, batch)  # (N, T, V)
        logprobs = token_logprobs(logits, ids, **scoring)
        if not with_entropy:
            return logprobs, None
        with torch.no_grad():
            return logprobs, entropy(logits, ids=ids, **scoring)


@dataclass(frozen=True)
class Padded(Verdicts, Layout):
    """Every row in full: left-padded prompts, right-padded completions (`padded_pass`). Serves
    every model. `whole_groups`: whether micro-batches still keep a group's rows side by side
    (an order of the rows only, as where the run could share prompts)."""

    whole_groups: bool = True
    name: ClassVar[str] = PADDED
    shares_prompts: ClassVar[bool] = False
    shares_in_one_pass: ClassVar[bool] = False

    def positions(self, model, batch: Rollout, read: Callable) -> Tensor:
        t_len = batch.completion_mask.shape[1]
        out = padded_pass(model, batch, logits_to_keep=t_len + 1)  # only the positions that predict completion tokens
        return read(out)[:, :-1]  # position P-1+t predicts completion token t

    def unshared(self) -> Layout:
        return replace(self, whole_groups=False)


@dataclass(frozen=True)
class SharedPrompt(Verdicts, Layout):
    """A group's prompt in a pass of its own, its KV cache indexed out to the group's rows
    (which autograd turns into a sum of the rows' gradients), the completions run on top of
    it: G - 1 fewer passes over each prompt. Under activation checkpointing both passes are
    checkpointed, layer by layer (`_shared_prompt_positions`)."""

    name: ClassVar[str] = SHARED
    shares_prompts: ClassVar[bool] = True
    shares_in_one_pass: ClassVar[bool] = False
    whole_groups: ClassVar[bool] = True

    def positions(self, model, batch: Rollout, read: Callable) -> Tensor:
        if (groups := prompt_groups(batch)) is not None:
            out = _shared_prompt_positions(model, batch, *groups, read, checkpointed=checkpointed_layers(model))
            if out is not None:
                return out
        return Padded().positions(model, batch, read)

    def unshared(self) -> Layout:
        return Padded(whole_groups=False, **self.verdicts)


@dataclass(frozen=True)
class Packed(Verdicts, Layout):
    """The real tokens end to end in one pass, no padding (grpo.train.packed_layout); with
    `shares_prompts`, a group's prompt packed once, inside that one pass."""

    shares_prompts: bool = True
    name: ClassVar[str] = PACKED
    shares_in_one_pass: ClassVar[bool] = True

    @property
    def whole_groups(self) -> bool:
        return self.shares_prompts

    def positions(self, model, batch: Rollout, read: Callable) -> Tensor:
        out = packed_positions(model, batch, self.shares_prompts, read, computes_in=self.computes_in)
        return Padded().positions(model, batch, read) if out is None else out

    def unshared(self) -> Layout:
        return replace(self, shares_prompts=False)


def as_layout(layout: Layout | str | None = None, share_prompts: bool = True) -> Layout:
    """`layout` as a Layout: one given (with what was decided for its model), a name of
    LAYOUTS, or None for the shared prompt (what a model nobody decided for runs: the tests'
    and the helpers'); without `share_prompts`, its `unshared` variant."""
    if layout is None:
        layout = SHARED
    if isinstance(layout, str):
        layout = layout_named(layout)
    return layout if share_prompts else layout.unshared()


def completion_logits(
    model, batch: Rollout, share_prompts: bool = True, *, layout: Layout | str | None = None
) -> Tensor:
    """(N, T, V) `Layout.logits` of `layout` (`as_layout`)."""
    return as_layout(layout, share_prompts).logits(model, batch)


def completion_hidden(
    model, batch: Rollout, share_prompts: bool = True, *, layout: Layout | str | None = None
) -> Tensor:
    """(N, T, H) `Layout.hidden` of `layout` (`as_layout`)."""
    return as_layout(layout, share_prompts).hidden(model, batch)


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


# chunkable_head's probes, by model object: a helper's call on a model (no `Verdicts`) probes
# it once. Nothing decides from it: a run's engine hands its verdict to the layouts it builds.
_PROBED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def chunkable_head(model) -> nn.Linear | None:
    """The model's LM head when its logits are exactly `head(hidden)` for a plain nn.Linear
    head (then grpo.algo.head_logprobs computes them chunk by chunk); None otherwise (the
    plain path). Found by one forward pass over two tokens (once per model object): the
    model's logits must be the very tensor its head returned, with no soft-capping, scaling
    or masking after it. build_engine asks before the first step, and hands the verdict to
    the passes of the policy and of its reference (`Verdicts.chunked_head`)."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if not (
        isinstance(head, nn.Linear) and type(head).forward is nn.Linear.forward and head.weight.is_floating_point()
    ):
        return None
    if model not in _PROBED:
        _PROBED[model] = _logits_are_the_heads(model, head)
    return head if _PROBED[model] else None


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
    layout: Layout | str | None = None,
) -> tuple[Tensor, Tensor | None]:
    """`Layout.logprobs` of `layout` (`as_layout`)."""
    return as_layout(layout, share_prompts).logprobs(
        model, batch, temperature, repetition_penalty, chunked_head=chunked_head, with_entropy=with_entropy
    )


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
    model,
    batch: Rollout,
    temperature: float,
    repetition_penalty: float = 1.0,
    chunked_head: bool = True,
    *,
    layout: Layout | str | None = None,
) -> Tensor:
    """(N, T) float32 log-probabilities of the completion tokens under `model`, at the
    sampler's temperature and repetition penalty, in `layout` (see `completion_logprobs`)."""
    scoring = dict(chunked_head=chunked_head, layout=layout)
    return completion_logprobs(model, batch, temperature, repetition_penalty, **scoring)[0]


# ---- which layouts serve a model: decided once, before the first step ----------------------


@dataclass(frozen=True)
class Taken:
    """What `decide_layouts` took for a model, returned to its caller (never kept on the
    model): whether activation checkpointing stays on, and the layout of its passes in each
    mode."""

    checkpointing: bool
    plain: str  # outside checkpointing: eval mode, and every pass without a gradient (the reference's)
    checkpointed: str  # under checkpointing (PADDED where it is off)

    def layout(self, checkpointed: bool) -> str:
        return self.checkpointed if checkpointed else self.plain


def layout_named(name: str, **verdicts) -> Layout:
    """The layout train.layout's `name` stands for (one of LAYOUTS), sharing prompts, with
    what was decided for its model (`Verdicts`' fields)."""
    return {PACKED: Packed, SHARED: SharedPrompt, PADDED: Padded}[name](**verdicts)


def update_layout(name: str, *, one_pass: bool, chunked_head: bool | None = None) -> Layout:
    """The layout of the update's forward, given the one `decide_layouts` took for the policy
    in the update's mode (`name`); the step asks it once (`grpo.train.step.Engine`). In the
    packed layout a group's prompt runs once, in the same one pass as its completions; in the
    shared-prompt layout (a pass over the prompt, its KV cache read by the completions' pass)
    only where a pass more is harmless, else every row with its own prompt (`unshared`).
    `one_pass`: where it is not: the policy is sharded (its forward passes are collectives:
    every process must run as many, and sharing prompts makes their number depend on the
    rows), or the optimizer steps in the backward (train.optimizer_in_backward: a weight that
    two passes use has its gradient complete only when the second one's backward ends, and
    the prompt's pass is the last to run backward, so every layer's gradient would wait for
    the end of the backward, which that step exists to avoid; torch's memory profiler shows
    the update's peak of live tensors well above the unshared one's: docs/memory.md).
    `chunked_head`: what was decided for the policy's head (`Verdicts`)."""
    layout = layout_named(name, chunked_head=chunked_head)
    return layout.unshared() if one_pass and not layout.shares_in_one_pass else layout


def decide_layouts(model, checkpointing: bool, layout: str = "auto", key: str = "train.layout", *, world=None) -> Taken:
    """Decide, once and before any step, which forward layout serves `model`, by running each on
    a small batch of its own against the plain forward (every row in full, eval mode, the full
    logits): checkpointing (training mode, recomputed in the backward), and the packed and the
    shared-prompt layouts, with and without checkpointing, must give its log-probs within the
    rounding of the dtype it computes in (grpo.infra.probes.close), and the backward must run.
    For each mode the first of LAYOUTS that does is taken (the padded one, every row in full,
    serves every model), with one warning line naming what was passed over and why.
    Under torchrun (`world`, grpo.infra.distributed) a layout is taken only where every
    process's probe found it serves: processes that took different layouts would run
    different passes, and wait for each other in a collective. Returns what it took (`Taken`:
    the layout of each mode, and whether checkpointing stays on, with a warning when it goes:
    more activation memory, the same numbers).
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

    if checkpointing and not serves(PADDED, checkpointed=True):
        warn(
            f"train.gradient_checkpointing: {type(model).__name__} computes other log-probs in "
            "training mode than in eval mode; training without checkpointing (more activation memory)"
        )
        disable_checkpointing(model)
        checkpointing = False
    passed_over.pop(PADDED, None)
    unchecked = first_serving(False)
    taken = Taken(checkpointing, unchecked, first_serving(True) if checkpointing else PADDED)
    if layout == "auto" and passed_over:
        runs = taken.plain
        if checkpointing and taken.checkpointed != runs:
            runs += f", {taken.checkpointed} under checkpointing"
        reasons = "; ".join(f"{each}: {why}" for each, why in passed_over.items())
        warn(f"{key}: {type(model).__name__}'s passes run {runs} ({reasons})")
    if PACKED in (taken.plain, taken.checkpointed):
        segments.enable(model, world)  # packed passes attend within each sequence only, where that serves
    return taken


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
