"""vllm-eagle2: EAGLE-2 dynamic-tree speculative decoding for vLLM's V1 engine."""

__version__ = "0.1.0"


def register() -> None:
    """vLLM general-plugin entry point (filled in by the engine integration)."""
