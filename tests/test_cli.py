import argparse
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

import grpo
import grpo.demo.default
from grpo.cli import build_parser, main
from grpo.config import REQUIRED, Config, field_default
from grpo.demo.default import QUICK, DemoConfig
from grpo.demo.tool_use import ToolsDemoConfig
from grpo.eval.command import EvalConfig
from grpo.rewards.model import RewardEvalConfig, RewardTrainConfig
from grpo.train.sft import FineTuneConfig, SFTConfig


def test_version_and_help(capsys):
    try:
        main(["--version"])
    except SystemExit as stop:
        assert stop.code == 0
    # This process started under the C library's allocator (it is not the `grpo` command).
    assert capsys.readouterr().out.strip() == f"grpo {grpo.__version__} (memory allocator: system)"
    assert main([]) == 0
    assert "GRPO" in capsys.readouterr().out


@pytest.mark.slow
def test_console_command_is_installed():
    command = str(Path(sys.executable).parent / "grpo")  # the entry point pip wrote
    out = subprocess.run([command, "--help"], capture_output=True, text=True, check=True)
    assert "value model goes" in out.stdout
    bad = subprocess.run([command, "--no-such-flag"], capture_output=True, text=True)
    assert bad.returncode == 2
    assert "unrecognized arguments" in bad.stderr
    assert "Traceback" not in bad.stderr


@pytest.mark.slow
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


# ---- the commands' configs and the flags made from them ---------------------------------------

# Each command and the configs its flags set; sft's flags are left unset (None) when not
# given, so that the flags given choose the mode.
COMMANDS = {
    ("eval",): [EvalConfig],
    ("rm", "train"): [RewardTrainConfig],
    ("rm", "eval"): [RewardEvalConfig],
    ("demo",): [DemoConfig],
    ("sft",): [FineTuneConfig, SFTConfig],
}


def subparser(path):
    parser = build_parser()
    for name in path:
        (commands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        parser = commands.choices[name]
    return parser


def shown(value):
    return f"{value:g}" if isinstance(value, float) else str(value)


def test_every_config_field_has_its_doc():
    """One style: every field of every config is an opt(default, doc) field."""
    undocumented = []
    for config in (
        Config,
        SFTConfig,
        FineTuneConfig,
        EvalConfig,
        RewardTrainConfig,
        RewardEvalConfig,
        DemoConfig,
        ToolsDemoConfig,
    ):
        for f in dataclasses.fields(config):
            doc = f.metadata.get("doc", "")
            if not doc.strip() or not doc.rstrip().endswith((".", ")")):
                undocumented.append(f"{config.__name__}.{f.name}")
    assert undocumented == []


@pytest.mark.parametrize("path", list(COMMANDS), ids=" ".join)
def test_flags_take_their_default_and_help_from_the_config_fields(path):
    configs = COMMANDS[path]
    fields = {}
    for config in configs:
        for f in dataclasses.fields(config):
            fields.setdefault(f.name, []).append((config, f))
    parser = subparser(path)
    made = [a for a in parser._actions if a.dest in fields]
    assert made, "no flag is made from a field"
    for action in made:
        for config, f in fields[action.dest]:
            default = field_default(f)
            if default is REQUIRED:
                assert action.required or action.default is None, action.dest
                continue
            # demo's --steps: the budget says (--quick); its --seeds: --tools has its own default
            if len(configs) == 1 and action.dest not in ("steps", "seeds"):
                assert action.default == default, action.dest
            else:
                assert action.default is None, action.dest  # the mode's config fills it in
            doc = f.metadata["doc"].removesuffix(".").partition(". Default: ")[0]
            assert doc[1:] in action.help, (action.dest, action.help)  # the doc is the help (its first letter lowered)
            if default not in (None, False):
                assert f"(default: {shown(default)}" in action.help, (action.dest, action.help)


def test_a_field_default_of_none_shows_what_its_doc_says():
    help_text = {a.dest: a.help for a in subparser(("eval",))._actions}
    assert help_text["k"].endswith("(default: the powers of 2 up to n)")
    assert help_text["threshold"].endswith("(default: the task's; with --verifier, 0.5)")


def test_the_eval_flags_build_the_eval_config(monkeypatch):
    seen = {}

    def run(config, **options):
        seen.update(config=config, **options)
        return 0

    monkeypatch.setattr("grpo.eval.command.run", run)
    assert (
        main(["eval", "--model", "m", "--data", "d", "--n", "8", "--top-p", "0.9", "--device", "cpu", "--quiet"]) == 0
    )
    assert seen["config"] == EvalConfig(model="m", data="d", n=8, top_p=0.9)
    assert seen["device"] == "cpu" and seen["progress"] is False and seen["out"] is None


def test_demo_quick_keeps_the_steps_asked_for_and_at_most_two_seeds(monkeypatch, tmp_path):
    seen = []

    def demo(output, config, **options):
        seen.append(config)
        return {"time_s": 0.0}

    monkeypatch.setattr(grpo.demo.default, "demo", demo)
    out = str(tmp_path / "d")
    assert main(["demo", "--output", out, "--quick", "--steps", "7", "--seeds", "5", "--seed", "3", "--quiet"]) == 0
    assert main(["demo", "--output", out, "--quick", "--quiet"]) == 0
    assert main(["demo", "--output", out, "--full", "--quiet"]) == 0
    asked, quick, full = seen
    assert (asked.steps, asked.seeds, asked.seed, asked.sft_steps) == (7, 2, 3, QUICK["sft_steps"])
    assert (quick.steps, quick.n) == (QUICK["steps"], QUICK["n"])
    assert full == DemoConfig(full=True)
