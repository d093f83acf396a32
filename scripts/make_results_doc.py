"""Regenerate ``docs/results.md`` from ``docs/results.md.in`` and ``results/*.json``.

Every number of the doc's tables is read from the JSON a benchmark script wrote (see
``vllm_eagle2_tools/results_doc.py`` for the placeholders); edit the template's prose, never the output::

    .venv/bin/python scripts/make_results_doc.py          # write docs/results.md
    .venv/bin/python scripts/make_results_doc.py --check  # exit 1 if docs/results.md is stale
"""

from __future__ import annotations

import argparse
import sys

from vllm_eagle2_tools import results_doc


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="only compare; exit 1 if docs/results.md differs")
    p.add_argument("--sources", action="store_true", help="list the results/ files the doc is built from")
    args = p.parse_args(argv)
    if args.sources:
        print("\n".join(results_doc.sources()))
        return 0
    if args.check:
        stale = results_doc.OUTPUT.read_text() != results_doc.render()
        print(f"{results_doc.OUTPUT} is {'stale: run ' + results_doc.COMMAND if stale else 'up to date'}")
        return int(stale)
    changed = results_doc.write()
    print(f"{results_doc.OUTPUT} {'rewritten' if changed else 'unchanged'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
