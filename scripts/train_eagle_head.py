"""Train an EAGLE-1/EAGLE-2 draft head for a Llama-family target, in vLLM's ``eagle`` head format.

The command line of ``vllm_eagle2_tools.training``: options in ``vllm_eagle2_tools/training/cli.py``,
the pipeline (data, features, head, loss, schedule, output folder) described in
``vllm_eagle2_tools/training/recipe.py``
and printed by ``--help``.

Example (about 20 minutes on 2 CPU cores)::

    nice -n 19 .venv/bin/python scripts/train_eagle_head.py --num-conversations 300 --epochs 3 \\
        --output heads/smollm2-135m-eagle --seed 0
"""

from __future__ import annotations

import sys

from vllm_eagle2_tools.training.cli import main

if __name__ == "__main__":
    sys.exit(main())
