"""The index in :mod:`vllm_eagle2.patches` lists every change the plugin makes to vLLM.

* Every symbol that ``apply()`` patches (as :mod:`vllm_eagle2.patches.record` records it) is listed.
* The attention-layer wrapping (:mod:`vllm_eagle2.engine.attention`) is listed with the attributes it
  replaces on vLLM's attention impls.
* Every private name (``x._name``) the plugin reads and does not define itself is listed.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import vllm_eagle2
from vllm_eagle2 import patches

PACKAGE = Path(vllm_eagle2.__file__).parent
INDEX = patches.__doc__.split("Index (vLLM", 1)[1]
SUBPROCESS_SECONDS = 300

# A fresh interpreter: apply() once, with the opt-in that adds the CPU build's sampler fix.
APPLY_AND_REPORT = """
import json
from vllm_eagle2 import patches
from vllm_eagle2.patches import record
applied = patches.apply()
print(json.dumps({"applied": applied, "patched": record.patched}))
"""


def listed(owner: str, name: str) -> str:
    """What the index must contain for a recorded change: ``owner.name`` for a module or class;
    for another object (``<type>``: a class's annotation dict, a dataclass field) the item or
    attribute changed, as the index writes it under the class's entry."""
    if not owner.startswith("<"):
        return f"{owner}.{name}"
    return name if name.startswith("[") else f".{name}"


def test_every_symbol_apply_patches_is_listed_in_the_index():
    env = {**os.environ, patches.FIX_VLLM_CPU_ENV: "1"}
    proc = subprocess.run(
        [sys.executable, "-c", APPLY_AND_REPORT],
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_SECONDS,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["applied"] and out["patched"], out
    missing = [f"{owner} {name}" for owner, name in out["patched"] if listed(owner, name) not in INDEX]
    assert missing == [], f"patched but not in the index of vllm_eagle2.patches: {missing}"


def test_the_attributes_wrap_attention_layers_replaces_on_vllm_attention_impls_are_listed():
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.v1.attention.backend import AttentionImpl

    from vllm_eagle2.engine import attention

    class FlashAttentionStandIn(AttentionImpl):  # the name picks the CUDA KV layout: no CPU kernel build
        def __init__(self) -> None:
            pass

        def forward(self, layer, query, key, value, kv_cache, attn_metadata, output=None):
            return output

        def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
            pass

    impl = FlashAttentionStandIn()
    before = set(vars(impl))
    attention.wrap_attention_layers({"model.layers.0.self_attn.attn": SimpleNamespace(impl=impl)})
    replaced = sorted(set(vars(impl)) - before)
    assert replaced, "wrap_attention_layers changed nothing"
    layer = f"{Attention.__module__}.{Attention.__qualname__}"
    missing = [name for name in replaced if f"{layer}.impl.{name}" not in INDEX]
    assert "vllm_eagle2.engine.attention" in INDEX and missing == [], missing


def _defined_by_the_plugin(tree: ast.Module) -> set[str]:
    """Names the plugin defines: module-level functions, classes and assignments, class members, and
    any attribute it assigns (``x._name = ...``). Functions nested in functions are not: the patches'
    wrappers carry the names of the vLLM methods they replace."""
    names: set[str] = set()

    def targets(node: ast.AST) -> list[ast.AST]:
        if isinstance(node, ast.Assign):
            return node.targets
        return [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []

    scopes = [tree.body] + [node.body for node in ast.walk(tree) if isinstance(node, ast.ClassDef)]
    for body in scopes:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            names.update(t.id for t in targets(node) if isinstance(t, ast.Name))
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, (ast.Store, ast.Del)):
            names.add(node.attr)
    return names


def test_every_private_name_the_plugin_reads_from_vllm_is_listed_in_the_index():
    trees = {path: ast.parse(path.read_text()) for path in sorted(PACKAGE.rglob("*.py"))}
    defined = set().union(*(_defined_by_the_plugin(tree) for tree in trees.values()))
    read: dict[str, str] = {}
    for path, tree in trees.items():
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load)):
                continue
            if re.fullmatch(r"_[a-zA-Z]\w*", node.attr) and node.attr not in defined:
                read.setdefault(node.attr, f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    assert read, "the scan found no private vLLM names: it no longer sees the plugin's code"
    missing = {name: where for name, where in read.items() if not re.search(rf"\.{name}\b", INDEX)}
    assert missing == {}, f"private names read but not in the index of vllm_eagle2.patches: {missing}"
