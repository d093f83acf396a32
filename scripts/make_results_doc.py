"""Regenerate ``docs/results.md`` and ``README.md`` from their ``.md.in`` templates and ``results/*.json``.

Every measured number of both is read from the JSON a benchmark script wrote (see
``vllm_eagle2_tools/results_doc.py`` for the placeholders); edit the templates, never the output::

    .venv/bin/python scripts/make_results_doc.py          # write docs/results.md and README.md
    .venv/bin/python scripts/make_results_doc.py --check  # exit 1 if either is stale
"""

from __future__ import annotations

import argparse
import sys

from vllm_eagle2_tools import results_doc


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="only compare; exit 1 if a generated doc differs")
    p.add_argument("--sources", action="store_true", help="list the results/ files the docs are built from")
    args = p.parse_args(argv)
    if args.sources:
        print("\n".join(results_doc.sources()))
        return 0
    if args.check:
        stale = results_doc.stale()
        for out in results_doc.DOCS:
            print(f"{out} is {'stale: run ' + results_doc.COMMAND if out in stale else 'up to date'}")
        return int(bool(stale))
    changed = results_doc.write()
    for out in results_doc.DOCS:
        print(f"{out} {'rewritten' if out in changed else 'unchanged'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
