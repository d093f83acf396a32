"""Progress lines on stderr, one prefix per command (vLLM's own logs go to stdout)."""

from __future__ import annotations

import sys
from collections.abc import Callable


def stderr_log(tool: str) -> Callable[[str], None]:
    """A ``log(msg)`` that prints ``[tool] msg`` on stderr, flushed at once."""

    def log(msg: str) -> None:
        print(f"[{tool}] {msg}", file=sys.stderr, flush=True)

    return log
