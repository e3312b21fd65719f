"""The suite's own rules: which tests are slow (tests/conftest.py), where Hypothesis takes its
example counts from, and how the layout fixture reads the layout of the checkpoints a test left.

Which tests start processes is read from the tests' source (its syntax tree, not bytecode,
whose instructions change between CPython releases): a test starts processes when it, a
fixture it uses (directly or through other fixtures), or a function or class of this tests
package that one of those names (followed transitively, across modules) names one of
:data:`PROCESS_HELPERS`."""

from __future__ import annotations

import ast
import dataclasses
import functools
from collections.abc import Iterator
from pathlib import Path

import numpy as np

import tsckpt
from tests import conftest
from tests.stored import checkpoint_roots, layout_record

TESTS = Path(__file__).resolve().parent
PACKAGE = "tests"

# Names (called, or their attributes used, or imported) that start a process: gloo ranks
# (tests.dist_helpers), a scenario in a fresh process (tests.torch_scenarios), multiprocessing
# (its contexts: get_context; fork), the subprocess module (the command line, scripts, a
# blocked saver, the fuzzers' worker; Popen however imported), torchrun, and tsckpt's writer
# processes (tests.conftest's writer_process fixture, the one place that lets saves start them).
PROCESS_HELPERS = frozenset(
    {"run_ranks", "run_solo", "get_context", "subprocess", "Popen", "fork", "posix_spawn", "torchrun", "live_writers"}
)

Def = ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef
Key = tuple[str, str]  # (module, name): a top-level function or class of a module of this package


@dataclasses.dataclass
class Source:
    """One module of this package: its syntax tree, its top-level functions and classes, the
    fixtures among them, and what the names it imports at the top refer to."""

    name: str
    tree: ast.Module
    defs: dict[str, Def]
    fixtures: dict[str, ast.FunctionDef | ast.AsyncFunctionDef]
    imports: dict[str, str]  # local name -> "tests.x" (a module) or "tests.x:y" (a member of one)


def _is_fixture(decorator: ast.expr) -> tuple[bool, str | None, bool]:
    """Whether ``decorator`` is ``pytest.fixture`` (called or not), the name it gives, autouse."""
    call = decorator if isinstance(decorator, ast.Call) else None
    target = call.func if call is not None else decorator
    named = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", None)
    if named != "fixture":
        return False, None, False
    kw = {k.arg: k.value for k in call.keywords} if call is not None else {}
    name = kw.get("name")
    autouse = kw.get("autouse")
    return (
        True,
        name.value if isinstance(name, ast.Constant) else None,
        isinstance(autouse, ast.Constant) and autouse.value is True,
    )


def _imports(nodes: Iterator[ast.AST] | list[ast.stmt], modules: set[str]) -> dict[str, str]:
    """What the names that the import statements among ``nodes`` bind refer to, for those
    that refer to a module of this package or a member of one."""
    found: dict[str, str] = {}
    for node in nodes:
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in modules and alias.asname:
                    found[alias.asname] = alias.name
        elif isinstance(node, ast.ImportFrom):
            base = PACKAGE if node.level == 1 else None if node.level else node.module
            if node.level == 1 and node.module:
                base = f"{PACKAGE}.{node.module}"
            if base is None:
                continue
            for alias in node.names:
                local = alias.asname or alias.name
                if f"{base}.{alias.name}" in modules:
                    found[local] = f"{base}.{alias.name}"
                elif base in modules:
                    found[local] = f"{base}:{alias.name}"
    return found


@functools.cache
def sources() -> dict[str, Source]:
    """Every module of this package, by dotted name."""
    paths = sorted(TESTS.glob("*.py"))
    names = {PACKAGE if p.stem == "__init__" else f"{PACKAGE}.{p.stem}": p for p in paths}
    out = {}
    for name, path in names.items():
        tree = ast.parse(path.read_text(), str(path))
        defs = {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
        fixtures = {}
        for n in defs.values():
            for d in n.decorator_list if not isinstance(n, ast.ClassDef) else ():
                is_fixture, fixture_name, _ = _is_fixture(d)
                if is_fixture:
                    fixtures[fixture_name or n.name] = n
        out[name] = Source(name, tree, defs, fixtures, _imports(tree.body, set(names)))
    return out


def _names(node: ast.AST) -> set[str]:
    """The names ``node`` (and everything nested in it) uses: variables, attributes, and the
    modules and members it imports."""
    found: set[str] = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Name):
            found.add(n.id)
        elif isinstance(n, ast.Attribute):
            found.add(n.attr)
        elif isinstance(n, ast.Import):
            for alias in n.names:
                found.update(alias.name.split("."))
        elif isinstance(n, ast.ImportFrom):
            found.update((n.module or "").split("."))
            found.update(alias.name for alias in n.names)
    return found


@functools.cache  # each definition walked once, however many tests reach it
def _named(key: Key) -> tuple[bool, frozenset[Key]]:
    """Whether the function or class ``key`` names a process helper itself, and the functions
    and classes of this package it names (a module of it it names: the members it names)."""
    src = sources()[key[0]]
    node = src.defs[key[1]]
    names = _names(node)
    refs = {**src.imports, **_imports(ast.walk(node), set(sources()))}
    targets: set[Key] = set()
    for n in names:
        if n in src.defs:
            targets.add((src.name, n))
        ref = refs.get(n)
        if ref is None:
            continue
        if ":" in ref:
            module, member = ref.split(":")
            if member in sources()[module].defs:
                targets.add((module, member))
        else:  # a module of this package: the members of it the code names (sc.save_dtensors)
            targets.update((ref, m) for m in names if m in sources()[ref].defs)
    return bool(names & PROCESS_HELPERS), frozenset(targets - {key})


@functools.cache
def starts_processes(key: Key) -> bool:
    """Whether the function or class ``key`` names a process helper, itself or through the
    functions and classes of this package it names, transitively."""
    stack, seen = [key], set()
    while stack:
        k = stack.pop()
        if k in seen:
            continue
        seen.add(k)
        direct, targets = _named(k)
        if direct:
            return True
        stack.extend(targets)
    return False


def _marks(decorators: list[ast.expr]) -> Iterator[ast.AST]:
    for d in decorators:
        yield from ast.walk(d)


def _is_slow_mark(nodes: Iterator[ast.AST]) -> bool:
    """Whether ``pytest.mark.slow`` is among ``nodes``."""
    return any(
        isinstance(n, ast.Attribute) and n.attr == "slow" and isinstance(n.value, ast.Attribute) and n.value.attr == "mark"
        for n in nodes
    )


def _heavy_reason(nodes: Iterator[ast.AST]) -> str | None:
    """The ``reason`` of a ``pytest.mark.slow(reason=...)`` among ``nodes``: a test too heavy for
    the fast tier though it starts no process (a JAX compile, a framework's whole fit)."""
    for n in nodes:
        if isinstance(n, ast.Call) and _is_slow_mark(iter([n.func])):
            for kw in n.keywords:
                if kw.arg == "reason" and isinstance(kw.value, ast.Constant) and isinstance(kw.value.value, str):
                    return kw.value.value
    return None


def _used_fixtures(nodes: Iterator[ast.AST]) -> set[str]:
    """The fixtures named in ``pytest.mark.usefixtures(...)`` among ``nodes``."""
    return {
        a.value
        for n in nodes
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "usefixtures"
        for a in n.args
        if isinstance(a, ast.Constant) and isinstance(a.value, str)
    }


def _pytestmark(src: Source) -> list[ast.AST]:
    return [
        n
        for stmt in src.tree.body
        if isinstance(stmt, ast.Assign) and any(getattr(t, "id", None) == "pytestmark" for t in stmt.targets)
        for n in ast.walk(stmt.value)
    ]


def _fixture(name: str, module: str) -> Key | None:
    """The fixture ``name`` as a test or fixture of ``module`` gets it: the module's own (or
    one it imports), else the conftest's."""
    src = sources()[module]
    if name in src.fixtures:
        return module, src.fixtures[name].name
    ref = src.imports.get(name, "")
    if ":" in ref:
        other, member = ref.split(":")
        if member in sources()[other].fixtures:
            return other, sources()[other].fixtures[member].name
    shared = sources()[f"{PACKAGE}.conftest"]
    return (shared.name, shared.fixtures[name].name) if name in shared.fixtures else None


def _autouse(module: str) -> set[str]:
    return {
        name
        for m in (module, f"{PACKAGE}.conftest")
        for name, f in sources()[m].fixtures.items()
        if any(_is_fixture(d)[2] for d in f.decorator_list)
    }


def _arguments(node: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    return [a.arg for a in node.args.posonlyargs + node.args.args + node.args.kwonlyargs]


@dataclasses.dataclass(frozen=True)
class Case:
    module: str
    name: str
    fixtures: frozenset[str]  # the names of every fixture it uses, directly or through others
    fixture_defs: frozenset[Key]  # those of this package
    marked_slow: bool  # by pytestmark, or its own decorator
    heavy: str | None = None  # the reason a test that starts no process is marked slow

    @property
    def slow(self) -> bool:
        """Marked slow, in the source or (conftest.SLOW_FIXTURES) at collection."""
        return self.marked_slow or bool(self.fixtures & conftest.SLOW_FIXTURES)

    @property
    def starts_processes(self) -> bool:
        return starts_processes((self.module, self.name)) or any(starts_processes(k) for k in self.fixture_defs)


def _closure(module: str, requested: set[str]) -> tuple[set[str], set[Key]]:
    """Every fixture ``requested`` by a test of ``module`` uses, transitively: names, definitions."""
    names, defs, stack = set(), set(), [(n, module) for n in requested]
    while stack:
        name, where = stack.pop()
        if name in names:
            continue
        names.add(name)
        key = _fixture(name, where)
        if key is None:
            continue  # pytest's own (tmp_path, monkeypatch, ...), or a parameter
        defs.add(key)
        node = sources()[key[0]].defs[key[1]]
        assert not isinstance(node, ast.ClassDef)
        stack.extend((a, key[0]) for a in _arguments(node) if a != "request")
    return names, defs


@functools.cache
def cases() -> list[Case]:
    """Every test function of the test modules."""
    found = []
    for src in sources().values():
        if not src.name.split(".")[-1].startswith("test_"):
            continue
        module_marks = _pytestmark(src)
        for node in src.tree.body:
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or not node.name.startswith("test"):
                continue
            requested = set(_arguments(node)) | _used_fixtures(iter(module_marks)) | _autouse(src.name)
            requested |= _used_fixtures(_marks(node.decorator_list))
            names, defs = _closure(src.name, requested)
            slow = _is_slow_mark(iter(module_marks)) or _is_slow_mark(_marks(node.decorator_list))
            heavy = _heavy_reason(_marks(node.decorator_list))
            found.append(Case(src.name, node.name, frozenset(names), frozenset(defs), slow, heavy))
    return found


def _case(module: str, name: str) -> Case:
    (found,) = [t for t in cases() if t.module == f"{PACKAGE}.{module}" and t.name == name]
    return found


def test_every_test_that_starts_processes_is_slow():
    unmarked = [f"{t.module}::{t.name}" for t in cases() if t.starts_processes and not t.slow]
    assert unmarked == [], "start processes but are not marked slow (pytest.mark.slow): " + ", ".join(unmarked)


def test_a_test_marked_slow_starts_processes():
    # the slow tier is what starts processes or a server, and the tests too heavy for the fast
    # tier, each saying why (pytest.mark.slow(reason=...)): the rest stays in the fast tier
    idle = [f"{t.module}::{t.name}" for t in cases() if t.marked_slow and not t.starts_processes and not t.heavy]
    assert idle == [], "marked slow but start no process and give no reason: " + ", ".join(idle)


def test_a_heavy_test_says_why_and_starts_no_process():
    heavy = [t for t in cases() if t.heavy is not None]
    assert heavy, "no test is marked slow for its weight: the fast tier would carry JAX compiles and whole fits"
    vague = [f"{t.module}::{t.name}" for t in heavy if len(t.heavy.split()) < 3]
    assert vague == [], "a reason of fewer than three words: " + ", ".join(vague)
    both = [f"{t.module}::{t.name}" for t in heavy if t.starts_processes]
    assert both == [], "start processes (slow for that; no reason needed): " + ", ".join(both)


def test_which_tests_start_processes():
    found = {(t.module.split(".")[-1], t.name) for t in cases() if t.starts_processes}
    assert ("test_distributed", "test_uneven_rows_on_three_ranks") in found  # run_ranks
    assert ("test_crash", "test_sigkill_at_random_moments") in found  # its savers, through _context: get_context
    assert ("test_cli", "test_subprocess_ls_show_verify") in found  # through run_cli: subprocess
    assert ("test_reader", "test_a_record_larger_than_its_files_is_refused_before_any_allocation") in found  # two down
    assert ("test_fuzz_metadata", "test_damaged_metadata_never_crashes_a_reader") in found  # a fixture, through its class
    assert ("test_resume", "test_single_process_resume_is_bit_identical") in found  # sc.run_solo
    assert ("test_faults", "test_overwrite_refuses_a_save_running_in_another_process") in found  # fixture saver
    assert ("test_cli", "test_ls") not in found
    assert ("test_tree", "test_escape_is_injective") not in found  # a Hypothesis test
    assert ("test_crash", "test_claim_lost_between_check_and_create") not in found
    # the S3 tests are slow through their server, not through processes
    assert _case("test_s3", "test_compact_layout_on_s3").slow
    assert not _case("test_s3", "test_compact_layout_on_s3").marked_slow


def test_hypothesis_example_counts_come_from_the_profile():
    # a count is the profile's, or examples(k) of it: never a number of its own, which the
    # quick and full profiles (tests/conftest.py) could not scale
    fixed = [
        f"{src.name}:{call.lineno}"
        for src in sources().values()
        for call in ast.walk(src.tree)
        if isinstance(call, ast.Call) and getattr(call.func, "id", getattr(call.func, "attr", None)) == "settings"
        for kw in call.keywords
        if kw.arg in ("max_examples",) and not (isinstance(kw.value, ast.Call) and getattr(kw.value.func, "id", None) == "examples")
    ]
    assert fixed == [], "Hypothesis settings with counts of their own: " + ", ".join(fixed)


def test_checkpoint_roots_reads_the_layout_of_each_root(tmp_path):
    tree = {"model": {"w": np.arange(6.0)}, "step": 1}
    tsckpt.save(tmp_path / "p", tree, layout="plain")
    tsckpt.save(tmp_path / "runs" / "c", tree, layout="compact")
    (tmp_path / "damaged").mkdir()
    (tmp_path / "damaged" / "zarr.json").write_text('{"attributes": {"tsckpt": {"layout"')
    # the array and group nodes of the plain checkpoint are no roots
    assert checkpoint_roots(tmp_path) == {tmp_path / "p": ("plain", 3), tmp_path / "runs" / "c": ("compact", 3)}
    assert (layout_record("plain"), layout_record("compact")) == (("plain", 3), ("compact", 3))
