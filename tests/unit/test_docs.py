"""The docs say what the product does: every command in README's code blocks parses, every Python
snippet compiles (and the ones on the demo model run), every relative link in README.md and docs/
resolves, and no document speaks of work sessions or issue numbers.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


def _blocks(path: Path, lang: str) -> list[str]:
    return [body for kind, body in FENCE.findall(path.read_text(encoding="utf-8")) if kind == lang]


def _commands(block: str) -> list[str]:
    """Shell lines (continuations joined, comments dropped)."""
    joined = re.sub(r"\\\n\s*", " ", block)
    lines = []
    for line in joined.splitlines():
        line = line.split("  #")[0].strip()
        if line and not line.startswith("#"):
            lines.append(line)
    return lines


def test_readme_opens_with_the_two_setup_commands() -> None:
    first = _blocks(REPO / "README.md", "bash")[0]
    assert _commands(first)[:2] == ["make serve", "make test"]


def test_every_phalanx_command_in_the_readme_parses() -> None:
    from phalanx.entrypoints.cli import build_parser

    parser = build_parser()
    seen = 0
    for block in _blocks(REPO / "README.md", "bash"):
        for line in _commands(block):
            if line.split()[0] != "phalanx":  # (other lines may be one line of a multi-line shell string)
                continue
            argv = shlex.split(line)
            try:
                args = parser.parse_args(argv[1:])
            except SystemExit as e:  # argparse's error exit
                raise AssertionError(f"README command does not parse: {line}") from e
            assert args.command in ("serve", "download", "bench", "train-eagle"), line
            seen += 1
    assert seen >= 3


def test_python_snippets_compile_and_the_demo_ones_run() -> None:
    snippets = [s for doc in DOCS for s in _blocks(doc, "python")]
    assert snippets
    for code in snippets:
        compile(code, "<README>", "exec")
    runnable = [s for s in _blocks(REPO / "README.md", "python") if '"phalanx-math"' in s and "openai" not in s]
    assert runnable, "the README has a Python example on the built-in demo model"
    for code in runnable:
        exec(compile(code, "<README>", "exec"), {})  # noqa: S102 - our own README


LINK = re.compile(r"\]\(([^)\s]+)\)")


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_relative_links_resolve(doc: Path) -> None:
    for target in LINK.findall(doc.read_text(encoding="utf-8")):
        if re.match(r"^[a-z]+:", target) or target.startswith("#"):
            continue
        path = (doc.parent / target.split("#")[0]).resolve()
        assert path.exists(), f"{doc.name}: link to {target} does not resolve"


def test_docs_name_only_markdown_files_the_repository_has() -> None:
    """A doc that cites a notes file kept outside the repository sends the reader nowhere."""
    for doc in DOCS:
        for name in re.findall(r"[\w./-]*\w\.md\b", doc.read_text(encoding="utf-8")):
            assert (doc.parent / name).exists() or (REPO / name).exists(), f"{doc.name} names {name}, which is not here"


def test_every_plot_under_docs_img_is_shown() -> None:
    """Superseded plots are deleted, not left behind: each image is linked from a doc."""
    text = "".join(doc.read_text(encoding="utf-8") for doc in DOCS)
    orphans = [p.name for p in (REPO / "docs" / "img").glob("*.png") if f"img/{p.name}" not in text]
    assert not orphans, f"plots no doc shows: {orphans}"


def test_result_files_are_named_by_what_they_measured() -> None:
    """benchmarks/results/ names a workload or a peer, not when or in which round it was run."""
    dated = re.compile(r"_s\d+[a-z]?\.|peers\d|session|_v\d+\.", re.I)
    names = [p.name for p in (REPO / "benchmarks" / "results").iterdir()]
    assert not [n for n in names if dated.search(n)], names


WORK_LOG = re.compile(r"\b(session|sessions|issue #?\d+|#\d{1,3}\b)", re.I)


def test_no_file_speaks_of_sessions_or_issue_numbers() -> None:
    """Docs, code comments, test names and result files describe the product, not its history."""
    import subprocess

    files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    offenders = []
    for name in files:
        if not name.endswith((".md", ".py", ".json", ".txt", ".toml", ".yaml", ".cpp", ".h")) or "tokenizer.json" in name:
            continue
        if name.endswith("test_docs.py"):
            continue
        text = (REPO / name).read_text(encoding="utf-8", errors="replace")
        for m in WORK_LOG.finditer(text):
            line = text[: m.start()].count("\n") + 1
            context = text[max(0, m.start() - 40) : m.end() + 40].replace("\n", " ")
            if _allowed(m.group(0), context):
                continue
            offenders.append(f"{name}:{line}: ...{context}...")
    assert not offenders, "\n".join(offenders[:40])


def _allowed(word: str, context: str) -> bool:
    """Uses of the words that are about the product: HTTP sessions, the torch.distributed / tmux /
    requests sessions, GitHub issues of other projects cited by number (vLLM's RFCs)."""
    low = context.lower()
    if word.lower().startswith("session"):
        return any(k in low for k in ("start_new_session", "http session", "requests.session", "client session",
                                      "aiohttp", "session-scoped", 'scope="session"', "setsid", "own session",
                                      "sessionmaker", "pytest session", "test session", "session fixture"))
    return any(k in low for k in ("vllm", "sglang", "pytorch/pytorch", "transformers#", "llama.cpp"))
