"""The pages cannot rot: every `grpo` command in the code blocks of README.md and docs/*.md
parses with the real CLI parser (parse only: nothing runs), every config key they show (YAML
blocks, `--set key=value`, `overrides=[...]`, `section.key` in the text) is one grpo.config
reads, every `from grpo... import` names something that exists, and every relative link and
repository path points at a file that is there."""

import argparse
import ast
import contextlib
import copy
import importlib
import io
import re
import shlex
from pathlib import Path

import pytest
import yaml

from grpo.cli import build_parser
from grpo.config import config_from_dict, describe_fields
from grpo.errors import UserError

ROOT = Path(__file__).parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BASE_CONFIG = ROOT / "configs" / "grpo.yaml"  # what a YAML fragment or a `--set` applies to
# Shown on purpose as names that are not ours (TRL's, pointed at our key).
NOT_KEYS = {"loss.epsilon"}

FENCE = re.compile(r"^```([\w-]*)[^\n]*\n(.*?)^```[ \t]*$", re.M | re.S)
SHELL = {"", "sh", "bash", "shell", "console"}
SHELL_STOP = {"|", "||", "&&", ";", "&", ">", ">>", "2>", "2>&1", "<"}
SECTIONS = "|".join(sorted({key.split(".")[0].removesuffix("[]") for key, _, _ in describe_fields() if "." in key}))
PROSE_KEY = re.compile(rf"^((?:{SECTIONS})(?:\[\])?\.[a-z_]+)(?::\s.*)?$")
FILE_NAME = re.compile(r"^[\w-]+\.(?:png|json|jsonl|md|py|sh|yaml|csv|txt)$")  # `rewards.png`: not a key
REPO_PATH = re.compile(r"^(?:grpo|tests|benchmarks|configs|examples|docs)/[\w./-]*\w\.(?:py|sh|yaml|jsonl|json|md)$")


def page_id(page: Path) -> str:
    return str(page.relative_to(ROOT))


def blocks(text: str, languages: set[str]) -> list[str]:
    return [body for lang, body in FENCE.findall(text) if lang in languages]


def prose(text: str) -> str:
    """The page without its fenced code blocks."""
    return FENCE.sub("", text)


def inline_code(text: str) -> list[str]:
    return re.findall(r"`([^`\n]+)`", prose(text))


def shell_lines(text: str) -> list[str]:
    """The logical lines of the page's shell blocks (a trailing backslash continues one)."""
    lines = []
    for body in blocks(text, SHELL):
        for line in re.sub(r"\\\n", " ", body).splitlines():
            if line.strip():
                lines.append(line)
    return lines


def grpo_argv(line: str) -> list[str] | None:
    """The arguments after `grpo` in a shell line (`grpo ...`, `.venv/bin/grpo ...`,
    `python -m grpo ...`, `torchrun ... -m grpo ...`, after VAR=value), up to a pipe or a
    redirection; None when the line runs no grpo command."""
    try:
        tokens = shlex.split(line, comments=True)
    except ValueError:
        return None
    for i, token in enumerate(tokens):
        is_grpo = token == "grpo" or token.endswith("/grpo")
        before = tokens[:i]
        if is_grpo and (not before or before[-1] == "-m" or all(re.match(r"^\w+=", t) for t in before)):
            argv = []
            for t in tokens[i + 1 :]:
                if t in SHELL_STOP or t.startswith((">", "2>")):
                    break
                argv.append(t)
            return argv
    return None


def strict(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The parser and its subcommands' without argparse's abbreviations: a page spells a flag
    out (`--resum` would parse, as an abbreviation of `--resume`, and read as a typo)."""
    parser.allow_abbrev = False
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                strict(sub)
    return parser


def parse(argv: list[str]):
    """argparse's result for `grpo ARGV`, or the error line it printed (raised as AssertionError)."""
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        try:
            return strict(build_parser()).parse_args(argv)
        except SystemExit as stop:
            if stop.code == 0:  # --help, --version
                return None
            raise AssertionError(err.getvalue().strip().splitlines()[-1]) from None


def base_config(path: str | None = None) -> dict:
    """The mapping a command's `--set` applies to: its config file when the repository has
    it, else configs/grpo.yaml (a placeholder such as CONFIG or my.yaml)."""
    file = ROOT / path if path and (ROOT / path).is_file() else BASE_CONFIG
    return yaml.safe_load(file.read_text())


def merged(base: dict, fragment: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in fragment.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merged(out[key], value)
        else:
            out[key] = value
    return out


def config_error(data: dict, overrides: list[str] = ()) -> str | None:
    """What `grpo train` would say of this config and these overrides, before loading anything."""
    try:
        config_from_dict(data, list(overrides))
    except UserError as err:
        return str(err)
    return None


# ---- the checks, each a list of what is wrong in one page's text ----------------------------


def command_errors(text: str) -> list[str]:
    errors = []
    for line in shell_lines(text):
        argv = grpo_argv(line)
        if argv is None:
            continue
        try:
            args = parse(argv)
        except AssertionError as err:
            errors.append(f"{line.strip()}: {err}")
            continue
        overrides = getattr(args, "set", None) or []
        if overrides:  # grpo train / grpo compare: the keys must be the config's
            path = getattr(args, "config", None) or getattr(args, "config_a", None)
            message = config_error(base_config(path), overrides)
            if message:
                errors.append(f"{line.strip()}: {message}")
    return errors


def config_errors(text: str) -> list[str]:
    errors = []
    for body in blocks(text, {"yaml", "yml"}):
        data = yaml.safe_load(body)
        if not isinstance(data, dict):
            errors.append(f"a yaml block is not a mapping of config keys: {body[:60]!r}")
            continue
        # A whole config (it names its model) stands alone; a fragment goes on the base config.
        message = config_error(data if "model" in data else merged(base_config(), data))
        if message:
            errors.append(f"yaml block {body.splitlines()[0]!r}: {message}")
    for body in blocks(text, {"python", "py"}):
        for node in ast.walk(ast.parse(body)):
            if isinstance(node, ast.keyword) and node.arg == "overrides" and isinstance(node.value, ast.List):
                overrides = [e.value for e in node.value.elts if isinstance(e, ast.Constant)]
                message = config_error(base_config(), overrides)
                if message:
                    errors.append(f"overrides={overrides}: {message}")
    keys = {key for key, _, _ in describe_fields()}
    for span in inline_code(text):
        match = PROSE_KEY.match(span)
        if match and match.group(1) not in keys | NOT_KEYS and not FILE_NAME.match(span):
            errors.append(f"`{span}`: {match.group(1)} is not a config key")
    return errors


def import_errors(text: str) -> list[str]:
    errors = []
    for body in blocks(text, {"python", "py"}):
        try:
            tree = ast.parse(body)
        except SyntaxError as err:
            errors.append(f"a python block does not parse: {err}")
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "grpo":
                module = importlib.import_module(node.module)
                errors += [f"{node.module} has no {a.name}" for a in node.names if not hasattr(module, a.name)]
    return errors


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6} (.+)$", prose(text), re.M):
        s = slug(heading)
        out.add(s if s not in seen else f"{s}-{seen[s]}")
        seen[s] = seen.get(s, 0) + 1
    return out


def link_errors(page: Path, text: str) -> list[str]:
    body = re.sub(r"`[^`\n]+`", "", prose(text))
    targets = re.findall(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", body) + re.findall(r"^\[[^\]]+\]:\s*(\S+)", body, re.M)
    errors = []
    for target in targets:
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            errors.append(f"({target}): {path} does not exist")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file.read_text()):
            errors.append(f"({target}): {file.name} has no heading #{anchor}")
    for span in inline_code(text) + [t for line in shell_lines(text) for t in line.split()]:
        if REPO_PATH.match(span) and not (ROOT / span).exists():
            errors.append(f"`{span}`: no such file in the repository")
    return errors


# ---- the pages ------------------------------------------------------------------------------


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_every_grpo_command_shown_parses(page):
    assert command_errors(page.read_text()) == []


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_every_config_key_shown_is_the_config_s(page):
    assert config_errors(page.read_text()) == []


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_every_grpo_import_shown_exists(page):
    assert import_errors(page.read_text()) == []


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_every_relative_link_and_path_resolves(page):
    assert link_errors(page, page.read_text()) == []


def test_every_docs_page_a_field_doc_points_at_is_there():
    """A config field's doc (what `grpo train --help` prints) is short and names the page that
    explains, as docs/PAGE.md or docs/PAGE.md#heading: the page and the heading exist."""
    pointers = [
        (key, m) for key, _, doc in describe_fields() for m in re.findall(r"docs/([\w-]+\.md)(?:#([\w-]+))?", doc)
    ]
    assert len(pointers) >= 20
    for key, (page, anchor) in pointers:
        path = ROOT / "docs" / page
        assert path.is_file(), f"{key}: docs/{page} does not exist"
        assert not anchor or anchor in anchors(path.read_text()), f"{key}: docs/{page} has no heading #{anchor}"


def test_the_math_page_s_example_runs():
    """docs/math.md's example is plain tensors in, a loss out: it runs as shown."""
    for body in blocks((ROOT / "docs" / "math.md").read_text(), {"python"}):
        scope: dict = {}
        exec(compile(body, "docs/math.md", "exec"), scope)
        assert scope["loss"].requires_grad and scope["logits"].grad is not None


def test_the_readme_links_every_page_of_docs():
    readme = (ROOT / "README.md").read_text()
    linked = set(re.findall(r"\]\(docs/([^)#\s]+)", readme))
    assert [p.name for p in PAGES[1:] if p.name not in linked] == []


def test_the_pages_show_commands_and_configs():
    """The checks above see something: an extraction that finds nothing passes vacuously."""
    text = "\n".join(p.read_text() for p in PAGES)
    argvs = [a for line in shell_lines(text) if (a := grpo_argv(line)) is not None]
    assert {a[0] for a in argvs} >= {"train", "sft", "eval", "compare", "demo", "rm"}
    assert any("--set" in a for a in argvs) and any(a[-1] == "--help" for a in argvs)
    assert len(blocks(text, {"yaml"})) >= 3 and len(blocks(text, {"python"})) >= 3


# ---- the checks catch what they are for -----------------------------------------------------


def test_a_wrong_flag_a_wrong_subcommand_and_a_wrong_set_key_are_caught():
    text = "```sh\ngrpo train configs/grpo.yaml --resume\n```\n"
    assert command_errors(text) == []
    assert "unrecognized arguments: --resum" in command_errors(text.replace("--resume", "--resum"))[0]
    assert "invalid choice: 'trian'" in command_errors(text.replace("train", "trian"))[0]
    continued = "```sh\ntorchrun --nproc_per_node 2 \\\n    -m grpo train CONFIG --set rollout.group_sise=4\n```\n"
    assert "did you mean 'rollout.group_size'" in command_errors(continued)[0]
    assert command_errors("```sh\n.venv/bin/grpo demo --quick 2> log  # comment --no-such\n```\n") == []


def test_a_wrong_config_key_is_caught_in_yaml_python_and_prose():
    assert "unknown config key 'rollout.group_sise'" in config_errors("```yaml\nrollout: {group_sise: 4}\n```\n")[0]
    assert "train.stepz" in config_errors('```python\ngrpo.train("c.yaml", overrides=["train.stepz=5"])\n```\n')[0]
    assert config_errors("with `loss.clip_hihg`, ...")[0].startswith("`loss.clip_hihg`")
    assert config_errors("with `loss.clip_high: 0.28` and `rewards[].timeout`") == []


def test_a_broken_link_anchor_or_path_is_caught(tmp_path):
    page = ROOT / "docs" / "page.md"  # where a page of docs/ resolves its links from
    assert link_errors(page, "[speed](speed.md) [top](../README.md#status) [x](https://example.com/no)") == []
    assert "does not exist" in link_errors(page, "[speed](sped.md)")[0]
    assert "no heading #statuss" in link_errors(page, "[top](../README.md#statuss)")[0]
    assert "no such file" in link_errors(page, "`benchmarks/bench_nothing.py`")[0]
    assert "no such file" not in str(link_errors(page, "```python\nx = 'grpo/none.py'\n```\n"))
