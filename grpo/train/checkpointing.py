"""A run's checkpoints, as one object: save, restore, save after a failure, the final model.

`Checkpointer` knows the two formats that grpo.infra.checkpoint writes: one process saves
every state dict in `state.pt`; several (FSDP2) save the trained models and the optimizer
as shards, each its own random state, and process 0 what they share. The loop asks when
(`due`: every train.checkpoint_every steps and train.checkpoint_minutes, the first
time-based one early, `FIRST_CHECKPOINT_MINUTES`) and saves after a step, after a failure
(`save_after_failure`: the state taken as the failed step began, `snapshot`, so that the
checkpoint is still that of the last completed step) and at the end (`save_final`); in the
middle of a run `save_copy` writes the policy as final/ is written (train.keep_best's best/).
A write that fails leaves the previous checkpoint in place; `kept` says so. docs/resume.md.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from torch import nn

from grpo.config import Config, config_to_dict
from grpo.errors import first_line
from grpo.infra.checkpoint import list_checkpoints, load_shards, save_checkpoint, save_sharded_checkpoint
from grpo.infra.seed import rng_state, set_rng_state
from grpo.infra.space import writing
from grpo.rollout.weights import base_model, policy_weights
from grpo.train.card import write_card
from grpo.train.evaluation import NoEvaluation
from grpo.train.models import adapter_folder, is_quantized, save_adapter, save_dequantized
from grpo.train.step import Engine

__all__ = ["FIRST_CHECKPOINT_MINUTES", "Checkpointer", "kept", "unwrapped_architecture"]

# The first time-based checkpoint of a run (or of a resumed one) comes this early at the
# latest: one more save a run, after which train.checkpoint_minutes sets the pace.
FIRST_CHECKPOINT_MINUTES = 1.0


class Checkpointer:
    """Saves and restores the state of a run: the engine's models, optimizer and scheduler,
    the prompt stream's position (`prompts`: the run's Rollouts, grpo.train.rollouts, or
    anything with its state_dict and load_state_dict), the reward-model updater (iterative
    RL), the in-loop evaluation's state (`evaluation`: the best evaluated step, the alarm's
    window; grpo.train.evaluation) and the random state, into `output_dir/checkpoints/step-N`
    (the newest `train.keep_checkpoints` kept)."""

    lora_save = "merged"  # lora.save: what final/ and best/ hold of a LoRA policy

    def __init__(self, e: Engine, c: Config, prompts, updater, evaluation=NoEvaluation(), rows: int | None = None):
        self.e, self.c, self.prompts, self.updater = e, c, prompts, updater
        self.rows = rows  # the prompts' rows, for the model card
        self.lora_save = c.lora.save
        self.evaluation = evaluation
        self.output_dir = Path(c.output_dir)
        self.unsaved: int | None = None  # the step whose checkpoint failed to write, not to be tried again
        self.saved_at: float | None = None  # when this process last saved one (time.monotonic)
        self.began = time.monotonic()

    def due(self, step: int) -> bool:
        """Whether a checkpoint is due after `step` completed steps: the last step, every
        train.checkpoint_every steps, and train.checkpoint_minutes after the last save (the
        first after FIRST_CHECKPOINT_MINUTES at most)."""
        t = self.c.train
        first = self.saved_at is None
        minutes = min(t.checkpoint_minutes, FIRST_CHECKPOINT_MINUTES) if first else t.checkpoint_minutes
        since = time.monotonic() - (self.began if first else self.saved_at)
        return (
            step == t.steps
            or bool(t.checkpoint_every and step % t.checkpoint_every == 0)
            or bool(minutes and since >= 60 * minutes)
        )

    def snapshot(self) -> dict:
        """What a checkpoint of the steps completed so far needs, should the next step fail
        before it changes any weight: the random and data state, and the optimizer updates
        made (to tell whether it did change them)."""
        return {"rng": rng_state(), "data": self.prompts.state_dict(), "updates": self.e.version}

    def save(self, step: int, iteration: int, snapshot: dict | None = None, metrics: dict | None = None) -> None:
        """A checkpoint of `step` completed steps (of `iteration`). `snapshot` stands in for
        the current random and data state when the following step failed before it changed
        any weight. `metrics`: step `step`'s line, which resume writes back if the log lacks
        it (its write failed)."""
        e = self.e
        snapshot = snapshot or {"rng": rng_state(), "data": self.prompts.state_dict()}
        keep = self.c.train.keep_checkpoints
        common = {
            "config": config_to_dict(self.c),  # what resume checks a new config against
            "metrics": metrics,  # numbers and None: plain data
            "reward_model_update": self.updater.state_dict(),
            "evaluation": self.evaluation.state_dict(),  # plain data: the best so far, the alarm's window
            "step": step,
            "scheduler": e.optimizer.scheduler.state_dict(),
            "data": snapshot["data"],
            # The reference equals the initial model during the first iteration; after a reset
            # it is a snapshot of the policy, which only the checkpoint can give back.
            "has_reference": iteration > 0,
        }
        self.unsaved = step  # until it is in place
        if e.world.world_size == 1:
            state = {
                **common,
                "policy": e.policy.state_dict(),
                "reference": e.reference.state_dict() if iteration > 0 else None,
                "critic": e.critic.state_dict(),  # None without one
                "optimizer": e.optimizer.state_dict(),
                "rng": snapshot["rng"],
            }
            save_checkpoint(self.output_dir, step, state, keep=keep)
        else:
            sharded = self._sharded_state(iteration > 0)
            local = {"rng": snapshot["rng"]}
            save_sharded_checkpoint(e.world, self.output_dir, step, common, local, sharded, keep=keep)
        self.unsaved = None
        self.saved_at = time.monotonic()

    def restore(self, state: dict) -> int:
        """Load a checkpoint's state (grpo.infra.checkpoint.load_latest_checkpoint's) into the
        run; the number of steps it completed."""
        e = self.e
        if e.world.world_size == 1:
            e.policy.load_state_dict(state["policy"])
            if state["reference"] is not None:
                e.reference.load_state_dict(state["reference"])
            e.critic.load_state_dict(state["critic"])
            e.optimizer.load_state_dict(state["optimizer"])
            set_rng_state(state["rng"])
        else:
            from torch.distributed.checkpoint.state_dict import set_state_dict

            sharded = self._sharded_state(state["has_reference"])
            load_shards(sharded, state["shards"])
            set_state_dict(
                self._trained(),
                e.optimizer.torch,
                model_state_dict=sharded["model"],
                optim_state_dict=sharded["optimizer"],
            )
            if state["has_reference"]:
                e.reference.load_state_dict(sharded["reference"])
            set_rng_state(state["local"]["rng"])
        self.updater.load_state_dict(state["reward_model_update"])
        self.evaluation.load_state_dict(state.get("evaluation"))  # none in a checkpoint of an older run
        e.optimizer.scheduler.load_state_dict(state["scheduler"])
        self.prompts.load_state_dict(state["data"])
        return int(state["step"])

    def save_after_failure(
        self,
        completed: int,
        iteration: int,
        snapshot: dict | None,
        metrics: dict | None,
        *,
        fix: str = "fix the cause",
    ) -> str | None:
        """After an error: a checkpoint of the last completed step (of `iteration`), when the
        weights are still those it ended with; what was done and how to go on, in words (None
        when there was nothing to save). `snapshot`: the one taken as the failing step began,
        None when the failure came after the step completed. `fix`: what the user must do
        before resuming ("free space" when the disk is full)."""
        if completed == 0:
            return None
        if snapshot is not None and snapshot["updates"] != self.e.version:
            return "the failing step had already changed the weights; the newest checkpoint is the one to resume from"
        if self.unsaved == completed:  # the failure was this very checkpoint's write: not again
            return kept(self.output_dir, fix)
        saved = f"checkpoint of step {completed} saved: {fix} and continue with --resume"
        checkpoints = list_checkpoints(self.output_dir)
        if snapshot is None and checkpoints and checkpoints[-1].name == f"step-{completed:06d}":
            return saved  # the failure came after this step's own checkpoint
        try:
            self.save(completed, iteration, snapshot, metrics if snapshot is None else None)
        except Exception as err:  # the disk may be what failed
            return f"could not save a checkpoint of step {completed} ({first_line(err)}); {kept(self.output_dir, fix)}"
        return saved

    def save_final(self, final_dir: Path) -> None:
        """The trained policy as one plain Hugging Face directory, whatever the number of
        processes (process 0 writes it, from the whole weights gathered to it); a LoRA
        policy's adapter instead or beside it, as lora.save asks (`_save_adapter`)."""
        with writing(final_dir):
            if self._save_adapter(final_dir):
                self._save_final(final_dir)
            self.write_card(final_dir, self.c.train.steps)

    def write_card(self, directory: Path, step: int, after: dict | None = None) -> None:
        """The model card of the policy after `step` steps, written by process 0 beside its
        weights in `directory` (grpo.train.card; `after`: its evaluation, not logged yet)."""
        if self.e.world.is_main:
            write_card(directory, self.c, step=step, rows=self.rows, after=after)

    def save_copy(self, directory: Path) -> None:
        """The policy as `save_final` writes it, in the middle of a run: a LoRA policy's
        adapters merged into a copy of its weights (`policy_weights`), the model left as it
        is. Every process calls it; process 0 writes."""
        e = self.e
        with writing(directory):
            if not self._save_adapter(directory):
                return
            if not hasattr(e.policy, "merge_and_unload") or is_quantized(e.policy):  # _save_final copies QLoRA's
                self._save_final(directory)
                return
            model = base_model(e.policy)
            tied = getattr(model.config, "tie_word_embeddings", False)
            with e.world.gathered(e.policy):
                weights = {
                    name: tensor.to("cpu", copy=True)
                    for name, tensor in policy_weights(e.policy)
                    if e.world.is_main and not (tied and name == "lm_head.weight")  # the head is the embedding
                }
            if e.world.is_main:
                model.save_pretrained(directory, state_dict=weights)
                e.tokenizer.save_pretrained(directory)
                if e.world.world_size > 1:
                    unwrapped_architecture(directory, model)
            e.world.barrier()

    def _save_adapter(self, directory: Path) -> bool:
        """lora.save's adapter of a LoRA policy, with the tokenizer, into `directory` (adapter)
        or its adapter/ (both); whether the merged model is still to be written there (both,
        merged, or no LoRA). Every process calls it; process 0 writes."""
        e = self.e
        folder = adapter_folder(directory, self.lora_save) if hasattr(e.policy, "peft_config") else None
        if folder is None:
            return True
        save_adapter(e.policy, folder, main=e.world.is_main)
        if e.world.is_main:
            e.tokenizer.save_pretrained(folder)
        e.world.barrier()
        return folder != directory

    def _save_final(self, final_dir: Path) -> None:
        e = self.e
        policy = e.policy
        if is_quantized(policy):  # QLoRA: merged into the dequantized weights tensor by tensor, never into 4 bits
            save_dequantized(policy, final_dir)  # one process: torchrun is refused with lora.quantize
            e.tokenizer.save_pretrained(final_dir)
            return
        if hasattr(policy, "merge_and_unload"):  # LoRA: save plain weights that any loader reads
            policy = policy.merge_and_unload()
        if e.world.world_size == 1:
            policy.save_pretrained(final_dir)
            e.tokenizer.save_pretrained(final_dir)
            return
        weights = e.world.full_state_dict(policy, main_only=True)
        if e.world.is_main:
            policy.save_pretrained(final_dir, state_dict=weights)
            e.tokenizer.save_pretrained(final_dir)
            unwrapped_architecture(final_dir, policy)
        e.world.barrier()

    def _trained(self) -> nn.ModuleDict:
        """The networks the optimizer moves, under one root (for the sharded state dicts)."""
        return nn.ModuleDict({"policy": self.e.policy, **{"critic": n for n in self.e.critic.networks}})

    def _sharded_state(self, with_reference: bool) -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model, optimizer = get_state_dict(self._trained(), self.e.optimizer.torch)
        return {
            "model": model,
            "optimizer": optimizer,
            **({"reference": self.e.reference.state_dict()} if with_reference else {}),
        }


def kept(output_dir: Path, fix: str = "fix the cause") -> str:
    """After a failure: the checkpoint a resume would continue from, and what to run."""
    checkpoints = list_checkpoints(output_dir)
    if not checkpoints:
        return f"no checkpoint was saved yet: {fix} and start again with --resume (the logged steps are kept aside)"
    step = int(checkpoints[-1].name.removeprefix("step-"))
    return f"the checkpoint of step {step} is kept: {fix} and continue with --resume"


def unwrapped_architecture(directory: Path, model) -> None:
    """config.json names the model's class; FSDP2 renames it (FSDPLlamaForCausalLM): put
    back the class it wraps, so that the directory is the same as one process writes."""
    from torch.distributed.fsdp import FSDPModule

    plain = next(k for k in type(model).__mro__ if not issubclass(k, FSDPModule))
    path = Path(directory) / "config.json"
    config = json.loads(path.read_text())
    config["architectures"] = [plain.__name__]
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
