"""The README and the docs site (docs/, mkdocs.yml): their Python examples pass the project's lint as code in the
repository would, the API reference covers the public API, and the README's own links lead somewhere. (Their
examples run in tests/test_cli.py; `make docs` checks the site's links and API entries in strict mode.)"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from ruff.__main__ import find_ruff_bin

import attnlab

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("**/*.md"))]
BLOCKS = [
    pytest.param(block, id=f"{page.relative_to(REPO).as_posix()}:{number}")
    for page in PAGES
    for number, block in enumerate(re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S), start=1)
]


def _ruff(*args: str, code: str) -> subprocess.CompletedProcess:
    """ruff on ``code`` as if it were a file of docs/ (the project's config, attnlab first-party)."""
    return subprocess.run(
        [find_ruff_bin(), *args, "--stdin-filename", str(REPO / "docs" / "example.py"), "-"],
        input=code,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_the_python_examples_are_found() -> None:
    assert len(BLOCKS) >= 4


@pytest.mark.parametrize("block", BLOCKS)
def test_a_python_example_passes_ruff(block: str) -> None:
    """Each ```python block alone passes ``ruff check`` and ``ruff format --check`` (what ``make lint`` asks of the
    code): so a block is a whole example, imports in order, that a reader can copy into a file of their own."""
    check = _ruff("check", "--no-cache", "--output-format", "concise", code=block)
    assert check.returncode == 0, check.stdout + check.stderr
    formatted = _ruff("format", code=block)
    assert formatted.returncode == 0, formatted.stderr
    assert formatted.stdout == block, "ruff format would change this example"


def test_the_api_reference_documents_the_public_api() -> None:
    """docs/api.md has a ``::: attnlab.<name>`` entry for every name of ``attnlab.__all__`` and for nothing else (an
    entry that no longer exists also fails ``make docs``)."""
    entries = re.findall(r"^::: attnlab\.(\w+)$", (REPO / "docs" / "api.md").read_text(), flags=re.M)
    assert len(entries) == len(set(entries))
    assert sorted(entries) == sorted(attnlab.__all__)


def test_the_readme_links_lead_to_files_of_the_repository() -> None:
    """Relative links and images of README.md (which the docs build does not read) name files that exist, and a
    ``#anchor`` into a docs page names one of its headings."""
    readme = (REPO / "README.md").read_text()
    links = re.findall(r"\]\(([^)\s]+)\)", readme)
    assert links
    for link in links:
        if re.match(r"[a-z]+://", link):
            continue
        path, _, anchor = link.partition("#")
        target = REPO / path if path else REPO / "README.md"
        assert target.is_file(), link
        if anchor and target.suffix == ".md":
            headings = re.findall(r"^#+ (.+)$", target.read_text(), flags=re.M)
            slugs = {re.sub(r"[^\w\- ]", "", h).strip().lower().replace(" ", "-") for h in headings}
            assert anchor in slugs, link
