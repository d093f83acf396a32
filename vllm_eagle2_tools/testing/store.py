"""Content-addressed model folders: the same tiny model always loads from the same path.

vLLM keys its compile cache by the model's path (``ModelConfig.compute_hash``), so a tiny model
built into a fresh temporary folder recompiles from scratch in every test module: about 11 s more per
compiled engine start on 2 cores than a start that finds its cache. Moving each built folder to a path
named for its content lets every test (and the smoke check's CPU mode) that builds the same seeded
model share one cache entry.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from pathlib import Path

from vllm_eagle2_tools.cpu_env import SCRATCH

STORE = SCRATCH / "models"


def stored(folder: str | Path) -> Path:
    """A copy of ``folder`` at ``STORE/<name>-<sha256 of its files>``, made once; returns its path."""
    folder = Path(folder)
    h = hashlib.sha256()
    for f in sorted(p for p in folder.rglob("*") if p.is_file()):
        h.update(str(f.relative_to(folder)).encode())
        h.update(f.read_bytes())
    dest = STORE / f"{folder.name}-{h.hexdigest()[:16]}"
    if not dest.exists():
        STORE.mkdir(parents=True, exist_ok=True)
        # Copy next to the destination, then rename: a reader never sees half a folder.
        tmp = Path(tempfile.mkdtemp(dir=STORE))
        shutil.copytree(folder, tmp / "m")
        try:
            (tmp / "m").rename(dest)
        except OSError:  # another process stored the same content first
            pass
        shutil.rmtree(tmp, ignore_errors=True)
    return dest
