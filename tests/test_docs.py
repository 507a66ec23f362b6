"""The reading path stays put (issue 76): a short README for users, the measured tables in docs/results.md by
result, the narrative in docs/history.md, and links between them that lead somewhere."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
RESULTS = ROOT / "docs" / "results.md"
MAX_README_LINES = 250
MAX_RESULTS_SECTION_LINES = 20
RESULTS_SECTIONS = ["The main job", "Loss gains", "Data and steps", "Speed", "Serving", "Ablations"]


def section(text: str, title: str) -> list[str]:
    """The lines of the ``## title`` section of a markdown text, heading included, up to the next ``## ``."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == f"## {title}")
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    while end > start + 1 and not lines[end - 1].strip():
        end -= 1
    return lines[start:end]


def broken_links(path: Path) -> list[str]:
    """Relative markdown links of ``path`` (anchors dropped) whose file or folder does not exist."""
    bad = []
    for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text()):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        if not (path.parent / target.split("#", 1)[0]).exists():
            bad.append(f"{path.name}: {target}")
    return bad


def test_readme_stays_short():
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_README_LINES, (
        f"README.md has {len(lines)} lines (at most {MAX_README_LINES}): measured tables go to "
        "docs/results.md, narrative to docs/history.md")


def test_readme_results_section_is_one_short_table_that_points_to_results_md():
    results = section(README.read_text(), "Results")
    assert len(results) <= MAX_RESULTS_SECTION_LINES, (
        f"the README's Results section has {len(results)} lines (at most {MAX_RESULTS_SECTION_LINES})")
    assert "docs/results.md" in "\n".join(results)
    assert sum(line.startswith("|---") for line in results) == 1, "one table"


def test_results_md_is_ordered_by_result():
    text = RESULTS.read_text()
    headings = re.findall(r"^## (.+)$", text, flags=re.MULTILINE)
    assert [h for h in headings if h in RESULTS_SECTIONS] == RESULTS_SECTIONS, headings


@pytest.mark.parametrize("path", [README, RESULTS, ROOT / "docs" / "method.md", ROOT / "docs" / "bench.md"],
                         ids=lambda p: p.name)
def test_links_lead_somewhere(path):
    assert broken_links(path) == []


def test_the_checks_see_a_long_readme_and_a_broken_link(tmp_path):
    text = "# x\n\n## Results\n\n| a |\n|---|\n" + "| 1 |\n" * 30 + "\n## Next\n\nsee [here](missing.md)\n"
    assert len(section(text, "Results")) == 34  # heading, blank, header, rule, 30 rows
    (tmp_path / "README.md").write_text(text)
    assert broken_links(tmp_path / "README.md") == ["README.md: missing.md"]
