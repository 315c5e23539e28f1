"""Every bus request takes its timeout from the one table next to the subjects."""

from __future__ import annotations

import ast
from pathlib import Path

from dualpath.protocol.timeouts import TIMEOUTS, BusTimeouts

ROOT = Path(__file__).resolve().parents[2]
SOURCES = [p for d in ("libs", "services", "loadgen") for p in (ROOT / d).rglob("*.py")]


def _bus_requests(tree: ast.AST):
    """Calls ``<something>.bus.request(...)`` or ``bus.request(...)``."""
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "request"):
            continue
        owner = node.func.value
        name = owner.attr if isinstance(owner, ast.Attribute) else owner.id if isinstance(owner, ast.Name) else ""
        if name in ("bus", "_bus"):
            yield node


def test_every_bus_request_names_its_timeout_from_the_table() -> None:
    calls, bad = 0, []
    for path in SOURCES:
        for call in _bus_requests(ast.parse(path.read_text(), str(path))):
            calls += 1
            t = {k.arg: k.value for k in call.keywords}.get("timeout")
            named = (
                isinstance(t, ast.Attribute)
                and isinstance(t.value, ast.Name)
                and t.value.id == "TIMEOUTS"
                and t.attr in BusTimeouts.__dataclass_fields__
            )
            if not named:
                bad.append(f"{path.relative_to(ROOT)}:{call.lineno}: timeout={ast.unparse(t) if t else '(none)'}")
    assert calls >= 10  # the walk does find the services' requests
    assert not bad, "bus requests whose timeout is not a TIMEOUTS entry:\n" + "\n".join(bad)


def test_every_timeout_in_the_table_is_positive_and_at_most_two_minutes() -> None:
    for name in BusTimeouts.__dataclass_fields__:
        assert 0 < getattr(TIMEOUTS, name) <= 120, name
