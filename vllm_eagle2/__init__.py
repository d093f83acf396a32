"""vllm-eagle2: EAGLE-2 dynamic-tree speculative decoding for vLLM's V1 engine.

Installing the package registers the ``eagle2`` speculative method through vLLM's
``vllm.general_plugins`` entry point; see :func:`register`.
"""

__version__ = "0.1.0"


def register() -> None:
    """vLLM general-plugin entry point: patch vLLM for ``method: "eagle2"``.

    Runs in every vLLM process. It never raises: on an unsupported vLLM it logs one
    error naming the supported versions and registers nothing.
    """
    import logging

    try:
        from vllm_eagle2 import patches

        patches.apply()
    except Exception:  # noqa: BLE001 - a plugin must never break a vLLM that runs without it
        logging.getLogger("vllm.eagle2").exception("vllm-eagle2 failed to register; eagle2 is unavailable")
