"""Tools around the vllm-eagle2 plugin: benchmarks, the smoke check, head training, soak tests,
profiling, results docs, the default model and the tests' seeded tiny models.

Never imported by the plugin (``vllm_eagle2``), which ships into every vLLM process; these need
the ``bench`` extra (matplotlib, gguf, accelerate) and run from a checkout's scripts/.
"""
