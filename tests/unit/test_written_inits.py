"""Hot dataclasses spell out ``__init__`` (``init=False``: mypyc compiles a written one
natively). This keeps each written ``__init__`` in step with its fields: the same names in
the same order, the same defaults, every field assigned. Read from the source, so it holds
whether the compiled build or pure Python is loaded."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

LIBS = Path(__file__).resolve().parents[2] / "libs"
FILES = sorted(p for p in (LIBS / "dualpath").rglob("*.py") if "init=False" in p.read_text())


def _written_init_classes(tree: ast.Module) -> list[ast.ClassDef]:
    out = []
    for node in tree.body:
        if not isinstance(node, ast.ClassDef):
            continue
        for deco in node.decorator_list:
            if isinstance(deco, ast.Call) and getattr(deco.func, "id", None) == "dataclass":
                if any(k.arg == "init" and isinstance(k.value, ast.Constant) and k.value.value is False for k in deco.keywords):
                    out.append(node)
    return out


def _fields(cls: ast.ClassDef) -> list[tuple[str, str | None]]:
    """(name, default as source; None: required) of the class's annotated fields."""
    fields = []
    for stmt in cls.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            default = None if stmt.value is None else ast.unparse(stmt.value)
            if default is not None and default.startswith("field(default_factory="):
                default = "None"  # the written __init__ takes None and builds the default itself
            fields.append((stmt.target.id, default))
    return fields


def _init(cls: ast.ClassDef) -> ast.FunctionDef:
    for stmt in cls.body:
        if isinstance(stmt, ast.FunctionDef) and stmt.name == "__init__":
            return stmt
    raise AssertionError(f"{cls.name}: init=False but no __init__ written")


def _params(fn: ast.FunctionDef) -> list[tuple[str, str | None]]:
    args = fn.args
    positional = args.posonlyargs + args.args
    pos_defaults = [None] * (len(positional) - len(args.defaults)) + [ast.unparse(d) for d in args.defaults]
    out = list(zip([a.arg for a in positional], pos_defaults, strict=True))[1:]  # without self
    out += [(a.arg, None if d is None else ast.unparse(d)) for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True)]
    return out


def _assigned(fn: ast.FunctionDef) -> set[str]:
    names = set()
    for node in ast.walk(fn):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and getattr(node.value, "id", None) == "self":
            names.add(node.attr)
        elif isinstance(node, ast.Call) and ast.unparse(node.func) == "object.__setattr__" and len(node.args) == 3:
            if isinstance(node.args[1], ast.Constant):
                names.add(node.args[1].value)
    return names


CLASSES = [(path, cls) for path in FILES for cls in _written_init_classes(ast.parse(path.read_text()))]


def test_the_hot_dataclasses_are_found():
    assert len(CLASSES) >= 20, [c.name for _, c in CLASSES]


@pytest.mark.parametrize(("path", "cls"), CLASSES, ids=[f"{p.stem}.{c.name}" for p, c in CLASSES])
def test_a_written_init_takes_and_sets_every_field_with_its_default(path, cls):
    fields, init = _fields(cls), _init(cls)
    assert _params(init) == fields, f"{path.name}:{cls.name}: __init__ parameters differ from the fields"
    missing = {name for name, _ in fields} - _assigned(init)
    assert not missing, f"{path.name}:{cls.name}: __init__ does not set {sorted(missing)}"
