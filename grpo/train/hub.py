"""train.push_to_hub: the run's model sent to a Hugging Face Hub repository.

What is sent is a folder as final/ is written (the weights as saved, merged or adapter, the
tokenizer, the model card and the config beside it), through huggingface_hub's create_repo
(exist_ok, train.hub_private) and upload_folder: at the end of the run, and with
train.hub_strategy every_save after each checkpoint too (the policy written as final/ is, into
output_dir/hub.tmp, then removed: never the resumable state). What can be known before any
model loads is checked then (`check_hub`: the package, a token, offline mode); a push that
fails (the network, the server, the token's rights) is one warning line naming the command
that pushes by hand, and the run on disk stays as it is. Process 0 pushes. The user's guide:
docs/training.md#the-model-card-and-the-hub.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from grpo.config import Config
from grpo.errors import UserError, first_line

__all__ = ["STAGING", "Hub", "NoHub", "by_hand", "check_hub", "hub_for", "push_folder"]

STAGING = "hub.tmp"  # output_dir/hub.tmp: a checkpoint's policy as final/ is written, while it is pushed


def check_hub(c: Config) -> None:
    """What can be wrong with train.push_to_hub before any model loads, as one line: the
    package, offline mode, a token (whether the network and the token's rights hold is
    known at the push)."""
    if not c.train.push_to_hub:
        return
    try:
        import huggingface_hub
    except ImportError:
        raise UserError("train.push_to_hub: needs huggingface_hub: pip install huggingface_hub") from None
    if huggingface_hub.constants.HF_HUB_OFFLINE:
        raise UserError(
            "train.push_to_hub: HF_HUB_OFFLINE is set, so nothing reaches the Hub: unset it, or leave train.push_to_hub empty"
        )
    if huggingface_hub.get_token() is None:
        raise UserError(
            "train.push_to_hub: no Hugging Face token: run `hf auth login` or set HF_TOKEN "
            "(a token that may write), or leave train.push_to_hub empty"
        )


def push_folder(folder: Path, repo: str, *, private: bool, message: str) -> None:
    """`folder`'s files into the model repository `repo` (created if missing), as one commit."""
    from huggingface_hub import HfApi

    api = HfApi()
    api.create_repo(repo, private=private, exist_ok=True, repo_type="model")
    api.upload_folder(repo_id=repo, folder_path=str(folder), commit_message=message, repo_type="model")


def by_hand(repo: str, folder: Path, private: bool = False) -> str:
    """The command that pushes `folder` as the run would have."""
    return f"hf upload {repo} {folder} .{' --private' if private else ''}"


class NoHub:
    """No train.push_to_hub: nothing is pushed (the null object of `Hub`)."""

    def after_checkpoint(self, step: int) -> None:
        pass

    def at_end(self, final_dir: Path, step: int) -> None:
        pass


class Hub:
    """train.push_to_hub's pushes. `save_copy(directory)` writes the policy as final/ is
    written (collective: every process calls it); `write_card(directory, step)` its card
    (process 0). Every process calls the methods; process 0 pushes."""

    def __init__(self, c: Config, world, save_copy, write_card):
        self.repo, self.private, self.every_save = (
            c.train.push_to_hub,
            c.train.hub_private,
            c.train.hub_strategy == "every_save",
        )
        self.out, self.world = Path(c.output_dir), world
        self.save_copy, self.write_card = save_copy, write_card

    def push(self, folder: Path, message: str, after_failure: str) -> bool:
        """`folder` pushed (process 0); a failure is one warning line. Whether it arrived."""
        try:
            push_folder(folder, self.repo, private=self.private, message=message)
        except Exception as err:  # the network, the server, the token's rights: the run goes on
            print(
                f"grpo: warning: train.push_to_hub: the push to {self.repo} failed ({first_line(err)}); {after_failure}",
                file=sys.stderr,
            )
            return False
        return True

    def after_checkpoint(self, step: int) -> None:
        """hub_strategy every_save: the policy after `step` steps pushed, as final/ is written."""
        if not self.every_save:
            return
        staging = self.out / STAGING
        if self.world.is_main:
            shutil.rmtree(staging, ignore_errors=True)
        self.save_copy(staging)
        if self.world.is_main:
            try:
                self.write_card(staging, step)
                self.push(staging, f"grpo: step {step}", "the run goes on, and pushes again at its next checkpoint")
            finally:
                shutil.rmtree(staging, ignore_errors=True)

    def at_end(self, final_dir: Path, step: int) -> None:
        """final/ pushed (process 0), once it and the run's logs are written."""
        if self.world.is_main:
            kept = f"the run is kept in {self.out}: push it with `{by_hand(self.repo, final_dir, self.private)}`"
            if self.push(final_dir, f"grpo: the model after {step} steps", kept):
                print(f"grpo: pushed {final_dir} to {self.repo}", file=sys.stderr)


def hub_for(c: Config, world, save_copy, write_card) -> Hub | NoHub:
    """The run's pushes: a `Hub` with train.push_to_hub, else `NoHub`."""
    return Hub(c, world, save_copy, write_card) if c.train.push_to_hub else NoHub()
