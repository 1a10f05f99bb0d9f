"""MkDocs hook (mkdocs.yml: hooks): the studies' README.md files and their figures (experiments/<study>/) become
pages of the docs site at the same paths, so that they stay where they are in the repository (their tables are
tested there, tests/test_experiments.py) and the site's links to them are checked like any other."""

from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File, Files

REPO = Path(__file__).resolve().parents[1]
SHOWN = {".md", ".png"}


def on_files(files: Files, config) -> Files:
    for path in sorted((REPO / "experiments").glob("*/*")):
        if path.suffix in SHOWN and path.is_file():
            files.append(
                File(
                    path.relative_to(REPO).as_posix(),
                    src_dir=str(REPO),
                    dest_dir=config["site_dir"],
                    use_directory_urls=config["use_directory_urls"],
                )
            )
    return files
