import subprocess
import sys
from pathlib import Path

import grpo
from grpo.cli import main


def test_version_and_help(capsys):
    try:
        main(["--version"])
    except SystemExit as stop:
        assert stop.code == 0
    assert capsys.readouterr().out.strip() == f"grpo {grpo.__version__}"
    assert main([]) == 0
    assert "GRPO" in capsys.readouterr().out


def test_console_command_is_installed():
    command = str(Path(sys.executable).parent / "grpo")  # the entry point pip wrote
    out = subprocess.run([command, "--help"], capture_output=True, text=True, check=True)
    assert "value model goes" in out.stdout
    bad = subprocess.run([command, "--no-such-flag"], capture_output=True, text=True)
    assert bad.returncode == 2
    assert "unrecognized arguments" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_python_dash_m_grpo_is_the_command():
    """torchrun launches modules: `torchrun ... -m grpo train CONFIG` needs `python -m grpo`."""
    out = subprocess.run([sys.executable, "-m", "grpo", "train", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "train.device" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "grpo", "train", "/no/such.yaml"], capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.strip() == "grpo: error: config file not found: /no/such.yaml"


def test_eval_and_compare_help_name_any_task(capsys):
    for command in ("eval", "compare"):
        try:
            main([command, "--help"])
        except SystemExit as stop:
            assert stop.code == 0
        text = " ".join(capsys.readouterr().out.split())
        assert "--task SPEC" in text and "'pkg.module:name'" in text and "arithmetic" in text
    try:
        main(["eval", "--help"])
    except SystemExit:
        pass
    text = " ".join(capsys.readouterr().out.split())
    assert "--answer FN" in text and "'TASK:N'" in text
