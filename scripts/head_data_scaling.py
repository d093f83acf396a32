"""How a draft head's held-out agreement grows with its training data, and what a goal would take.

Trains one head per prefix of an extracted feature set (the first K training shards of a
``scripts/train_eagle_head.py`` feature run, e.g. one made with ``--extract-only``), every head with
the same recipe and seed, and evaluates each on the run's held-out sets. Top-1 agreement is fitted as
``a + b * log2(tokens)`` (``b`` = points per doubling of the data), and the fit is extrapolated to
``--goal``: an optimistic estimate, since such curves bend down as the data grows. Heads whose data
spans less than one doubling (largest / smallest < 2) get no fit: a slope over so short a span is
noise (898k and 998k tokens once gave "+8.9 points per doubling").

Example (35 minutes on 2 CPU cores for the five shards of a 462k-token run)::

    .venv/bin/python scripts/head_data_scaling.py --features scratch/eagle_features/<run> \\
        --shards 1,2,3,4,5 --epochs 4 --lr 1e-3 --output results/head-scaling.json

Writes ``FILE.json`` (every head's metrics and the fits), ``FILE.md`` (a table) and ``FILE.png``
(top-1 against training tokens on a log scale, with the fits and the goal).

``--head NAME=TRAINING_JSON`` (repeatable) draws released heads beside the line, from their
``train_eagle_head.py`` records (final held-out top-1 at depths 1-3, training tokens), and gives the
gain per doubling between them. ``--from-record FILE`` redraws an earlier output without training::

    .venv/bin/python scripts/head_data_scaling.py --from-record results/head-scaling.json \
        --head v8=heads/smollm2-135m-eagle/training.json \
        --head v9=heads/smollm2-135m-eagle-v9/training.json --output results/head-scaling.json
"""

import sys

from vllm_eagle2_tools.head_scaling import main

if __name__ == "__main__":
    sys.exit(main())
