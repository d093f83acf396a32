"""What :func:`vllm_eagle2.patches.apply` changed so far, so that a failure can put it all back."""

from __future__ import annotations

from typing import Any

#: Callables that undo each change, run in reverse order by :func:`roll_back`.
undo: list[Any] = []
#: ``applied``: apply() succeeded in this process; ``error``: why it refused (then said once);
#: ``cpu_isa_vec``: the runner being built is an eagle2 one (its CPU attention gets the "vec" layout).
state: dict[str, Any] = {"applied": False, "error": None, "cpu_isa_vec": False}
_MISSING = object()


def set_attr(owner: Any, name: str, value: Any) -> None:
    """``setattr(owner, name, value)``, undone by :func:`roll_back`."""
    old = owner.__dict__.get(name, _MISSING) if hasattr(owner, "__dict__") else getattr(owner, name)
    undo.append(lambda: delattr(owner, name) if old is _MISSING else setattr(owner, name, old))
    setattr(owner, name, value)


def set_item(mapping: dict, key: Any, value: Any) -> None:
    """``mapping[key] = value``, undone by :func:`roll_back`."""
    old = mapping.get(key, _MISSING)
    undo.append(lambda: mapping.pop(key) if old is _MISSING else mapping.__setitem__(key, old))
    mapping[key] = value


def roll_back() -> None:
    while undo:
        undo.pop()()
