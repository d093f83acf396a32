"""``docs/results.md`` is generated from ``results/*.json``: the committed text must be the generator's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vllm_eagle2_tools import results_doc


def test_results_doc_is_generated_from_the_results_json() -> None:
    """Regenerating docs/results.md from docs/results.md.in and results/*.json gives the committed file."""
    committed = results_doc.OUTPUT.read_text()
    generated = results_doc.render()
    if committed != generated:
        old, new = committed.splitlines(), generated.splitlines()
        first = next((i for i, (a, b) in enumerate(zip(old, new)) if a != b), min(len(old), len(new)))
        pytest.fail(
            f"docs/results.md is stale (first difference at line {first + 1}); regenerate it with "
            f"`{results_doc.COMMAND}`"
        )


def test_every_table_source_exists_and_every_placeholder_is_filled() -> None:
    """The doc reads only files that exist in results/, and no placeholder is left in the output."""
    sources = results_doc.sources()
    assert sources and all((results_doc.WORKDIR / s).is_file() for s in sources)
    assert "{{" not in results_doc.render()


def test_placeholders_read_rows_paths_ratios_and_sums(tmp_path: Path) -> None:
    """Each placeholder form of the template, on a small record of its own."""
    row = {"label": "eagle2 dynamic m=4 d=2 k=2", "batch_size": 1, "tau": 1.7349, "tokens_per_s": 47.63}
    row |= {"speedup": 1.1812, "acceptance_per_pos": [0.531, 0.2149, 0.01], "identical": 8, "compared": 8}
    base = {"label": "eagle2 static m=4 d=2 k=2", "batch_size": 4, "tau": 1.5, "tokens_per_s": 40.0}
    (tmp_path / "run.json").write_text(json.dumps({"all_rows": [row, base], "x": [{"a": 1, "b": 2}]}))
    (tmp_path / "eager.json").write_text(json.dumps({"all_rows": [dict(row, tau=1.7)]}))
    template = tmp_path / "t.md.in"
    template.write_text(
        "| {{run|eagle2 dynamic m=4 d=2 k=2|tau}} | {{tps}} | {{x}} | {{acc2}} | {{ident}} |\n"
        "| {{run|eagle2 static m=4 d=2 k=2@4|tau}} | "
        "{{|eagle2 dynamic m=4 d=2 k=2|$ratio:static m=4 d=2 k=2@4}} |\n"
        "| {{run|$x.0|a&b:d}} | {{run|eagle2 dynamic m=4 d=2 k=2|$xratio:eagle2 static m=4 d=2 k=2@4}} |\n"
        "| {{run|eagle2 dynamic m=4 d=2 k=2|$tauof:eager}} |\n"
    )
    results_doc.load.cache_clear()
    try:
        text = results_doc.render(template, tmp_path)
    finally:
        results_doc.load.cache_clear()
    assert text.splitlines()[1:] == [
        "| 1.73 | 47.6 | 1.18x | 0.53 / 0.21 | 8/8 |",
        "| 1.50 | 1.16 |",
        "| 3 | 1.19x |",
        "| 1.021 |",
    ]
    template.write_text("{{run|no such row|tau}}\n")
    with pytest.raises(ValueError, match="no such row"):
        results_doc.render(template, tmp_path)
