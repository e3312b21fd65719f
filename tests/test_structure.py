"""The package's shape: docs/architecture.md lists every module once, imports only point
down that list (layers, not only the absence of cycles), no module imports another's
underscore names, and there is one public surface."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import pathlib
import re

import pytest

import tsckpt

PKG = pathlib.Path(tsckpt.__file__).parent
ROOT = PKG.parent
ARCHITECTURE = ROOT / "docs" / "architecture.md"

# Imports that point up the list on purpose, each with its reason. Keep this short: an
# entry here is a layer the code does not keep.
UPWARD: dict[tuple[str, str], str] = {}


@dataclasses.dataclass(frozen=True)
class Import:
    module: str  # importing module, dotted (tsckpt._save)
    target: str  # imported tsckpt module, dotted (tsckpt._plan)
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


def documented_order() -> list[str]:
    """Modules in the order docs/architecture.md lists them (top: the public surface)."""
    listed = re.findall(r"^\|\s*`(tsckpt/[\w/]+\.py)`", ARCHITECTURE.read_text(), flags=re.M)
    return [module_name(ROOT / p) for p in listed]


def test_architecture_lists_every_module_once():
    order = documented_order()
    assert sorted(order) == sorted(set(order)), [m for m in order if order.count(m) > 1]
    mods = set(modules())
    assert set(order) == mods, {"not listed": sorted(mods - set(order)), "no such module": sorted(set(order) - mods)}


def upward(order: list[str], found: list[Import]) -> list[str]:
    """The imports in ``found`` whose target is not listed below their importer in ``order``."""
    at = {m: i for i, m in enumerate(order)}
    return [
        f"{i.module}:{i.line} imports {i.target}"
        for i in found
        if i.module in at and i.target in at and at[i.target] <= at[i.module] and (i.module, i.target) not in UPWARD
    ]


def test_imports_only_point_down_the_documented_list():
    assert upward(documented_order(), imports(modules())) == []


def test_the_layer_check_sees_an_upward_import():
    """The check can fail: a list that puts a module above one it imports."""
    found = upward(["tsckpt._errors", "tsckpt._save"], imports(modules()))
    assert found and all(f.startswith("tsckpt._save:") and f.endswith("imports tsckpt._errors") for f in found)


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
    assert users == ["tsckpt._dtensor"]


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


@pytest.mark.parametrize("package", ["_codec", "_formats", "torch"])
def test_subsystems_are_packages(package):
    assert (PKG / package / "__init__.py").is_file()
