"""train.push_to_hub: the run's model sent to a Hugging Face Hub repository.

What is sent is a folder as final/ is written (the weights as saved, merged or adapter, the
tokenizer, the model card and the config beside it), through huggingface_hub's create_repo
(exist_ok, train.hub_private) and upload_folder: at the end of the run (train.keep_best's
best/ too, to the branch `best`), and with
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

from grpo.config import Config, hub_repo
from grpo.errors import UserError, first_line

__all__ = ["BEST_BRANCH", "STAGING", "Hub", "NoHub", "by_hand", "check_hub", "hub_for", "push_folder"]

BEST_BRANCH = "best"  # where train.keep_best's best/ is pushed
STAGING = "hub.tmp"  # output_dir/hub.tmp: a checkpoint's policy as final/ is written, while it is pushed


def check_hub(c: Config) -> None:
    """What can be wrong with train.push_to_hub before any model loads, as one line: the
    package, offline mode, a token (whether the network and the token's rights hold is
    known at the push)."""
    if not hub_repo(c):
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


def push_folder(folder: Path, repo: str, *, private: bool, message: str, branch: str | None = None) -> str:
    """`folder`'s files into the model repository `repo` (created if missing; a name without
    a namespace lands in the token's own), as one commit on `branch` (None: the main branch,
    else created from it if missing). The repository's full id."""
    from huggingface_hub import HfApi

    api = HfApi()
    repo = api.create_repo(repo, private=private, exist_ok=True, repo_type="model").repo_id
    if branch is not None:
        api.create_branch(repo, branch=branch, exist_ok=True, repo_type="model")
    api.upload_folder(repo_id=repo, folder_path=str(folder), commit_message=message, repo_type="model", revision=branch)
    return repo


def by_hand(repo: str, folder: Path, private: bool = False, branch: str | None = None) -> str:
    """The command that pushes `folder` as the run would have."""
    revision = f" --revision {branch}" if branch else ""
    return f"hf upload {repo} {folder} .{revision}{' --private' if private else ''}"


class NoHub:
    """No train.push_to_hub: nothing is pushed (the null object of `Hub`)."""

    def after_checkpoint(self, step: int) -> None:
        pass

    def at_end(self, final_dir: Path, step: int, best_dir: Path | None = None) -> None:
        pass


class Hub:
    """train.push_to_hub's pushes. `save_copy(directory)` writes the policy as final/ is
    written (collective: every process calls it); `write_card(directory, step)` its card
    (process 0). Every process calls the methods; process 0 pushes."""

    def __init__(self, c: Config, world, save_copy, write_card):
        self.repo, self.private, self.every_save = (
            hub_repo(c),
            c.train.hub_private,
            c.train.hub_strategy == "every_save",
        )
        self.out, self.world = Path(c.output_dir), world
        self.save_copy, self.write_card = save_copy, write_card

    def push(self, folder: Path, message: str, after_failure: str, branch: str | None = None) -> bool:
        """`folder` pushed (process 0) to `branch`; a failure is one warning line. Whether it arrived."""
        try:
            self.repo = push_folder(folder, self.repo, private=self.private, message=message, branch=branch)
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

    def at_end(self, final_dir: Path, step: int, best_dir: Path | None = None) -> None:
        """final/ pushed (process 0), once it and the run's logs are written; train.keep_best's
        best/, where the run kept one, to the repository's branch `best`."""
        if not self.world.is_main:
            return
        for folder, branch, message in (
            (final_dir, None, f"grpo: the model after {step} steps"),
            (best_dir, BEST_BRANCH, "grpo: the best model by the held-out evaluation"),
        ):
            if folder is None or not (folder / "config.json").exists():
                continue  # no train.keep_best, or no evaluation kept one
            kept = f"the run is kept in {self.out}: push it with `{by_hand(self.repo, folder, self.private, branch)}`"
            if self.push(folder, message, kept, branch):
                where = f"{self.repo}'s branch {branch}" if branch else self.repo
                print(f"grpo: pushed {folder} to {where}", file=sys.stderr)


def hub_for(c: Config, world, save_copy, write_card) -> Hub | NoHub:
    """The run's pushes: a `Hub` with train.push_to_hub, else `NoHub`."""
    return Hub(c, world, save_copy, write_card) if hub_repo(c) else NoHub()
