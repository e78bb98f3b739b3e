"""Reward models: a scalar score per completion, learned from pairwise comparisons.

GRPO removes PPO's value model, not the reward model: when no rule can check an answer, the
scorer of the G completions is a network, r(prompt, completion) = w . h_last (the backbone's
hidden state at the text's last non-padding token), trained on {prompt, chosen, rejected}
with the Bradley-Terry loss -log sigmoid(r(chosen) - r(rejected)) (InstructGPT, arXiv
2203.02155, eq. 1; `grpo.algo.bradley_terry_loss`). A `RewardModel` is a reward function
with TRL's signature, and `score_steps` scores every prefix of a completion (process
supervision, DeepSeekMath §4.1.3). It is transformers' AutoModelForSequenceClassification
with one output, so a saved one is an ordinary Hugging Face directory. docs/reward-models.md.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from grpo.algo import bradley_terry_loss, pairwise_wins
from grpo.config.fields import REQUIRED, opt
from grpo.data import load_rows
from grpo.errors import UserError
from grpo.infra.distributed import SingleProcess, World, part
from grpo.infra.probes import close
from grpo.infra.hf import load_error, load_tokenizer, quiet_loading, torch_dtype
from grpo.infra.progress import Progress

__all__ = [
    "RewardEvalConfig",
    "RewardModel",
    "RewardTrainConfig",
    "evaluate_reward_model",
    "load_pairs",
    "split_pairs",
    "train_reward_model",
]

_FALLBACK_MAX_LENGTH = 2048  # when neither the tokenizer nor the config states a limit
_NO_LIMIT = 1_000_000  # tokenizers without a limit report model_max_length ~ 1e30


def _load_classifier(path: str, dtype: torch.dtype, **kwargs):
    """AutoModelForSequenceClassification and its loading info, the load report silenced."""
    from transformers import AutoModelForSequenceClassification

    # Built from a causal LM, the new `score` head is "missing" and the LM head "unexpected":
    # the expected outcome. Real problems are checked by the callers from the loading info.
    try:
        with quiet_loading():
            return AutoModelForSequenceClassification.from_pretrained(
                path, dtype=dtype, output_loading_info=True, **kwargs
            )
    except Exception as err:
        raise UserError(f"reward model: cannot load a model from '{path}' ({load_error(err)})") from None


def _default_max_length(model, tokenizer) -> int:
    limits = [tokenizer.model_max_length, getattr(model.config.get_text_config(), "max_position_embeddings", None)]
    limits = [int(x) for x in limits if x is not None and 0 < x < _NO_LIMIT]
    return min(limits) if limits else _FALLBACK_MAX_LENGTH


class RewardModel:
    """A scalar reward model: a causal LM's backbone with a one-output head on its last non-padding token
    (transformers' AutoModelForSequenceClassification with num_labels=1). Choices:
    - the head pools at the rightmost token whose id is not `config.pad_token_id` (it ignores
      the attention mask), so that id is set to the one the tokenizer pads with; with pad =
      EOS, a text's trailing EOS tokens are skipped as padding;
    - right padding (a text's score does not depend on its batch), truncation from the left
      (the end is what the head reads), no EOS appended (as TRL's reward trainer);
    - chat prompts through the chat template, the completion as the assistant turn;
    - eval mode throughout (dropout off), training included, as every model of an RL run;
    - Bradley-Terry fixes rewards up to a constant; GRPO's group baseline removes any
      constant (PPO's does not, which is why InstructGPT shifts its scores): none is shifted."""

    def __init__(self, model, tokenizer, *, batch_size: int = 16, max_length: int | None = None):
        if model.config.num_labels != 1:
            raise ValueError(f"a reward model has one output, this model has {model.config.num_labels}")
        self.model = model.eval()  # dropout off, for scoring and for training alike
        self.tokenizer = tokenizer
        self.batch_size = batch_size  # texts per forward pass when scoring
        self.max_length = max_length or _default_max_length(model, tokenizer)  # tokens per text
        # The head pools at the rightmost token that is not the config's pad id: it must be
        # the id we pad with, or it would read a padding position.
        for config in {id(c): c for c in (model.config, model.config.get_text_config())}.values():
            config.pad_token_id = tokenizer.pad_token_id
        self._packs: bool | None = None  # the packed layout serves this model: decided at the first pass

    # ---- loading and saving -------------------------------------------------------------------

    @classmethod
    def from_base(
        cls, base: str, *, seed: int = 0, dtype: str | torch.dtype = "float32", device: torch.device | str = "cpu", **kw
    ) -> RewardModel:
        """A new, untrained reward model on a causal LM's backbone (a directory or hub id), on `device`.

        The head is freshly initialised from `seed` (the global RNG is left as it was), so
        the same base and seed give the same model.
        """
        tokenizer = load_tokenizer(base, "reward model")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model, _ = _load_classifier(base, torch_dtype(dtype, "reward model"), num_labels=1)
        return cls(model.to(device), tokenizer, **kw)

    @classmethod
    def from_pretrained(
        cls, path: str, *, dtype: str | torch.dtype = "float32", device: torch.device | str = "cpu", **kw
    ) -> RewardModel:
        """A reward model saved by `save` (or any sequence-classification model with one output), on `device`."""
        tokenizer = load_tokenizer(path, "reward model")
        model, info = _load_classifier(path, torch_dtype(dtype, "reward model"))
        if info["missing_keys"]:
            missing = ", ".join(sorted(info["missing_keys"])[:3])
            raise UserError(
                f"reward model: '{path}' is not a trained reward model (no weights for {missing}); "
                f"train one from it with `grpo rm train --model {path} ...`"
            )
        if model.config.num_labels != 1:
            raise UserError(f"reward model: '{path}' has {model.config.num_labels} outputs; a reward model has 1")
        return cls(model.to(device), tokenizer, **kw)

    def save(self, directory: str | Path) -> None:
        """Write a Hugging Face directory that `from_pretrained` (this class's or
        AutoModelForSequenceClassification's) loads."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(directory)
        self.tokenizer.model_max_length = self.max_length  # so a loaded model truncates alike
        self.tokenizer.save_pretrained(directory)

    # ---- scoring ------------------------------------------------------------------------------

    def text(self, prompt: str | list[dict], completion: str) -> str:
        """What the model reads: prompt + completion, or for chat messages the chat template
        with the completion as the assistant's turn."""
        if isinstance(prompt, str):
            return prompt + completion
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise UserError("reward model: the prompts are chat messages but its tokenizer has no chat template")
        messages = [*prompt, {"role": "assistant", "content": completion}]
        return self.tokenizer.apply_chat_template(messages, tokenize=False)

    def _encode(self, prompts: Sequence, completions: Sequence[str]) -> dict[str, Tensor]:
        """Right-padded, left-truncated token ids and attention mask of the texts, on the model's device."""
        tok = self.tokenizer
        tok.padding_side, tok.truncation_side = "right", "left"
        texts = [self.text(prompt, completion) for prompt, completion in zip(prompts, completions, strict=True)]
        ids: list[list[int]] = [[] for _ in texts]
        # A rendered chat template already holds its BOS and turn markers: add none to it.
        for chat in (False, True):
            rows = [i for i, prompt in enumerate(prompts) if isinstance(prompt, str) != chat]
            if rows:
                encoded = tok(
                    [texts[i] for i in rows], add_special_tokens=not chat, truncation=True, max_length=self.max_length
                )
                for i, row_ids in zip(rows, encoded["input_ids"]):
                    ids[i] = row_ids
        if not all(ids):
            raise UserError("reward model: cannot score an empty text (an empty prompt and completion)")
        padded = tok.pad({"input_ids": ids}, padding=True, return_tensors="pt")
        device = next(self.model.parameters()).device
        return {key: value.to(device) for key, value in padded.items()}

    def _forward(self, encoded: dict[str, Tensor]) -> Tensor:
        """(B,) float32 rewards; the head reads each row's last non-padding token. In the packed
        layout (`_packed_forward`: no padding computed) where it gives the model's own scores."""
        if self._packs is None:
            self._packs = self._packing_serves()
            if self._packs:  # its passes then attend within each text only (grpo.infra.attention)
                from grpo.infra import attention

                attention.enable(self.model)
        if self._packs:
            rewards = self._packed_forward(encoded)
            if rewards is not None:
                return rewards
        out = self.model(input_ids=encoded["input_ids"], attention_mask=encoded["attention_mask"], use_cache=False)
        return out.logits.squeeze(-1).float()

    def _packed_forward(self, encoded: dict[str, Tensor]) -> Tensor | None:
        """The rewards of `_forward` from one pass of the backbone over the rows packed end to
        end (grpo.infra.packing.pack_sequences: positions restarting at each text, attention
        kept within it), the head applied to the hidden state where the classifier pools:
        the rightmost token that is not the pad id (transformers' rule for a batch, so that a
        text ending in the pad id's token pools where the padded pass does). None when the
        rows cannot be packed."""
        from grpo.infra import attention
        from grpo.infra.packing import mask_dtype, pack_sequences

        ids = encoded["input_ids"]
        packed = pack_sequences(ids, encoded["attention_mask"])
        if packed is None:
            return None
        backbone = getattr(self.model, self.model.base_model_prefix)
        hidden = backbone(
            input_ids=packed.input_ids,
            attention_mask=packed.attention_mask(mask_dtype(self.model)),
            position_ids=packed.position_ids,
            use_cache=False,
            **attention.arguments(self.model, packed.units, packed.branches),
        ).last_hidden_state  # (bins, L, H)
        columns = torch.arange(ids.shape[1], device=ids.device)
        pooled = (columns * (ids != self.model.config.pad_token_id)).argmax(-1)  # (B,)
        slots = packed.index[torch.arange(len(ids), device=ids.device), pooled]
        return self.model.score(hidden.reshape(-1, hidden.shape[-1])[slots]).squeeze(-1).float()

    def _packing_serves(self) -> bool:
        """Whether `_packed_forward` gives this model's own scores: a backbone and a linear
        `score` head as transformers' causal-LM classifiers have, a pad id, no sliding window,
        and on a probe of three texts of different lengths the padded pass's scores to float
        rounding. Decided once, by capability, never by an error mid-training."""
        from grpo.infra.packing import mask_dtype, windowed

        model = self.model
        head, prefix = getattr(model, "score", None), getattr(model, "base_model_prefix", "")
        pad = model.config.pad_token_id
        if not isinstance(head, torch.nn.Linear) or not hasattr(model, prefix) or pad is None or windowed(model):
            return False
        vocab = model.get_input_embeddings().num_embeddings
        lengths = [5, 2, 7]
        ids = torch.full((len(lengths), max(lengths)), pad, dtype=torch.long)
        attention = torch.zeros_like(ids)
        for i, n in enumerate(lengths):
            ids[i, :n] = (torch.arange(n) * 7 + 3 * i + 1) % vocab
            ids[i, :n] = ids[i, :n].masked_fill(ids[i, :n] == pad, (pad + 1) % vocab)
            attention[i, :n] = 1
        device = next(model.parameters()).device
        probe = {"input_ids": ids.to(device), "attention_mask": attention.to(device)}
        try:
            with torch.no_grad():
                packed = self._packed_forward(probe)
                padded = model(**probe, use_cache=False).logits.squeeze(-1).float()
        except Exception:  # noqa: BLE001 (a layout the model's code cannot run: not taken)
            return False
        return packed is not None and close(packed, padded, mask_dtype(model))

    def _batches(self, n: int, batch_size: int | None) -> Iterator[slice]:
        size = batch_size or self.batch_size
        for start in range(0, n, size):
            yield slice(start, min(start + size, n))

    @torch.no_grad()
    def scores(self, prompts: Sequence, completions: Sequence[str], *, batch_size: int | None = None) -> Tensor:
        """(N,) float32 on the CPU: the reward of each (prompt, completion) pair."""
        if len(prompts) != len(completions):
            raise ValueError(f"got {len(prompts)} prompts for {len(completions)} completions")
        self.model.eval()
        parts = [
            self._forward(self._encode(prompts[s], completions[s])).cpu()
            for s in self._batches(len(completions), batch_size)
        ]
        return torch.cat(parts) if parts else torch.empty(0)

    def score_steps(
        self, prompts: Sequence, completions: Sequence[str], step_ends: Sequence[Sequence[int]]
    ) -> list[list[float]]:
        """A process reward model: for completion i, the score of prompt_i + completion_i[:end]
        for every character offset `end` in step_ends[i]. All prefixes are scored in batches."""
        if not len(prompts) == len(completions) == len(step_ends):
            raise ValueError(
                f"got {len(prompts)} prompts, {len(completions)} completions and {len(step_ends)} step lists"
            )
        flat_prompts, prefixes = [], []
        for prompt, completion, ends in zip(prompts, completions, step_ends):
            for end in ends:
                if not 0 <= end <= len(completion):
                    raise ValueError(f"step end {end} is outside a completion of {len(completion)} characters")
                flat_prompts.append(prompt)
                prefixes.append(completion[:end])
        flat = self.scores(flat_prompts, prefixes).tolist()
        out, start = [], 0
        for ends in step_ends:
            out.append(flat[start : start + len(ends)])
            start += len(ends)
        return out

    def __call__(self, prompts: list, completions: list[str], **columns: Any) -> list[float]:
        """The reward-function protocol (TRL's signature): one score per completion. The
        dataset's other columns are accepted and not used."""
        return self.scores(prompts, completions).tolist()

    # ---- training -----------------------------------------------------------------------------

    def fit(
        self,
        pairs: Sequence[dict],
        *,
        lr: float = 1e-4,
        epochs: int = 1,
        batch_size: int = 16,
        weight_decay: float = 0.0,
        seed: int = 0,
        progress: bool = True,
        log_every: int = 10,
        world: World = SingleProcess(),
    ) -> list[float]:
        """Train on comparisons {prompt, chosen, rejected} with the Bradley-Terry loss.

        Every parameter is trained, with AdamW. Each epoch visits the pairs in an order drawn
        from a private generator seeded with `seed` (the global RNGs are not touched). A
        batch's chosen and rejected texts go through the model in one forward pass. Returns
        the loss of every batch, in order.

        Over several processes (`world`: iterative RL under torchrun) each holds a replica and
        the same `pairs` and `seed`, and they learn data parallel: each runs its part of every
        batch, its loss scaled by its part's share, and the gradients are summed over processes
        (`sum_gradients`), so every replica takes the whole batch's step (the losses and
        accuracies are the whole batches').

        With `progress`, a bar on a terminal, else a line every `log_every` batches
        (grpo.infra.progress): the epoch, and the epoch's running loss and training
        accuracy (pairs whose chosen scored above rejected, ties 1/2).
        """
        if not pairs:
            raise ValueError("fit needs at least one pair")
        generator = torch.Generator().manual_seed(seed)
        params = [p for p in self.model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
        self.model.eval()  # dropout off; gradients flow regardless of the mode
        batches_per_epoch = math.ceil(len(pairs) / batch_size)
        bar = Progress(
            epochs * batches_per_epoch, desc="reward model", prefix="grpo rm train", every=log_every, enabled=progress
        )
        losses: list[float] = []
        try:
            for epoch in range(1, epochs + 1):
                order = torch.randperm(len(pairs), generator=generator).tolist()
                epoch_losses: list[float] = []
                wins = 0.0  # this epoch's pairs with r(chosen) > r(rejected), ties 1/2
                for start in range(0, len(pairs), batch_size):
                    batch = order[start : start + batch_size]
                    rows = [
                        pairs[i] for i in batch[part(len(batch), world.rank, world.world_size)]
                    ]  # this process's part
                    b = len(rows)
                    optimizer.zero_grad(set_to_none=True)
                    ours = torch.zeros(2, dtype=torch.float64)  # this part's loss (as a share of the batch's), wins
                    if rows:  # none: a process with no part of a short batch adds nothing but its zeros
                        prompts = [row["prompt"] for row in rows] * 2
                        completions = [row["chosen"] for row in rows] + [row["rejected"] for row in rows]
                        rewards = self._forward(self._encode(prompts, completions))  # (2b,): chosen, then rejected
                        loss = bradley_terry_loss(rewards[:b], rewards[b:]) * (b / len(batch))
                        loss.backward()
                        chosen, rejected = rewards[:b].detach(), rewards[b:].detach()
                        ours = torch.stack([loss.detach().double().cpu(), pairwise_wins(chosen, rejected).sum().cpu()])
                    world.sum_gradients(params)
                    optimizer.step()
                    batch_loss, batch_wins = world.sum(ours).tolist()
                    epoch_losses.append(batch_loss)
                    wins += batch_wins
                    bar.update(
                        1,
                        epoch=f"{epoch}/{epochs}",
                        loss=sum(epoch_losses) / len(epoch_losses),
                        accuracy=wins / (start + len(batch)),
                    )
                losses.extend(epoch_losses)
        finally:
            bar.close()
            optimizer.zero_grad(set_to_none=True)  # free the gradients' memory
        return losses

    def evaluate(self, pairs: Sequence[dict], *, batch_size: int | None = None) -> dict:
        """Pairwise accuracy on comparisons: {"accuracy": fraction of pairs with
        r(chosen) > r(rejected), a tie counting 1/2; "margin": mean r(chosen) - r(rejected);
        "pairs": how many}."""
        if not pairs:
            raise ValueError("evaluate needs at least one pair")
        prompts = [row["prompt"] for row in pairs]
        chosen = self.scores(prompts, [row["chosen"] for row in pairs], batch_size=batch_size)  # (n,)
        rejected = self.scores(prompts, [row["rejected"] for row in pairs], batch_size=batch_size)  # (n,)
        wins = pairwise_wins(chosen, rejected)
        margin = (chosen - rejected).double().mean()
        return {"accuracy": wins.mean().item(), "margin": margin.item(), "pairs": len(pairs)}


# ---- comparison data ---------------------------------------------------------------------------


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def load_pairs(path: str) -> list[dict]:
    """Comparisons from a data file or dataset (any format `grpo.data.load_rows` reads): every
    row has a `prompt` (text or chat messages) and the strings `chosen` and `rejected`, the
    completion preferred and the one not. Other columns are kept. At least two rows."""
    rows = load_rows(path, prompt_column="prompt")
    for number, row in enumerate(rows, start=1):
        for key in ("chosen", "rejected"):
            if key not in row:
                raise UserError(f"data: {path} row {number} has no {key!r} (columns: {', '.join(row)})")
            if not isinstance(row[key], str):
                raise UserError(f"data: {path} row {number}: {key!r} must be a string, got {_kind(row[key])}")
    if len(rows) < 2:
        raise UserError(f"data: {path} has {len(rows)} comparison; a reward model needs at least 2")
    return rows


def split_pairs(pairs: Sequence[dict], eval_fraction: float, *, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """(train, held_out): a seeded random `eval_fraction` of the pairs held out, at least one
    when the fraction is positive, and at least one left to train on."""
    if not 0.0 <= eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be in [0, 1), got {eval_fraction}")
    n = len(pairs)
    n_eval = max(1, round(n * eval_fraction)) if eval_fraction > 0 else 0
    if n - n_eval < 1:
        raise UserError(f"data: {n} comparisons leave none to train on after holding out {n_eval}")
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    return [pairs[i] for i in order[n_eval:]], [pairs[i] for i in order[:n_eval]]


# ---- the commands: grpo rm train and grpo rm eval ---------------------------------------------


@dataclass(frozen=True)
class RewardTrainConfig:
    """What `grpo rm train` trains: a reward model on `model` from the comparisons in `data`."""

    model: str = opt(REQUIRED, "The causal LM to start from (directory or hub id).")
    data: str = opt(REQUIRED, "Comparisons: rows of prompt, chosen, rejected.")
    lr: float = opt(1e-4, "AdamW learning rate.")
    epochs: int = opt(1, "Passes over the pairs.")
    batch_size: int = opt(16, "Pairs per update.")
    eval_fraction: float = opt(0.1, "Fraction of the pairs held out to measure accuracy.")
    seed: int = opt(0, "Seeds the new head, the split and the order.")
    max_length: int | None = opt(
        None, "Tokens per text; longer texts lose their beginning. Default: the model's limit."
    )


@dataclass(frozen=True)
class RewardEvalConfig:
    """What `grpo rm eval` measures: a trained reward model on the comparisons in `data`."""

    model: str = opt(REQUIRED, "A reward model saved by `grpo rm train`.")
    data: str = opt(REQUIRED, "Comparisons: rows of prompt, chosen, rejected.")
    batch_size: int = opt(32, "Texts per forward pass.")


def train_reward_model(
    output: str | Path,
    config: RewardTrainConfig,
    *,
    overwrite: bool = False,
    progress: bool = True,
    log_every: int = 10,
    device: str = "auto",
) -> dict:
    """What `grpo rm train` does: hold out a seeded fraction of the comparisons in the config's
    data, train a reward model on its model with the rest, measure it on the held-out pairs
    (before and after training) and save it to `output`. Returns the summary the command prints.

    Checks the output directory, the device and the data before any model is loaded.
    """
    from grpo.infra.devices import resolve_device

    c = config
    out = Path(output)
    if out.exists() and not out.is_dir():
        raise UserError(f"output: '{out}' exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise UserError(f"output: '{out}' is not empty; pass --overwrite to write into it, or choose another")
    where = resolve_device(device, "--device")
    pairs = load_pairs(c.data)
    train, held_out = split_pairs(pairs, c.eval_fraction, seed=c.seed)

    started = time.perf_counter()
    model = RewardModel.from_base(c.model, seed=c.seed, max_length=c.max_length, device=where)
    before = model.evaluate(held_out) if held_out else None
    losses = model.fit(
        train,
        lr=c.lr,
        epochs=c.epochs,
        batch_size=c.batch_size,
        seed=c.seed,
        progress=progress,
        log_every=log_every,
    )
    after = model.evaluate(held_out) if held_out else None
    model.save(out)
    none = {"accuracy": None, "margin": None}  # nothing held out
    before, after = before or none, after or none
    return {
        "output": str(out),
        "accuracy": after["accuracy"],  # on the held-out pairs
        "margin": after["margin"],
        "pairs": len(held_out),
        "initial_accuracy": before["accuracy"],
        "train_pairs": len(train),
        "epochs": c.epochs,
        "loss/first": losses[0],
        "loss/last": losses[-1],
        "time_s": round(time.perf_counter() - started, 3),
    }


def evaluate_reward_model(config: RewardEvalConfig, *, device: str = "auto") -> dict:
    """What `grpo rm eval` does: the accuracy and margin of the saved reward model on the
    config's comparisons (`RewardModel.evaluate`), with its model and data. Bad data fails
    before the model loads."""
    from grpo.infra.devices import resolve_device

    where = resolve_device(device, "--device")
    pairs = load_pairs(config.data)
    model = RewardModel.from_pretrained(config.model, batch_size=config.batch_size, device=where)
    return {**model.evaluate(pairs), "model": config.model, "data": config.data}
