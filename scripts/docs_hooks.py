"""MkDocs hooks (mkdocs.yml: hooks).

* The studies' README.md files and their figures (experiments/<study>/) become pages of the docs site at the same
  paths, so that they stay where they are in the repository (their tables are tested there,
  tests/test_experiments.py) and the site's links to them are checked like any other.
* A page's ``<!-- forms-table -->`` becomes a table of the registered forms (:func:`attnlab.forms.list_forms`, the
  built-ins: every module of attnlab/forms), generated at build time: name, tags, what it is (the summary of its
  class docstring), its named settings (:attr:`attnlab.forms.Form.settings`: each row ``<form>_<setting>`` of
  :func:`attnlab.forms.form_settings` with its ``variant.params``), its O(L) path and its decoding state (the
  summary of its ``state_size`` docstring). So a new form, or a new named setting of one, is in the docs the moment
  it is registered, and no table is kept by hand. ``<!-- forms-table decay delta -->`` lists only the forms with
  one of those tags; a marker that lists no form fails the build.
* A page's ``<!-- compat-table -->`` becomes the table of the old names (:data:`attnlab.compat.MOVED`): old path,
  what to use instead (and how a call changes, where it does), the version it goes away in.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files

REPO = Path(__file__).resolve().parents[1]
SHOWN = {".md", ".png"}
FORMS_MARKER = re.compile(r"<!--\s*forms-table((?:\s+[\w-]+)*)\s*-->")
COMPAT_MARKER = re.compile(r"<!--\s*compat-table\s*-->")
KNOBS_MARKER = re.compile(r"<!--\s*knobs-table\s*-->")


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


def on_page_markdown(markdown: str, page, config, files) -> str:
    if "compat-table" in markdown:
        markdown = COMPAT_MARKER.sub(lambda _: compat_table(), markdown)
    if "knobs-table" in markdown:
        markdown = KNOBS_MARKER.sub(lambda _: knobs_table(), markdown)
    if "forms-table" not in markdown:
        return markdown

    def table(match: re.Match) -> str:
        tags = match.group(1).split()
        try:
            return forms_table(tags)
        except ValueError as exc:
            raise PluginError(f"{page.file.src_uri}: {match.group(0)}: {exc}") from None

    return FORMS_MARKER.sub(table, markdown)


# ---------------------------------------------------------------------------------------------- the forms table


def summary(doc: str | None) -> str:
    """The first sentence of a docstring's first paragraph, its lines joined, as Markdown ('' for none)."""
    paragraph = re.split(r"\n\s*\n", inspect.cleandoc(doc or ""), maxsplit=1)[0]
    text = " ".join(paragraph.split()).replace(" (module docstring)", "")  # (a pointer for readers of the code)
    # a sentence ends at ". " before a capital letter or a parenthesis ("et al. 2023" does not end one)
    text = re.split(r"(?<=\.)\s+(?=[A-Z(])", text, maxsplit=1)[0]
    if text.endswith(":"):  # a sentence that introduces a list (GLA's gates): the list is not in the summary
        text = text[:-1] + "."
    return markdown_of(text)


def markdown_of(text: str) -> str:
    """reST inline markup → Markdown, safe in a table cell: ``x`` and :role:`~a.b.x` → `x`; outside code, the
    characters Markdown reads as emphasis or a cell's end are escaped."""
    text = re.sub(r":\w+:`~?(?:[\w.]+\.)?([\w.]+?)`", r"``\1``", text)
    parts = re.split(r"(``.+?``)", text)
    out = []
    for part in parts:
        if part.startswith("``") and part.endswith("``") and len(part) > 4:
            out.append("`" + part[2:-2].replace("|", "\\|") + "`")
        else:
            out.append(re.sub(r"([\\|*_\[\]])", r"\\\1", part).replace("<", "&lt;"))
    return "".join(out)


def settings_cell(name: str) -> str:
    """A form's named settings (:func:`attnlab.forms.form_settings`, its rows but the defaults' own) as Markdown:
    ``gla_channel`` (``gate=channel``), … ('—' for none)."""
    from attnlab.forms import form_settings

    rows = [s for s in form_settings() if s.form == name and s.label != name]
    cells = []
    for row in rows:
        params = " ".join(f"{key}={value}" for key, value in row.params.items())
        cells.append(markdown_of(f"``{row.label}`` (``{params}``)"))
    return ", ".join(cells) or "—"


def forms_table(tags: list[str] | None = None) -> str:
    """The Markdown table of the registered forms (those with one of ``tags``, when given)."""
    from attnlab.forms import Form, form_class, list_forms

    names = [n for n in list_forms() if not tags or set(tags) & form_class(n).tags]
    if not names:
        raise ValueError(f"no registered form has a tag of {tags} (forms: {', '.join(list_forms())})")
    rows = [
        "| form | tags | what it is | named settings (`variant.params`) | O(L) path "
        "| decoding state (floats per sequence) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name in names:
        cls = form_class(name)
        recurrent = "recurrent" in cls.tags
        o_l = "`chunked`, `recurrent` backends" if recurrent else "— (quadratic: `eager` and the fused backends)"
        state = "—" if cls.state_size is Form.state_size else summary(cls.state_size.__doc__)
        cells = [
            f"`{name}`",
            ", ".join(sorted(cls.tags)) or "—",
            summary(cls.__doc__) or "—",
            settings_cell(name),
            o_l,
            state,
        ]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


# ---------------------------------------------------------------------------------------------- the old names


def knobs_table() -> str:
    """The Markdown table of what each registered form computes of the layer's knobs (the capability check,
    :func:`attnlab.forms.base.refuse_unimplemented`): a row per form, a column per knob of
    :class:`~attnlab.config.AttentionConfig` that chooses what is computed; ✓ computed (by the form or by the
    layer's own stages), the values where it computes only some, ✗ refused in one line (the reason in the hover)."""
    from attnlab.config import FIELDS, field_info
    from attnlab.forms import form_class, list_forms
    from attnlab.stages import claims_of

    knobs = [f for f in FIELDS if field_info(f)["role"] == "what"]
    rows = ["| form | " + " | ".join(f"`{field_info(f)['cli']}`" for f in knobs) + " |"]
    rows.append("| --- |" + " --- |" * len(knobs))
    for name in list_forms():
        cls = form_class(name)
        claims = claims_of(cls)
        cells = []
        for f in knobs:
            if f not in claims:
                why = cls.refusals.get(f, "not computed").replace('"', "'")
                cells.append(f'<span title="{why}">✗</span>')
            elif claims[f] is None:
                cells.append("✓")
            else:
                cells.append(", ".join(str(v) for v in claims[f]))
        rows.append(f"| `{name}` | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def compat_table() -> str:
    """The Markdown table of the old names (:data:`attnlab.compat.MOVED`), in the table's order."""
    from attnlab.compat import MOVED

    rows = ["| old name | use instead | goes away in |", "| --- | --- | --- |"]
    for entry in MOVED:
        use = f"`{entry.new}`" + (f" ({markdown_of(entry.change)})" if entry.change else "")
        rows.append(f"| `{entry.old}` | {use} | {entry.removed_in} |")
    return "\n".join(rows)
