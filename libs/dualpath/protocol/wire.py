"""The ``Wire`` base: explicit, validated msgpack mapping for frozen message dataclasses.

Fields must be plain data (int, float, str, bool, bytes, lists and dicts of those, or None).
``from_wire`` checks each field's top-level type against its annotation so a garbage message
fails at the edge with a message naming the field, instead of deep inside a handler.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from functools import cache
from typing import Any, ClassVar, Self  # evaluated by typing.get_type_hints (_field_checks)

__all__ = ["Wire"]

_PLAIN = (int, float, str, bool, bytes, list, dict, tuple)


@cache
def _field_checks(cls: type) -> tuple[tuple[str, tuple[type, ...], bool], ...]:
    """Per field: (name, accepted runtime types, optional?) derived from the annotations."""
    hints = typing.get_type_hints(cls)
    checks = []
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        args = typing.get_args(hint) if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union else (hint,)
        optional = type(None) in args
        accepted: list[type] = []
        for a in args:
            origin = typing.get_origin(a) or a
            if origin in _PLAIN:
                accepted.append(origin)
        if float in accepted:
            accepted.append(int)  # msgpack may carry 3.0 as 3
        if list in accepted or tuple in accepted:
            accepted.extend((list, tuple))
        checks.append((f.name, tuple(accepted), optional))
    return tuple(checks)


@cache
def _names(cls: type) -> tuple[str, ...]:
    """Field names in declaration order (computed once per class: encoding is a hot path)."""
    return tuple(f.name for f in dataclasses.fields(cls))


@cache
def _required(cls: type) -> tuple[str, ...]:
    """Names of the fields without a default (computed once per class: decoding is a hot path)."""
    return tuple(f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)


class Wire:
    """Mixin for message dataclasses: ``to_wire()`` -> dict, ``from_wire(dict)`` -> message."""

    __slots__ = ()
    TYPE_CODE: ClassVar[int]  # the message's type code on the wire (set by ``codec.register``)

    def to_wire(self) -> dict[str, Any]:
        """Fields as a plain dict (shallow: nested values must already be plain data)."""
        return {name: getattr(self, name) for name in _names(type(self))}  # type: ignore[arg-type]

    @classmethod
    def from_wire(cls, body: dict[str, Any]) -> Self:
        """Build the message from a decoded map; unknown keys are ignored (forward compatible).

        Raises:
            TypeError: a required field is missing or a field has the wrong type.
        """
        kwargs: dict[str, Any] = {}
        fields_of: Any = cls  # a message dataclass (Wire itself is only the mixin)
        for name, accepted, optional in _field_checks(fields_of):
            if name not in body:
                continue  # dataclass raises TypeError naming it when it has no default
            value = body[name]
            if value is None and optional:
                kwargs[name] = None
                continue
            if accepted and not isinstance(value, accepted):
                raise TypeError(f"field {name!r} has type {type(value).__name__}")
            kwargs[name] = value
        missing = [name for name in _required(fields_of) if name not in kwargs]
        if missing:
            raise TypeError(f"missing field(s) {', '.join(map(repr, missing))}")
        return cls(**kwargs)
