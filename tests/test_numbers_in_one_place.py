"""Numbers live in one place: benchmarks/README.md (each benchmark's current result with its
command, host kind and date) and the dated files of benchmarks/results/. README.md, the docs
pages and grpo/'s comments and strings state behaviour, thresholds and reasons, never a
measurement: no date, no host kind (Xeon, EPYC, an AVX-512 host, a 2-core machine), no
measured quantity (a timing, a memory size, a throughput) and no speed ratio ("0.44x").

Settings are not measurements: `max_new_tokens: 256`, "4 prompts x G=8" or "2^18 values"
match nothing here, and the few facts written with a unit (Docker's 64 MB /dev/shm, glibc's
32 MiB threshold limit) are allowed by name in ALLOWED, which may only hold phrases that are
still there. The code that detects a host's vector extensions (HOST_DETECTION) may name
them. docs/dev/ is not checked: it holds a dated research note, kept as the record of a spike."""

import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]

NUMBER = r"(?<![\w.])\d[\d,]*(?:\.\d+)?(?:\s?(?:-|to)\s?\d[\d,]*(?:\.\d+)?)?"  # 12, 3,153, 0.44, 6-7
UNIT = r"(?:ms|us|µs|ns|s|sec|secs|seconds?|min|mins|minutes?|hours?|[KMGT]i?B|[MGT]FLOP)"
PER = r"(?:/(?:s|step|token|call|pass)\b|(?![\w/]))"  # "GB/s", "s/step"; not "s/sqrt(P)"
MEASUREMENT = re.compile(
    "|".join(
        [
            r"(?P<date>\b20\d\d-[01]\d-[0-3]\d\b)",
            r"(?P<host>\b(?:Xeon|EPYC|Epyc|Ryzen|Threadripper)\b"
            r"|\b(?:AVX-?512|AVX2|AMX|Intel|AMD)[\w/ +-]{0,24}?\s(?:host|machine)s?\b"
            r"|\b\d+-core\b)",
            rf"(?P<quantity>(?!0(?![.,\d])){NUMBER}\s?{UNIT}{PER})",  # "0 seconds" is a bound, not a time
            rf"(?P<ratio>{NUMBER}x\b)",
        ]
    )
)

# Facts written with a unit: (file, the phrase as it stands).
ALLOWED = [
    ("docs/async.md", "Docker's default is 64 MB"),
    ("docs/memory.md", "that it raises, up to 32 MiB"),  # glibc's limit on its mmap threshold
    ("docs/memory.md", "`purge_delay` 1000 ms"),  # mimalloc's setting
    ("docs/memory.md", "threshold at 256 KiB"),  # the one train.return_freed_memory sets
    ("docs/monitoring.md", "3.10 s/step"),  # the progress line's format, shown once
    ("docs/tools.md", "`rollout.tool_timeout` (30 s"),  # its default
    ("grpo/infra/memory.py", "(up to 32 MiB)"),  # glibc's limit on its mmap threshold
]

# Modules whose job is to read and record a host's CPU and vector extensions.
HOST_DETECTION = {"grpo/infra/host.py"}


def python_prose(source: str) -> list[tuple[int, str]]:
    """A module's comments and strings (docstrings, help texts, messages), each with its first
    line; code is not prose (`timeout_s = 30` says nothing measured)."""
    kinds = {tokenize.COMMENT, tokenize.STRING, getattr(tokenize, "FSTRING_MIDDLE", tokenize.STRING)}
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    return [(t.start[0], t.string) for t in tokens if t.type in kinds]


def measurements(name: str, texts: list[tuple[int, str]]) -> list[str]:
    """What in the file `name` (relative to the root), given as texts each starting on the line
    beside it, reads as a measurement, as 'FILE:LINE: kind 'text''."""
    found = []
    for first_line, text in texts:
        for file, phrase in ALLOWED:
            if file == name:
                text = text.replace(phrase, " " * len(phrase))
        for match in MEASUREMENT.finditer(text):
            if match.lastgroup == "host" and name in HOST_DETECTION:
                continue
            line = first_line + text[: match.start()].count("\n")
            found.append(f"{name}:{line}: {match.lastgroup} {match.group(0)!r}")
    return found


def checked_files() -> dict[str, list[tuple[int, str]]]:
    """README.md and docs/*.md whole (code blocks too), and grpo/'s comments and strings."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    files = {str(p.relative_to(ROOT)): [(1, p.read_text())] for p in pages}
    for path in sorted((ROOT / "grpo").rglob("*.py")):
        files[str(path.relative_to(ROOT))] = python_prose(path.read_text())
    return files


FILES = checked_files()


@pytest.mark.parametrize("name", FILES)
def test_no_date_host_or_measurement(name):
    found = measurements(name, FILES[name])
    assert found == [], "a measurement belongs in benchmarks/README.md (see docs/development.md):\n" + "\n".join(found)


def test_the_allowed_phrases_and_the_host_detection_modules_are_still_there():
    """An exception that no longer matches anything is dropped, so the list only shrinks."""
    for file, phrase in ALLOWED:
        assert phrase in (ROOT / file).read_text(), f"{file} no longer says {phrase!r}: drop it from ALLOWED"
    for file in HOST_DETECTION:
        assert (ROOT / file).is_file(), file


# ---- the check catches what it is for, and lets settings be ------------------------------------


@pytest.mark.parametrize(
    ("text", "kind"),
    [
        ("measured on 2026-12-05, idle", "date"),
        ("on an Intel Xeon", "host"),
        ("an AMD EPYC host", "host"),
        ("on an AVX-512 host", "host"),
        ("AVX2-only hosts run it slower", "host"),
        ("on this 2-core CPU", "host"),
        ("a step takes 12.5 s against 28.3", "quantity"),
        ("the draw costs 2-3 ms a row", "quantity"),
        ("17.5 us packed", "quantity"),
        ("peaks at 3,153 MB", "quantity"),
        ("148 MiB fewer", "quantity"),
        ("streams 6.9 GB/s", "quantity"),
        ("it took 6-7 minutes", "quantity"),
        ("elapsed 1:03  3.10 s/step", "quantity"),
        ("the step is 0.44x TRL's", "ratio"),
        ("1.4-1.7x the rate", "ratio"),
    ],
)
def test_a_date_a_host_and_a_measurement_are_caught(text, kind):
    found = measurements("docs/page.md", [(1, f"Some prose.\n{text}, and more.\n")])
    assert len(found) == 1 and found[0].startswith(f"docs/page.md:2: {kind} "), found


@pytest.mark.parametrize(
    "text",
    [
        "rollout: {group_size: 8, prompts_per_step: 4, max_new_tokens: 256}",
        "4 prompts x G=8 completions, lr 1e-5, beta 0.04, k3",
        "gradient accumulation 8x1 == 1x8",
        "matrices of 2^18 values or more, fewer than 12 rows",
        "must be above 0 seconds",
        "an open range pulls a multi-GB CUDA build",
        "Qwen2.5-0.5B on CPUs with AMX; the numerics tests held to AVX2 kernels",
        "95% intervals, mean +- 1.96 s/sqrt(P)",
        "x86-64, 0x7f, top_k 50",
    ],
)
def test_settings_are_not_caught(text):
    assert measurements("docs/page.md", [(1, text)]) == []


def test_in_code_only_comments_and_strings_are_read():
    source = 'TIMEOUT_S = 30\n\n\ndef f():\n    """Fast."""\n    return 2  # 4.1 ms a row\n'
    assert measurements("grpo/m.py", python_prose(source)) == ["grpo/m.py:6: quantity '4.1 ms'"]
    assert measurements("grpo/m.py", python_prose('x = "on an AVX-512 host"\n'))[0].startswith("grpo/m.py:1: host")
    assert measurements("grpo/infra/host.py", python_prose('x = "on an AVX-512 host"\n')) == []


def test_an_allowed_phrase_is_allowed_only_in_its_file():
    text = "the default is Docker's default is 64 MB"
    assert measurements("docs/async.md", [(1, text)]) == []
    assert measurements("docs/speed.md", [(1, text)]) == ["docs/speed.md:1: quantity '64 MB'"]
