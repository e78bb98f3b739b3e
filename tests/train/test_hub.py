"""train.push_to_hub against a local stand-in for the Hub (huggingface_hub's endpoint setting,
HF_ENDPOINT, pointed at a server in a thread): the files that arrive are the ones final/ holds,
byte for byte; every_save pushes each checkpoint's model; a push that fails keeps the run; a
missing token or offline mode is one line before any model loads."""

import base64
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import huggingface_hub
import pytest

from grpo.errors import UserError
from grpo.train.card import CARD, CONFIG
from grpo.train.hub import BEST_BRANCH, STAGING, by_hand, check_hub
from grpo.train.loop import train
from tests.train.test_in_loop_evaluation import config_of, lines

USER = "someone"  # the token's owner: a repository named without a namespace lands in theirs
REPO = f"{USER}/tiny-grpo"
TOKEN = "hf_stand_in_token"


class StandInHub(ThreadingHTTPServer):
    """The Hub endpoints create_repo and upload_folder call, with small files (regular uploads,
    inline in the commit): what was created and committed, and any request it does not know.
    `failing`: a path that answers 500."""

    def __init__(self, failing: str | None = None):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.url = f"http://127.0.0.1:{self.server_address[1]}"
        self.failing = failing
        self.repos: dict[str, dict] = {}  # repo id -> create_repo's payload
        self.commits: list[dict] = []  # {"repo", "branch", "summary", "files": {path: bytes}}
        self.branches: dict[str, set[str]] = {}  # repo id -> branches created besides main
        self.tokens: set[str] = set()
        self.unknown: list[str] = []

    def files(self, repo: str, branch: str = "main") -> dict[str, bytes]:
        """The files of the repository's `branch` after every commit."""
        merged: dict[str, bytes] = {}
        for commit in self.commits:
            if (commit["repo"], commit["branch"]) == (repo, branch):
                merged.update(commit["files"])
        return merged


class _Handler(BaseHTTPRequestHandler):
    server: StandInHub

    def log_message(self, *args):  # quiet
        pass

    def _answer(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if not self.path.startswith("/api/agent-harnesses"):  # huggingface_hub's user-agent lookup, cached
            self.server.unknown.append(f"GET {self.path}")
        self._answer(404, {"error": "not in the stand-in"})

    def do_POST(self):
        hub, path = self.server, self.path.split("?")[0]
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        hub.tokens.add(self.headers.get("Authorization", ""))
        if hub.failing and path.startswith(hub.failing):
            return self._answer(500, {"error": "the stand-in fails"})
        if path == "/api/repos/create":
            payload = json.loads(body)
            repo = f"{payload['organization'] or USER}/{payload['name']}"
            hub.repos[repo] = payload
            return self._answer(200, {"url": f"{hub.url}/{repo}"})
        if path == "/api/validate-yaml":  # create_commit's check of README.md's header
            return self._answer(200, {"errors": [], "warnings": []})
        if m := re.fullmatch(r"/api/models/(.+)/branch/(\w+)", path):
            hub.branches.setdefault(m.group(1), set()).add(m.group(2))
            return self._answer(200, {})
        if m := re.fullmatch(r"/api/models/(.+)/preupload/(\w+)", path):
            if m.group(2) != "main" and m.group(2) not in hub.branches.get(m.group(1), ()):
                return self._answer(404, {"error": f"no branch {m.group(2)}"})
            files = json.loads(body)["files"]
            answer = [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False, "oid": None} for f in files]
            return self._answer(200, {"files": answer})
        if m := re.fullmatch(r"/api/models/(.+)/commit/(\w+)", path):
            items = [json.loads(line) for line in body.decode().splitlines() if line.strip()]
            header = next(i["value"] for i in items if i["key"] == "header")
            files = {}
            for item in items:
                if item["key"] == "file":
                    assert item["value"]["encoding"] == "base64"
                    files[item["value"]["path"]] = base64.b64decode(item["value"]["content"])
                elif item["key"] != "header":
                    hub.unknown.append(f"commit item {item['key']}")
            hub.commits.append({"repo": m.group(1), "branch": m.group(2), "summary": header["summary"], "files": files})
            oid = f"{len(hub.commits):040x}"
            return self._answer(200, {"commitUrl": f"{hub.url}/{m.group(1)}/commit/{oid}", "commitOid": oid})
        hub.unknown.append(f"POST {path}")
        self._answer(404, {"error": "not in the stand-in"})


@pytest.fixture
def stand_in(monkeypatch):
    """Start a stand-in (`failing` as StandInHub takes it), with a token and huggingface_hub
    pointed at it; stopped after the test."""
    servers = []

    def start(failing: str | None = None) -> StandInHub:
        hub = StandInHub(failing)
        threading.Thread(target=hub.serve_forever, daemon=True).start()
        servers.append(hub)
        monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", hub.url)
        return hub

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.delenv("HF_OIDC_RESOURCE", raising=False)
    yield start
    for hub in servers:
        hub.shutdown()
        hub.server_close()


def written(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_the_files_that_arrive_are_final_s(tiny_model, prompts_file, tmp_path, stand_in, capsys):
    """every_save with a checkpoint a step: step 1's model pushed from a copy written as final/
    is (then removed), and final/ at the end, the same files byte for byte."""
    hub = stand_in()
    out = tmp_path / "run"
    train_section = {"push_to_hub": REPO, "hub_private": True, "hub_strategy": "every_save", "checkpoint_every": 1}
    train(config_of(tiny_model, prompts_file, out, steps=2, train=train_section), progress=False)
    assert hub.unknown == [] and hub.tokens == {f"Bearer {TOKEN}"}
    assert hub.repos[REPO]["visibility"] == "private"
    step_1, last = hub.commits
    assert step_1["summary"] == "grpo: step 1" and last["summary"] == "grpo: the model after 2 steps"
    final = written(out / "final")
    assert {CARD, CONFIG, "config.json", "model.safetensors"} <= final.keys()
    assert last["files"] == final  # names and bytes
    assert step_1["files"].keys() == final.keys() and step_1["files"]["model.safetensors"] != final["model.safetensors"]
    assert "| steps | 1 |" in step_1["files"][CARD].decode()
    assert not (out / STAGING).exists()
    assert f"grpo: pushed {out / 'final'} to {REPO}" in capsys.readouterr().err


def test_true_names_the_repository_after_output_dir(tiny_model, prompts_file, tmp_path, stand_in, capsys):
    """TRL's spelling, push_to_hub: true: a repository named after output_dir, in the token's
    namespace (create_repo's answer gives the full id, which the upload and the message use)."""
    hub = stand_in()
    out = tmp_path / "my-run"
    train(config_of(tiny_model, prompts_file, out, steps=1, train={"push_to_hub": True}), progress=False)
    assert hub.unknown == [] and list(hub.repos) == [f"{USER}/my-run"]
    assert hub.files(f"{USER}/my-run") == written(out / "final")
    assert f"grpo: pushed {out / 'final'} to {USER}/my-run" in capsys.readouterr().err


def test_false_pushes_nothing_and_needs_no_token(tiny_model, prompts_file, tmp_path, monkeypatch):
    from grpo.config import config_from_dict, hub_repo

    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    config = config_from_dict(config_of(tiny_model, prompts_file, tmp_path / "run", train={"push_to_hub": False}))
    assert hub_repo(config) == ""
    check_hub(config)  # no error


def test_best_goes_to_the_branch_best(tiny_model, prompts_file, tmp_path, stand_in, capsys):
    """train.keep_best: final/ on main, best/ on the branch best, each byte for byte."""
    hub = stand_in()
    out = tmp_path / "run"
    held_out = {"data": prompts_file, "n": 2, "k": [1], "every": 1, "threshold": 0.125, "seed": 3}
    config = config_of(
        tiny_model, prompts_file, out, steps=2, eval=held_out, train={"push_to_hub": REPO, "keep_best": "eval/pass@1"}
    )
    train(config, progress=False)
    assert hub.unknown == [] and hub.branches == {REPO: {BEST_BRANCH}}
    assert hub.files(REPO) == written(out / "final")
    assert hub.files(REPO, BEST_BRANCH) == written(out / "best") and (out / "best" / "model.safetensors").exists()
    assert f"grpo: pushed {out / 'best'} to {REPO}'s branch {BEST_BRANCH}" in capsys.readouterr().err


def test_a_failing_push_keeps_the_run(tiny_model, prompts_file, tmp_path, stand_in, capsys):
    hub = stand_in(failing="/api/repos/create")
    out = tmp_path / "run"
    result = train(config_of(tiny_model, prompts_file, out, steps=1, train={"push_to_hub": REPO}), progress=False)
    assert hub.commits == []
    assert result.final_dir == out / "final" and (out / "final" / "model.safetensors").exists()
    assert (out / "final" / CARD).exists() and [m["step"] for m in lines(out)] == [1]
    assert (out / "summary.json").exists()
    said = [line for line in capsys.readouterr().err.splitlines() if "push_to_hub" in line]
    assert len(said) == 1 and "500" in said[0]  # one line, which says why
    assert said[0].startswith(f"grpo: warning: train.push_to_hub: the push to {REPO} failed (")
    assert said[0].endswith(f"the run is kept in {out}: push it with `{by_hand(REPO, out / 'final')}`")


def test_a_push_with_nowhere_to_go_keeps_the_run(tiny_model, prompts_file, tmp_path, stand_in, capsys):
    """No network: the endpoint refuses the connection."""
    hub = stand_in()
    hub.shutdown()
    hub.server_close()  # nothing listens there any more
    out = tmp_path / "run"
    train(config_of(tiny_model, prompts_file, out, steps=1, train={"push_to_hub": REPO}), progress=False)
    assert (out / "final" / "model.safetensors").exists() and (out / "final" / CARD).exists()
    assert "grpo: warning: train.push_to_hub: the push to" in capsys.readouterr().err


def test_no_token_is_one_line_before_any_model_loads(tiny_model, prompts_file, tmp_path, monkeypatch):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_OIDC_RESOURCE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    out = tmp_path / "run"
    config = config_of(tiny_model, prompts_file, out, train={"push_to_hub": REPO})
    with pytest.raises(UserError, match=r"^train\.push_to_hub: no Hugging Face token: run `hf auth login`"):
        train(config, progress=False)
    assert not out.exists()  # before the folder, and so before any model


def test_offline_mode_is_one_line_before_any_model_loads(tiny_model, prompts_file, tmp_path, monkeypatch):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    out = tmp_path / "run"
    with pytest.raises(UserError, match=r"^train\.push_to_hub: HF_HUB_OFFLINE is set"):
        train(config_of(tiny_model, prompts_file, out, train={"push_to_hub": REPO}), progress=False)
    assert not out.exists()


def test_without_push_to_hub_no_token_is_needed(tiny_model, prompts_file, tmp_path, monkeypatch):
    from grpo.config import config_from_dict

    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    check_hub(config_from_dict(config_of(tiny_model, prompts_file, tmp_path / "run")))  # no error
