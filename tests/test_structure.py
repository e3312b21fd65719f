"""The package's shape: every module outside a few top-level ones lives in a package that
says what it owns and may import, the layers in pyproject.toml's import-linter contract
name every package (and import-linter keeps them), no module imports another's underscore
names, and there is one public surface."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

import tsckpt

PKG = pathlib.Path(tsckpt.__file__).parent
ROOT = PKG.parent



@dataclasses.dataclass(frozen=True)
class Import:
    module: str  # importing module, dotted (tsckpt._save.protocol)
    target: str  # imported tsckpt module, dotted (tsckpt._save.plan)
    names: tuple[str, ...]  # names imported from it (empty for `import x` / `from . import mod`)
    line: int


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, pathlib.Path]:
    return {module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def _resolve(importer: str, is_package: bool, level: int, module: str | None) -> str:
    base = importer.split(".")
    if not is_package:
        base = base[:-1]
    base = base[: len(base) - (level - 1)] if level > 1 else base
    return ".".join(base + ([module] if module else []))


def imports(mods: dict[str, pathlib.Path]) -> list[Import]:
    """Every import of a tsckpt module by a tsckpt module, at module level or in a function."""
    found = []
    for name, path in mods.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = _resolve(name, is_package, node.level, node.module) if node.level else (node.module or "")
                if not base.startswith("tsckpt"):
                    continue
                for alias in node.names:  # `from pkg import module` names a module
                    sub = f"{base}.{alias.name}"
                    if sub in mods:
                        found.append(Import(name, sub, (), node.lineno))
                    elif base in mods:
                        found.append(Import(name, base, (alias.name,), node.lineno))
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("tsckpt") and alias.name in mods:
                        found.append(Import(name, alias.name, (), node.lineno))
    return [i for i in found if i.target != i.module]


# Modules that stay at the top of the package: the public surface, the verbs that sit above
# the packages, and the definitions every layer shares. Everything else lives in a package.
TOP_LEVEL = {"tsckpt", "tsckpt.__main__", "tsckpt._cli", "tsckpt._manager", "tsckpt._convert",
             "tsckpt._options", "tsckpt._errors", "tsckpt._version", "tsckpt.tree", "tsckpt.mappings"}


def layer_contract() -> list[str]:
    """The packages the import-linter layers contract in pyproject.toml names, top first."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    (contract,) = [c for c in config["tool"]["importlinter"]["contracts"] if c["type"] == "layers"]
    return [name.strip() for layer in contract["layers"] for name in layer.split("|")]


def test_every_module_outside_the_top_level_is_in_a_package():
    loose = {m for m, p in modules().items() if m.count(".") == 1 and p.name != "__init__.py"} | {"tsckpt"}
    assert loose == TOP_LEVEL


def test_the_layer_contract_names_every_package_and_top_level_module():
    """A new package or top-level module must take a place in the layers, or import-linter
    would not check it."""
    named = set(layer_contract())
    packages = {m for m, p in modules().items() if p.name == "__init__.py" and m.count(".") == 1}
    unplaced = (packages | TOP_LEVEL) - named - {"tsckpt", "tsckpt.__main__", "tsckpt._version"}
    assert unplaced == set()


@pytest.mark.parametrize("package", sorted(m for m in modules() if m.count(".") == 1 and modules()[m].name == "__init__.py"))
def test_each_package_says_what_it_owns_and_may_import(package):
    doc = ast.get_docstring(ast.parse(modules()[package].read_text())) or ""
    assert "Owns" in doc or package == "tsckpt.torch", package
    assert "May import" in doc or package == "tsckpt.torch", package
    listed = set(re.findall(r":mod:`\.(\w+)`", doc))
    inside = {m.rsplit(".", 1)[1] for m in modules() if m.startswith(package + ".") and m.count(".") == 2}
    assert inside - {"__init__"} <= listed | {m for m in inside if m.startswith("_")}, (package, inside - listed)


def test_no_module_imports_another_modules_underscore_names():
    private = [
        f"{i.module}:{i.line} imports {name} from {i.target}"
        for i in imports(modules())
        for name in i.names
        if name.startswith("_") and not name.startswith("__")
    ]
    assert private == []


def test_torch_private_sharding_helper_has_one_home():
    users = [module_name(p) for p in PKG.rglob("*.py") if "compute_local_shape_and_global_offset" in p.read_text()]
    assert users == ["tsckpt._leaves.dtensor"]


def test_cli_does_no_library_work():
    """The CLI parses and prints: it opens no TensorStore and writes no files itself."""
    text = (PKG / "_cli.py").read_text()
    for needle in ("import tensorstore", "safe_open", "save_file", "kvstore()", "json.loads"):
        assert needle not in text, needle


def test_public_surface():
    for name in ("save", "restore", "open", "metadata", "verify", "convert", "save_async"):
        assert name in tsckpt.__all__ and callable(getattr(tsckpt, name))
    assert all(not n.startswith("_") for n in tsckpt.__all__)
    exported = {n for n, v in vars(tsckpt).items() if not n.startswith("_") and not inspect.ismodule(v)}
    assert set(tsckpt.__all__) == exported - {"annotations"}  # the __future__ feature


@pytest.mark.slow
def test_the_layers_are_checked_by_import_linter():
    """The contract is real: import-linter, run on the package, keeps it (CI runs it too).
    In a process of its own: import-linter configures logging as a command does."""
    lint = shutil.which("lint-imports")
    if lint is None:
        pytest.skip("import-linter is not installed (the test extra)")
    done = subprocess.run([lint, "--config", str(ROOT / "pyproject.toml")], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Contracts: 1 kept, 0 broken." in done.stdout
