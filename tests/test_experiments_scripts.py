"""The studies' shell scripts (experiments/<study>/*.sh, on top of experiments/lib.sh), issue 61: every knob a script
reads from the environment is named in its header comment, in its study's README (its "Reproduce" section) and in
docs/experiments.md; and a script writes the published results (experiments/<study>/summary.csv, its other tables
and its figures) only with ``UPDATE=1``, everything else going to a new folder under outputs/.

A script's knobs are found in its text: the names it reads as ``${NAME:-...}`` (or ``:+``, ``-``, ``=``), and those
of experiments/lib.sh that reach it: ``OUT`` and ``UPDATE`` always (they decide where everything goes), any other
one where the script uses it itself or calls a function of lib.sh that does (``sweep`` uses ``SEEDS``, ``tuned``
uses ``GRID``, ...). A name the script assigns outright (``SEEDS=1`` in a longer.sh) is fixed there, not a knob.
(The sweeps' overrides themselves are checked in tests/test_experiments.py, which reads them with ``PY=:``.)
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LIB = REPO / "experiments" / "lib.sh"
SCRIPTS = sorted(REPO.glob("experiments/*/*.sh"))
IDS = [s.relative_to(REPO / "experiments").as_posix() for s in SCRIPTS]
# read by lib.sh but set by the environment's activation, not a study's knob
NOT_KNOBS = {"VIRTUAL_ENV"}
# scripts that publish nothing (they print their evidence or table): UPDATE=1 changes nothing there
PUBLISH_NOTHING = {"mqar/bidirectional.sh", "position_tasks/run.sh"}

_READ = re.compile(r"\$\{([A-Z_][A-Z0-9_]*):?[-+=]")
_FUNCTION = re.compile(r"^(\w+)\(\) \{\n(.*?)^\}", re.S | re.M)


def _code(text: str) -> str:
    """The script without its comment lines and trailing comments (``#`` after a blank, outside ``${#...}``)."""
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    return "\n".join(re.sub(r"\s+#\s.*$", "", line) for line in lines)


def _header(text: str) -> str:
    """The comment block at the top of a script (after the ``#!`` line)."""
    lines = text.splitlines()
    if lines and lines[0].startswith("#!"):
        lines = lines[1:]
    block = []
    for line in lines:
        if not line.startswith("#"):
            break
        block.append(line)
    return "\n".join(block)


def _uses(code: str, name: str) -> bool:
    return re.search(rf"\$\{{?!?{name}\b", code) is not None


def _calls(code: str, name: str) -> bool:
    """Whether ``code`` runs the command ``name`` (at a command's place: a line's start, after ``;``, ``&&``, ``|``,
    ``$(``, ``then`` or ``do``, after any ``VAR=value`` prefixes)."""
    start = r"(?:^|[;&|(]|\bthen\b|\bdo\b)\s*(?:[A-Z_][A-Z0-9_]*=\S*\s+)*"
    return re.search(rf"{start}{name}(?=\s|$|\))", code, re.M) is not None


def _lib() -> tuple[set[str], dict[str, str]]:
    """lib.sh's knobs, and its functions' bodies (each with the bodies of the lib functions it calls)."""
    text = _code(LIB.read_text())
    knobs = set(_READ.findall(text)) - NOT_KNOBS
    bodies = dict(_FUNCTION.findall(text))
    for _ in bodies:  # (transitively: finish calls runtime, sweep calls dry)
        for name, body in list(bodies.items()):
            bodies[name] = body + "".join(bodies[other] for other in bodies if other != name and _calls(body, other))
    return knobs, bodies


def knobs_of(script: Path) -> set[str]:
    """The environment variables ``script`` reads (module docstring)."""
    code = _code(script.read_text())
    own = set(_READ.findall(code)) - NOT_KNOBS
    lib_knobs, bodies = _lib()
    called = [body for name, body in bodies.items() if _calls(code, name)]
    reaching = {k for k in lib_knobs if k in ("OUT", "UPDATE") or _uses(code, k) or any(_uses(b, k) for b in called)}
    fixed = {m for m in re.findall(r"^([A-Z_][A-Z0-9_]*)=(?!\$\{\1:)\S*$", code, re.M)}
    return (own | reaching) - (fixed - own)


def _reproduce(readme: Path) -> str:
    """A study README's ``## Reproduce`` section."""
    match = re.search(r"^## Reproduce\b.*?(?=^## |\Z)", readme.read_text(), re.S | re.M)
    assert match, f"{readme.relative_to(REPO)} has no '## Reproduce' section"
    return match.group(0)


def test_the_knobs_are_found() -> None:
    assert len(SCRIPTS) >= 20
    assert knobs_of(REPO / "experiments/recall_state/run.sh") >= {"MODELS", "OUT", "UPDATE", "RUNS", "SEEDS", "PY"}
    assert {"GRID", "TUNED_SEEDS", "TUNE_METRIC", "MODELS"} <= knobs_of(REPO / "experiments/state_tracking/run.sh")
    assert "SEEDS" not in knobs_of(REPO / "experiments/state_tracking/longer.sh")  # (fixed there: SEEDS=1)
    assert "TUNE_METRIC" not in knobs_of(REPO / "experiments/gated_output/run.sh")  # (fixed: val/bpc)
    assert "SEEDS" not in knobs_of(REPO / "experiments/forgetting_recall/run.sh")  # (tuned only: TUNED_SEEDS)


@pytest.mark.parametrize("script", SCRIPTS, ids=IDS)
def test_every_knob_a_script_reads_is_named_in_its_header(script: Path) -> None:
    header = _header(script.read_text())
    missing = sorted(k for k in knobs_of(script) if not re.search(rf"\b{k}\b", header))
    assert not missing, f"{script.relative_to(REPO)} reads {missing} but its header comment does not name them"


@pytest.mark.parametrize("script", SCRIPTS, ids=IDS)
def test_every_knob_a_script_reads_is_named_in_its_study_readme_and_in_the_docs(script: Path) -> None:
    section = _reproduce(script.parent / "README.md")
    docs = (REPO / "docs" / "experiments.md").read_text()
    for where, text in (("README's Reproduce section", section), ("docs/experiments.md", docs)):
        missing = sorted(k for k in knobs_of(script) if not re.search(rf"\b{k}\b", text))
        assert not missing, f"{script.relative_to(REPO)} reads {missing}: not named in its {where}"
    assert script.relative_to(script.parent.parent).as_posix() in section.replace("experiments/", "")


@pytest.mark.parametrize("script", SCRIPTS, ids=IDS)
def test_a_script_names_no_published_file_itself(script: Path) -> None:
    """A script writes through ``$RESULTS`` (lib.sh: experiments/<study>/ with UPDATE=1, else $OUT), never to a path
    of experiments/ it spells out: the only experiments/ paths in its code are the scripts it runs, and it reads the
    published files (``$PUBLISHED``) only to copy them into ``$RESULTS``."""
    code = _code(script.read_text())
    for path in re.findall(r"experiments/[\w./-]*", code):
        assert path.endswith((".py", ".sh")) and (REPO / path).is_file(), (script.name, path)
    for line in code.splitlines():
        if "PUBLISHED" in line:
            assert re.match(r'\s*cp( "\$PUBLISHED/[\w.]+")+ "\$RESULTS/?"', line), (script.name, line)


# ------------------------------------------------------------------------------------- run, with a stand-in Python

FAKE_PY = """#!/usr/bin/env bash
{ printf '%q ' "$@"; echo; } >> "$FAKE_LOG"
cat > /dev/null 2>&1 || true
"""


def _published(study: Path) -> dict[str, tuple[int, int]]:
    """The study folder's files but its scripts: (size, mtime_ns) by name."""
    return {
        p.relative_to(study).as_posix(): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in study.rglob("*")
        if p.is_file() and p.suffix not in (".sh", ".py") and "runs" not in p.relative_to(study).parts
    }


def _run(script: Path, tmp_path: Path, **env: str) -> tuple[subprocess.CompletedProcess, list[list[str]]]:
    """``bash script`` with a stand-in for Python that runs nothing and logs each call's arguments."""
    fake = tmp_path / "python"
    fake.write_text(FAKE_PY)
    fake.chmod(0o755)
    log = tmp_path / "calls.log"
    log.unlink(missing_ok=True)
    proc = subprocess.run(
        ["bash", str(script)],
        cwd=REPO,
        env={**os.environ, "PY": str(fake), "FAKE_LOG": str(log), "MODELS": "", **env},
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
    )
    calls = [shlex.split(line) for line in log.read_text().splitlines()] if log.exists() else []
    return proc, calls


def _under(path: str, folder: Path) -> bool:
    where = (REPO / path).resolve() if not os.path.isabs(path) else Path(path).resolve()
    return where == folder or folder in where.parents


def _written_into_study(calls: list[list[str]], study: Path) -> list[str]:
    """The arguments of the Python calls that name a file or folder of the study other than its scripts."""
    named = [a.split("=", 1)[-1] for call in calls for a in call]
    return [a for a in named if "/" in a and _under(a, study) and not a.endswith((".py", ".sh"))]


# each script as it is, and those that read MODELS with MODELS set too (its first model)
RUNS_OF = [pytest.param(s, "", id=i) for s, i in zip(SCRIPTS, IDS, strict=True)] + [
    pytest.param(s, "first", id=f"{i}-MODELS") for s, i in zip(SCRIPTS, IDS, strict=True) if "MODELS" in knobs_of(s)
]


@pytest.mark.slow
@pytest.mark.parametrize(("script", "models"), RUNS_OF)
def test_a_script_writes_the_published_results_only_with_update(script: Path, models: str, tmp_path: Path) -> None:
    """Run as printed, a script names only its new $OUT (under tmp here) for what it writes, and no file of the
    study's folder changes; with UPDATE=1 it names the study's folder (the published CSV, figures). With MODELS
    (where the script reads it) too: recall_state's partial run merges into a copy of the published rows."""
    study = script.parent
    env = {"OUT": str(tmp_path / "out")}
    if models:
        order = re.search(r'ORDER=\$\{MODELS:-([^}]*)\}|ORDER="([^"]+)"', script.read_text())
        assert order
        env["MODELS"] = (order.group(1) or order.group(2)).split()[0].strip('"')
    before = _published(study)
    proc, calls = _run(script, tmp_path, **env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert calls, "the script called no Python"
    assert not _written_into_study(calls, study), _written_into_study(calls, study)
    assert _published(study) == before
    assert any(_under(a.split("=", 1)[-1], tmp_path / "out") for call in calls for a in call)

    proc, calls = _run(script, tmp_path, UPDATE="1", **env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    publishes = bool(_written_into_study(calls, study))
    assert publishes == (script.relative_to(study.parent).as_posix() not in PUBLISH_NOTHING), calls


@pytest.mark.slow
@pytest.mark.parametrize(
    "env",
    [{"OUT": "experiments/heads/new"}, {"RUNS": "./experiments/x/../heads/runs"}, {"UPDATE": "yes"}],
    ids=["OUT", "RUNS", "UPDATE"],
)
def test_run_folders_and_results_under_experiments_are_refused(env: dict[str, str], tmp_path: Path) -> None:
    proc, calls = _run(REPO / "experiments/heads/run.sh", tmp_path, **env)
    assert proc.returncode == 2 and not calls
    assert proc.stderr.startswith("error: ") and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


@pytest.mark.slow
def test_the_default_out_is_a_new_folder_under_outputs_named_by_the_study_the_time_and_the_script(
    tmp_path: Path,
) -> None:
    script = tmp_path / "experiments" / "some_study" / "tuned.sh"  # (lib.sh reads the study from the script's folder)
    script.parent.mkdir(parents=True)
    script.write_text(f'source {shlex.quote(str(LIB))}\necho "$STUDY|$OUT|$RUNS|$RESULTS|$PUBLISHED"\n')
    probe = subprocess.run(
        ["bash", str(script)],
        cwd=tmp_path,
        env={**{k: v for k, v in os.environ.items() if k not in ("OUT", "RUNS", "UPDATE")}, "PY": ":"},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert probe.returncode == 0, probe.stderr
    study, out, runs, results, published = probe.stdout.strip().split("|")
    assert study == "some_study" and published == "experiments/some_study"
    assert re.fullmatch(r"outputs/some_study/\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d_tuned", out), out
    assert (runs, results) == (f"{out}/runs", out)
    assert not (REPO / out).exists()  # (PY=: makes nothing)
