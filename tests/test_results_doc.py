"""``docs/results.md`` and ``README.md`` are generated from ``results/*.json``: the committed texts must be
the generator's, and every number the README reports is read from the JSON it cites."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from vllm_eagle2_tools import results_doc


@pytest.mark.parametrize("output", list(results_doc.DOCS), ids=lambda p: p.name)
def test_generated_docs_are_the_generators_output(output: Path) -> None:
    """Regenerating each doc from its template and results/*.json gives the committed file."""
    committed = output.read_text()
    generated = results_doc.render(results_doc.DOCS[output])
    if committed != generated:
        old, new = committed.splitlines(), generated.splitlines()
        first = next((i for i, (a, b) in enumerate(zip(old, new)) if a != b), min(len(old), len(new)))
        pytest.fail(
            f"{output.name} is stale (first difference at line {first + 1}); regenerate it with "
            f"`{results_doc.COMMAND}`"
        )


def test_every_table_source_exists_and_every_placeholder_is_filled() -> None:
    """The docs read only files that exist in results/, and no placeholder is left in the output."""
    sources = results_doc.sources()
    assert sources and all((results_doc.WORKDIR / s).is_file() for s in sources)
    assert "results/epyc-b1-fp32-mtbench.json" in results_doc.sources([results_doc.WORKDIR / "README.md.in"])
    for template in results_doc.DOCS.values():
        assert "{{" not in results_doc.render(template)


#: Numbers in the README that are not measurements of ours, and why.
NOT_MEASURED = {
    "75-80%": "the EAGLE papers' heads",
    "20%": "the quickstart's threshold for rounds that differ",
    "97%": "the rule of draft_vocab_size auto",
}
MEASURED = re.compile(r"\d+(?:\.\d+)?(?:-\d+(?:\.\d+)?)?(?:%|x\b)|\d+\.\d+")


def test_every_number_the_readme_reports_is_read_from_the_json_it_cites() -> None:
    """Outside code and placeholders, the README's template holds no measured number: each one is a
    placeholder filled from a results/*.json (checked above), so none can drift from its data."""
    text = (results_doc.WORKDIR / "README.md.in").read_text()
    text = re.sub(r"```.*?```", "", text, flags=re.S)  # commands
    text = re.sub(r"`[^`]*`", "", text)  # code: versions, paths, option values
    text = results_doc.PLACEHOLDER.sub("", text)
    text = re.sub(r"\b(?:vLLM|torch) \d+\.\d+(?:\.x)?", "", text)  # versions
    literal = [m for m in MEASURED.findall(text) if m not in NOT_MEASURED]
    assert literal == [], f"README.md.in reports numbers no results/*.json gives: {literal}"


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


def test_results_holds_only_what_the_docs_read_and_at_most_80_files() -> None:
    """results/ keeps the files a doc reads or cites in the tree, and nothing else (a superseded sitting
    leaves the tree: the docs cite it ``at COMMIT``), at most 80 of them."""
    files = {str(p.relative_to(results_doc.RESULTS)) for p in results_doc.RESULTS.rglob("*") if p.is_file()}
    unread = sorted(files - results_doc.cited())
    assert unread == [], f"results/ files no doc reads (git rm them; cite them 'at COMMIT'): {unread}"
    assert len(files) <= 80


def test_a_citation_at_a_commit_needs_no_file_and_one_without_needs_one() -> None:
    """`results/x.*` at abc1234 names a file of an old commit; the same path without it must exist."""
    text = "see (`results/gone.*` at abc1234) and results/mtbench-b1-bf16-amx.json"
    found = [(m.group(1), bool(m.group(2))) for m in results_doc.CITATION.finditer(text)]
    assert found == [("gone.*", True), ("mtbench-b1-bf16-amx.json", False)]
    assert results_doc._expand("profile-never-b{4,16}.md") == ["profile-never-b4.md", "profile-never-b16.md"]


def test_results_doc_fits_in_300_lines() -> None:
    """docs/results.md shows today's numbers first and summarises the rest: at most 300 lines."""
    assert len(results_doc.OUTPUT.read_text().splitlines()) <= 300
