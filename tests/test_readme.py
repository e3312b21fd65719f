"""The README's examples run as written.

Every ```python block of README.md is a test. The blocks of one ``##`` section run
in order, in one namespace and one fresh working directory, so a block may use
what an earlier block of its section defined or saved. A block that needs several
processes or a server is marked by an HTML comment on the line just before it,
``<!-- not run: needs torchrun (several processes) -->``: it is compiled, then
skipped with that reason; every other block must run. A block that imports jax,
flax, optax or orbax is skipped (with the rest of its section) where that is not
installed.
"""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"

NOT_RUN = re.compile(r"<!--\s*not run:\s*(?P<why>\S.*?)\s*-->")
OPTIONAL = ("jax", "flax", "optax", "orbax")  # test extras a block may need; skipped where missing

# The README's set-up commands; .ci/run runs the second one, exactly.
DEMO_COMMAND = "pip install torch==2.13.0 && pip install -e . && python examples/demo.py"
TEST_COMMAND = 'pip install torch==2.13.0 && pip install -e ".[test]" && python -m pytest -q -n 4 --dist worksteal'


@dataclasses.dataclass(frozen=True)
class Block:
    """A fenced code block of the README."""

    section: str  # the ``##`` heading it is under ("" before the first)
    line: int  # the line of its opening fence, 1-based
    lang: str
    source: str
    not_run: str | None  # why it is not run, from the comment just before it

    @property
    def id(self) -> str:
        slug = re.sub(r"[^a-z0-9]+", "-", self.section.lower()).strip("-") or "top"
        return f"{slug}-L{self.line}"


def parse(text: str) -> list[Block]:
    """The fenced code blocks of ``text``, each with its section and not-run marker."""
    lines = text.splitlines()
    out: list[Block] = []
    section, i = "", 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("```"):
            lang = line[3:].strip()
            start = i
            i += 1
            while i < len(lines) and not lines[i].startswith("```"):
                i += 1
            if i == len(lines):
                raise AssertionError(f"README.md:{start + 1}: a code block is never closed")
            marker = NOT_RUN.fullmatch(lines[start - 1].strip()) if start else None
            body = "\n".join(lines[start + 1 : i])
            out.append(Block(section, start + 1, lang, body, marker.group("why") if marker else None))
        elif line.startswith("## "):
            section = line[3:].strip()
        i += 1
    return out


BLOCKS = parse(README.read_text(encoding="utf-8"))
PYTHON = [b for b in BLOCKS if b.lang == "python"]


class Section:
    """The blocks of one section run so far: their namespace, working directory and fate."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.namespace: dict[str, Any] = {"__name__": "__readme__"}
        self.ran: set[int] = set()  # lines of the blocks run
        self.stopped: tuple[str, str] | None = None  # ("failed" | "skipped", why): later blocks do the same


_SECTIONS: dict[str, Section] = {}


def _optional_imports(source: str) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.append(node.module)
    return sorted({n for n in names if n.split(".")[0] in OPTIONAL})


def _run(block: Block, section: Section) -> None:
    for name in _optional_imports(block.source):
        try:
            pytest.importorskip(name)
        except pytest.skip.Exception:
            section.stopped = ("skipped", f"README.md:{block.line} needs {name}, which is not installed")
            raise
    # padded so that a traceback's line numbers are the README's
    code = compile("\n" * block.line + block.source, str(README), "exec")
    try:
        exec(code, section.namespace)
    except BaseException:
        section.stopped = ("failed", f"the block at README.md:{block.line} failed")
        raise
    finally:
        section.ran.add(block.line)


@pytest.mark.parametrize("block", PYTHON, ids=[b.id for b in PYTHON])
def test_readme_example(block: Block, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    compile(block.source, f"README.md:{block.line}", "exec")  # every block is valid Python
    if block.not_run is not None:
        pytest.skip(f"not run: {block.not_run}")
    if block.section not in _SECTIONS:
        _SECTIONS[block.section] = Section(tmp_path_factory.mktemp("readme"))
    section = _SECTIONS[block.section]
    monkeypatch.chdir(section.workdir)
    # the earlier blocks of the section first, where this test runs alone (-k)
    for b in [b for b in PYTHON if b.section == block.section and b.line <= block.line and b.not_run is None]:
        if b.line in section.ran:
            continue
        if section.stopped is not None:
            fate, why = section.stopped
            (pytest.skip if fate == "skipped" else pytest.fail)(f"{why}; this block continues it")
        _run(b, section)


def test_readme_has_examples_and_markers_sit_on_python_blocks() -> None:
    assert len(PYTHON) >= 10 and sum(b.not_run is None for b in PYTHON) >= 8
    lines = README.read_text(encoding="utf-8").splitlines()
    marked = {b.line - 1 for b in PYTHON if b.not_run is not None}
    stray = [n + 1 for n, line in enumerate(lines) if "not run" in line and "<!--" in line and n + 1 not in marked]
    assert not stray, f"README.md lines {stray}: a not-run marker must be the line just before a ```python block"


def test_setup_commands_are_the_ones_ci_runs() -> None:
    shell = [line for b in BLOCKS if b.lang == "bash" for line in b.source.splitlines()]
    assert DEMO_COMMAND in shell and TEST_COMMAND in shell
    assert TEST_COMMAND in (ROOT / ".ci" / "run").read_text(encoding="utf-8")


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as dashes."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("doc", ["README.md", "CONTRIBUTING.md"])
def test_links_lead_somewhere(doc: str) -> None:
    def anchors(path: Path) -> set[str]:
        text = path.read_text(encoding="utf-8")
        text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)  # no headings inside code blocks
        return {_anchor(m.group(1)) for m in re.finditer(r"^#+ (.+)$", text, flags=re.M)}

    text = (ROOT / doc).read_text(encoding="utf-8")
    bad = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue  # a URL
        path, _, anchor = target.partition("#")
        file = ROOT / (path or doc)
        if not file.exists() or (anchor and file.suffix == ".md" and anchor not in anchors(file)):
            bad.append(target)
    assert not bad, f"{doc}: links to nowhere: {bad}"
