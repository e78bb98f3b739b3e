"""`.githooks/commit-msg` (installed by `make hooks`): a subject over 72 characters is refused,
one of 72 passes, whatever follows in the body."""

import subprocess
from pathlib import Path

import pytest

HOOK = Path(__file__).parents[1] / ".githooks" / "commit-msg"


@pytest.mark.parametrize("length, refused", [(72, False), (73, True)])
def test_the_hook_holds_the_subject_to_72_characters(tmp_path, length, refused):
    message = tmp_path / "COMMIT_EDITMSG"
    message.write_text("s" * length + "\n\n" + "a body line longer than the subject limit " * 3 + "\n")
    done = subprocess.run(["sh", str(HOOK), str(message)], capture_output=True, text=True)
    assert (done.returncode != 0) == refused
    assert (f"the subject is {length} characters, over 72" in done.stderr) == refused
