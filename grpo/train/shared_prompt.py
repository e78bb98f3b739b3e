"""The shared-prompt layout's passes (grpo.train.layouts.SharedPrompt): a group's prompt in a
pass of its own, its KV cache indexed out to the group's rows, the completions run on top of
it; under activation checkpointing, with caches that a checkpointed layer's forward may run
through twice (its recomputation in the backward).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable

import torch
from torch import Tensor, nn

from grpo.rollout import Rollout


def _cache_argument(model) -> str:
    """The forward's name for a KV cache: `cache` in recent transformers, `past_key_values` before."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft
    return "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"


def shared_prompt_positions(
    model, batch: Rollout, first: Tensor, group: Tensor, read: Callable, *, checkpointed: _CheckpointedLayers | None
) -> Tensor | None:
    """(N, T, ...) `read(output)` at the positions that predict completion tokens: the distinct
    prompts (rows `first`) in one pass, each row (`group`: its prompt's) continuing from its
    prompt's KV cache. `checkpointed`: the layers checkpointed in this forward
    (`checkpointed_layers`). None when the model returns no KV cache that rows can be
    selected from (then the caller runs every row in full).

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


def checkpointed_layers(model) -> _CheckpointedLayers | None:
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
