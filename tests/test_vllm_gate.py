"""tests/conftest.py's gate for the vllm-marked tests, run on a copy of it in a scratch suite: where
-m deselects them, tests/vllm is not even imported (.venv has no vLLM); where they are selected
and vLLM does not import, the run fails in one line, never skips; and a vllm test elsewhere than
tests/vllm is refused (`make test` runs only that directory in .venv-vllm)."""

import sys
import types
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

CONFTEST = (Path(__file__).parent / "conftest.py").read_text()
ENGINE_TEST = (
    "import pytest\nimport vllm\n\npytestmark = pytest.mark.vllm\n\n\ndef test_engine():\n    assert vllm.OK\n"
)
SKIPPING_TEST = "import pytest\n\nvllm = pytest.importorskip('vllm')\npytestmark = pytest.mark.vllm\n\n\ndef test_engine():\n    pass\n"
MISSING = "needs vLLM, which does not import here"


@pytest.fixture
def suite(pytester):
    """A package like tests/: the real conftest, one plain test, and vllm/ with one engine test."""
    (pytester.path / "suite" / "vllm").mkdir(parents=True)
    for name, text in {
        "__init__.py": "",
        "conftest.py": CONFTEST,
        "test_plain.py": "def test_plain():\n    pass\n",
        "vllm/__init__.py": "",
        "vllm/test_engine.py": ENGINE_TEST,
    }.items():
        (pytester.path / "suite" / name).write_text(text)
    return pytester


def without_vllm(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError


def with_vllm(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(OK=True, LLM=object))


def test_deselected_vllm_tests_are_not_imported(suite, monkeypatch):
    without_vllm(monkeypatch)
    result = suite.runpytest_inprocess("-m", "not benchmark and not vllm", "suite")
    result.assert_outcomes(passed=1)  # an import of vllm/test_engine.py would be an error


def test_selected_vllm_tests_fail_in_one_line_where_vllm_does_not_import(suite, monkeypatch):
    without_vllm(monkeypatch)
    for args in (["-m", "vllm and not benchmark", "suite/vllm"], ["suite"], ["suite/vllm/test_engine.py"]):
        result = suite.runpytest_inprocess(*args)
        assert result.ret != 0, args
        assert MISSING in result.stdout.str(), args
        assert result.parseoutcomes().get("skipped", 0) == 0


def test_a_module_that_would_skip_without_vllm_fails_instead(suite, monkeypatch):
    without_vllm(monkeypatch)
    (suite.path / "suite" / "vllm" / "test_engine.py").write_text(SKIPPING_TEST)
    result = suite.runpytest_inprocess("-m", "vllm and not benchmark", "suite/vllm")
    assert result.ret != 0 and MISSING in result.stdout.str()
    assert result.parseoutcomes().get("skipped", 0) == 0


def test_selected_vllm_tests_run_where_vllm_imports(suite, monkeypatch):
    with_vllm(monkeypatch)
    suite.runpytest_inprocess("-m", "vllm and not benchmark", "suite/vllm").assert_outcomes(passed=1)


def test_a_vllm_test_outside_tests_vllm_and_an_unmarked_one_inside_are_refused(suite, monkeypatch):
    with_vllm(monkeypatch)
    (suite.path / "suite" / "test_stray.py").write_text(ENGINE_TEST)
    result = suite.runpytest_inprocess("suite")
    assert result.ret != 0
    assert "test_stray.py::test_engine is marked vllm but does not live in tests/vllm" in result.stderr.str()
    (suite.path / "suite" / "test_stray.py").unlink()
    (suite.path / "suite" / "vllm" / "test_unmarked.py").write_text("def test_unmarked():\n    pass\n")
    result = suite.runpytest_inprocess("-m", "vllm", "suite/vllm")
    assert result.ret != 0
    assert "test_unmarked.py::test_unmarked lives in tests/vllm unmarked" in result.stderr.str()
