"""The eagle2 step inside vLLM's engine: drafting, verification and tree attention.

:mod:`vllm_eagle2.patches` hooks these into vLLM's model runner; :mod:`.step` walks one step.
"""
