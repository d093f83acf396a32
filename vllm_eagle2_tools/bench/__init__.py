"""The benchmark and the quickstart as library code; ``scripts/benchmark.py``, ``scripts/quickstart.py``
and the ``vllm-eagle2-bench`` console command are thin command lines over it.

* :mod:`~vllm_eagle2_tools.bench.config` -- the modes (rows) and their ``speculative_config``, the
  command-line value types, the target and head to run;
* :mod:`~vllm_eagle2_tools.bench.records` -- one engine's measurement (:class:`Run`) and its result row;
* :mod:`~vllm_eagle2_tools.bench.engines` -- the runs, one engine after another in one process;
* :mod:`~vllm_eagle2_tools.bench.report` and :mod:`~vllm_eagle2_tools.bench.plot` -- JSON, Markdown
  and PNG output;
* :mod:`~vllm_eagle2_tools.bench.cli` -- the benchmark's options and ``main``;
* :mod:`~vllm_eagle2_tools.bench.quickstart` -- the quickstart's two runs and its table.

Engines are built by :mod:`vllm_eagle2_tools.engine`, prompts come from :mod:`vllm_eagle2_tools.datasets`.
Nothing here imports vLLM or torch at module level (``--help`` stays fast).
"""

from __future__ import annotations

from vllm_eagle2_tools.progress import stderr_log

log = stderr_log("benchmark")
