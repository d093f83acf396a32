"""What :func:`vllm_eagle2.patches.apply` changed so far, so that a failure can put it all back."""

from __future__ import annotations

import types
from typing import Any

#: Callables that undo each change, run in reverse order by :func:`roll_back`.
undo: list[Any] = []
#: ``(owner, name)`` of each change in place (kept after a successful apply(), cleared by
#: :func:`roll_back`), checked against the index in :mod:`vllm_eagle2.patches`: the owner is a module's
#: or class's qualified name, else ``<type>`` of the object changed (a dict, a dataclass field); a
#: dict's name is ``[key]``.
patched: list[tuple[str, str]] = []
#: ``applied``: apply() succeeded in this process; ``error``: why it refused (then said once).
state: dict[str, Any] = {"applied": False, "error": None}
_MISSING = object()


def _owner_name(owner: Any) -> str:
    if isinstance(owner, types.ModuleType):
        return owner.__name__
    kind = owner if isinstance(owner, type) else type(owner)
    name = f"{kind.__module__}.{kind.__qualname__}"
    return name if kind is owner else f"<{name}>"


def _note(owner: Any, name: str) -> None:
    entry = (_owner_name(owner), name)
    if entry not in patched:
        patched.append(entry)


def set_attr(owner: Any, name: str, value: Any) -> None:
    """``setattr(owner, name, value)``, undone by :func:`roll_back`."""
    old = owner.__dict__.get(name, _MISSING) if hasattr(owner, "__dict__") else getattr(owner, name)
    undo.append(lambda: delattr(owner, name) if old is _MISSING else setattr(owner, name, old))
    setattr(owner, name, value)
    _note(owner, name)


def set_item(mapping: dict, key: Any, value: Any) -> None:
    """``mapping[key] = value``, undone by :func:`roll_back`."""
    old = mapping.get(key, _MISSING)
    undo.append(lambda: mapping.pop(key) if old is _MISSING else mapping.__setitem__(key, old))
    mapping[key] = value
    _note(mapping, f"[{key!r}]")


def roll_back() -> None:
    while undo:
        undo.pop()()
    patched.clear()
