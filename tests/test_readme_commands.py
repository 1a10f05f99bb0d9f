"""The commands of README.md's and docs/getting-started.md's shell blocks work as printed (issue 61).

Every ```bash, ```sh, ```shell or ```console block of those pages is read as bash reads it: a line continued with a
backslash is joined to the next, words are split and quoted as the shell does (:mod:`shlex`), a comment after ``#``
is dropped, and leading ``NAME=value`` words are the command's environment (a console block's ``$ `` prompt is taken
off, and its lines without one are output). ``python`` is the set-up's environment's (README: "Set-up"). Each
command is then checked by its kind, as cheaply as tells whether it works:

* ``python train.py ...`` runs as printed with ``--dry-run`` appended (where it has none): the planner composes every
  job of the run or sweep, checks it as the run would, builds its model and trains a step of each distinct model,
  and exits 0 only when the plan is valid; here no job of it may be refused either. It runs in this process
  (:func:`helpers.run_cli`: :func:`attnlab.training.cli.main`), with one timed step a model instead of three, no
  FLOP count, and the step-time cache in a folder of this module (so that a busy test machine's timings do not
  become the user's estimates). A command whose comment says it fails on purpose (``# refused ...``) must exit 2.
  A single run's plan takes about a second; a sweep's (``-m``) times several models, 3-7 s, and is marked slow.
  With ``PYTHONPATH=.`` and ``imports=[my_x]``, the modules are the page's ```python blocks that begin with
  ``# my_x.py`` (and ``# my_x.py (continued)``), written into a folder where those commands run in one subprocess
  (slow), so that what they register does not stay in this process.
* ``python -m attnlab.<module> ...``: ``attnlab.card`` with ``--dry-run`` appended, which checks its options and
  every task and variant it names, and then the plan of its first task's sweep (every job composed, checked and
  built, as for ``train.py``; the other tasks' sweeps differ in the task alone, and planning all six takes half a
  minute); ``attnlab.bench`` through its own parser (:func:`attnlab.bench.cli.parse_args`: the options and the
  ``--only`` sections; the bench itself takes minutes); ``attnlab.dashboard`` through its argument parser (it reads
  the run folders of the sweep before it, which a dry run does not write); ``attnlab.compare`` as printed (it lists
  or describes named models: exit 0); ``attnlab.check_device`` through its parser (``--device cuda`` is a check
  for the GPU's machine). Any other module fails here until a rule for it is added.
* ``make TARGET [VAR=value]``: the Makefile has the target; ``make -n`` prints its commands (slow).
* ``source FILE``: the set-up's activate script (``$(VENV)/bin/activate`` of the Makefile); and (slow) a bash
  without any Python of its own on PATH sources it and runs the README's first single ``python train.py`` command as
  printed (with ``--dry-run``).
* ``bash SCRIPT``: the script exists; ``bash -n`` reads it (slow). Scripts are checked by
  tests/test_experiments.py and tests/test_experiments_scripts.py.
* ``pip install ...``: every ``.[extra]`` it names is an extra of pyproject.toml.
* ``srun [options] COMMAND``: COMMAND by its rule (the cluster's options are not checked here).
* Anything else fails the test: a new kind of command needs its rule here.

A command that cannot be checked on this machine (it needs CUDA or SLURM) would be listed in :data:`EXPECTED_SKIP`
with the reason; none is today.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from helpers import run_cli

REPO = Path(__file__).resolve().parents[1]
PAGES = ("README.md", *sorted(str(p.relative_to(REPO)) for p in (REPO / "docs").glob("*.md")))
# commands that cannot be checked here, and why (the text after `python`, as printed): none today. A command that
# needs a GPU or a SLURM cluster goes here only until its `--dry-run` plans it on a CPU machine.
EXPECTED_SKIP: dict[str, str] = {}
MODULE_RULES = ("attnlab.card", "attnlab.bench", "attnlab.dashboard", "attnlab.compare", "attnlab.check_device")
_BLOCK = re.compile(r"^```(bash|sh|shell|console)[ \t]*\n(.*?)^```", re.S | re.M)
_ASSIGNMENT = re.compile(r"[A-Za-z_]\w*=")


@dataclass
class Command:
    """One command of a page's shell block."""

    where: str  # page:line
    text: str  # as printed, without its comment
    words: list[str]
    env: dict[str, str] = field(default_factory=dict)
    comment: str = ""

    @property
    def kind(self) -> str:
        w = self.words
        if w[:2] == ["python", "train.py"]:
            return "train"
        if w[:2] == ["python", "-m"] and len(w) > 2:
            return "module"
        return w[0] if w[0] in ("make", "source", "bash", "pip") else "other"

    @property
    def expected_code(self) -> int:
        """0, or 2 for a command its comment says is refused."""
        return 2 if re.match(r"\s*refused\b", self.comment) else 0

    def __str__(self) -> str:
        return f"{self.where}: {self.text}"


def commands(text: str, page: str = "page") -> list[Command]:
    """The commands of ``text``'s shell blocks (module docstring)."""
    found = []
    for match in _BLOCK.finditer(text):
        console = match.group(1) == "console"
        first = text.count("\n", 0, match.start(2)) + 1
        lines = match.group(2).splitlines()
        i = 0
        while i < len(lines):
            start, line = i, lines[i]
            while line.endswith("\\") and i + 1 < len(lines):
                i += 1
                line = line[:-1] + " " + lines[i].lstrip()
            i += 1
            if console:
                if not line.startswith("$ "):
                    continue
                line = line[2:]
            code, comment = split_comment(line)
            words = shlex.split(code)
            env = {}
            while words and _ASSIGNMENT.match(words[0]):
                key, _, value = words.pop(0).partition("=")
                env[key] = value
            if words and words[0] == "srun":  # a SLURM wrapper: the command it runs, by that command's rule
                words = words[1:]
                while words and words[0].startswith("-"):
                    words.pop(0)
            if words:
                found.append(Command(f"{page}:{first + start}", code.strip(), words, env, comment))
    return found


def split_comment(line: str) -> tuple[str, str]:
    """``line`` without its comment, and the comment: from a ``#`` that starts a word (at the line's start or after
    a blank), outside quotes and not escaped, as bash reads it."""
    quote, escaped = None, False
    for k, ch in enumerate(line):
        if escaped:
            escaped = False
        elif ch == "\\" and quote != "'":
            escaped = True
        elif quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (k == 0 or line[k - 1].isspace()):
            return line[:k], line[k + 1 :].strip()
    return line, ""


def page_commands(page: str) -> list[Command]:
    return commands((REPO / page).read_text(), page)


ALL = [c for page in PAGES for c in page_commands(page)]


def _unique(kind: str, pred=lambda c: True) -> list:
    """One pytest param per distinct command of ``kind`` (the same command on several lines runs once)."""
    seen: dict[tuple, list[Command]] = {}
    for c in ALL:
        if c.kind == kind and pred(c):
            words = [w for w in c.words if w != "--dry-run"] if kind == "train" else c.words  # (planned alike)
            seen.setdefault((tuple(words), tuple(sorted(c.env.items()))), []).append(c)
    # (a sweep's plan times several models: 3-7 s, slow by docs/tests.md's measure; a single run's takes about 1 s)
    return [
        pytest.param(cs[0], id=f"{cs[0].where} {cs[0].text}"[:150], marks=_sweep_marks(cs[0])) for cs in seen.values()
    ]


def _sweep_marks(c: Command) -> list:
    return [pytest.mark.slow] if c.kind == "train" and ("-m" in c.words or "--multirun" in c.words) else []


def _imports(c: Command) -> bool:
    return any(w.startswith("imports=") for w in c.words)


# --------------------------------------------------------------------------------------------- the checks


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The step-time cache of this module's dry runs (``ATTNLAB_CACHE_DIR``)."""
    return tmp_path_factory.mktemp("step_times")


@pytest.fixture
def quick_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    """A dry run that trains one timed step a model (after its warm-up step) and counts no FLOPs."""
    from attnlab.training import plan

    timed = plan.step_time
    monkeypatch.setattr(plan, "step_time", lambda module, batch, length, steps=1: timed(module, batch, length, 1))
    monkeypatch.setattr(plan, "_flops", lambda module, datamodule: None)


def dry_run(c: Command, cache: Path, cwd: Path = REPO) -> str | None:
    """``c`` (``python train.py ...``) with ``--dry-run``, in this process: None when it does what its page says
    (exit 0 with every job valid, or exit 2 for a refused one), else why not."""
    args = c.words[2:] + ([] if "--dry-run" in c.words else ["--dry-run"])
    proc = run_cli(*args, cwd=cwd, ATTNLAB_CACHE_DIR=str(cache), **c.env)
    refused = [line for line in proc.stdout.splitlines() if "would be refused" in line]
    if proc.returncode == c.expected_code and (c.expected_code or not refused):
        return None
    return (
        f"{c}: `python train.py {' '.join(args)}` exited {proc.returncode} (the page means {c.expected_code})\n"
        + "\n".join(refused)
        + f"\n{proc.stdout[-1500:]}\n{proc.stderr[-2500:]}"
    )


def check_module(c: Command, card_dry_run: bool = False, cache: Path | None = None) -> str | None:
    """``python -m attnlab.<module> ...`` by the module's rule (module docstring); None when it passes."""
    module, args = c.words[2], c.words[3:]
    if module == "attnlab.bench":
        from attnlab.bench.cli import parse_args

        try:
            parse_args(args)
        except SystemExit as exc:
            return f"{c}: attnlab.bench's parser refuses {args} (exit {exc.code})"
        return None
    if module == "attnlab.dashboard":
        import argparse

        from attnlab.dashboard import cli

        class _Parsed(Exception):
            pass

        def stop(parser, argv=None, namespace=None):
            argparse.ArgumentParser.parse_known_args = original
            _, extra = original(parser, argv, namespace)
            if extra:
                parser.error(f"unrecognized arguments: {' '.join(extra)}")
            raise _Parsed

        original = argparse.ArgumentParser.parse_known_args
        argparse.ArgumentParser.parse_known_args = stop
        try:
            cli.main(args)
        except _Parsed:
            return None
        except SystemExit as exc:
            return f"{c}: attnlab.dashboard's parser refuses {args} (exit {exc.code})"
        finally:
            argparse.ArgumentParser.parse_known_args = original
        return f"{c}: attnlab.dashboard ran without parsing its arguments"
    if module == "attnlab.card":
        from attnlab import card

        planned: list[list[str]] = []

        def first_task_only(tasks, commands) -> int:  # (the card's own checks of every name have passed)
            planned.extend(commands)
            return 0

        original, card._dry_run = card._dry_run, first_task_only
        try:
            code = card.main([*args, "--dry-run"])
        except SystemExit as exc:
            code = exc.code
        finally:
            card._dry_run = original
        if code != 0 or not planned:
            return f"{c}: `python -m attnlab.card {' '.join(args)} --dry-run` exited {code}"
        if not card_dry_run:
            return None
        first = planned[0]
        sweep = Command(c.where, c.text, ["python", "train.py", *first[first.index("-m") :]])
        return dry_run(sweep, cache)
    if module == "attnlab.compare":  # (it lists or describes: cheap, run as printed)
        from attnlab.training.compare import main as listing

        code = listing(args)
        return None if code == 0 else f"{c}: `python -m attnlab.compare {' '.join(args)}` exited {code}"
    if module == "attnlab.check_device":  # (its parser; --device cuda is a check for the GPU's machine)
        from attnlab import check_device

        try:
            check_device.parse_args(args)
        except SystemExit as exc:
            return f"{c}: attnlab.check_device's parser refuses {args} (exit {exc.code})"
        except check_device.UsageError as exc:  # parsed; what it needs is on the cluster (a GPU, the user's module)
            if "no CUDA device here" not in str(exc) and "--imports" not in c.text:
                return f"{c}: attnlab.check_device refuses it: {exc}"
        return None
    return f"{c}: no rule checks `python -m {module}` (tests/test_readme_commands.py: add one)"


def _make_targets() -> set[str]:
    return set(re.findall(r"^([\w.-]+):", (REPO / "Makefile").read_text(), re.M))


def _venv() -> str:
    match = re.search(r"^VENV\s*\?=\s*(\S+)", (REPO / "Makefile").read_text(), re.M)
    assert match, "the Makefile names no VENV"
    return match.group(1)


def check_static(c: Command) -> str | None:
    """The checks of ``make``, ``source``, ``bash`` and ``pip`` lines that start nothing; None when they pass."""
    w = c.words
    if c.kind == "make":
        targets = [a for a in w[1:] if "=" not in a and not a.startswith("-")]
        missing = [t for t in targets or ["(default)"] if t not in _make_targets()]
        return f"{c}: the Makefile has no target {missing}" if missing else None
    if c.kind == "source":
        if len(w) != 2 or w[1] != f"{_venv()}/bin/activate":
            return f"{c}: only the set-up's environment is sourced ({_venv()}/bin/activate)"
        here = REPO / w[1]
        if Path(sys.prefix).resolve() == (REPO / _venv()).resolve() and not here.is_file():
            return f"{c}: {here} does not exist"
        return None
    if c.kind == "bash":
        script = next((a for a in w[1:] if not a.startswith("-")), None)
        if script is None or not (REPO / script).is_file():
            return f"{c}: no script {script}"
        return None
    if c.kind == "pip":
        section = (REPO / "pyproject.toml").read_text().split("[project.optional-dependencies]", 1)[1]
        extras = set(re.findall(r"^([\w-]+) = \[", section.split("\n[", 1)[0], re.M))
        named = {e for a in w for m in re.findall(r"\.\[([\w,-]+)\]", a) for e in m.split(",")}
        return f"{c}: pyproject.toml has no extra {sorted(named - extras)}" if named - extras else None
    return f"{c}: no rule checks this kind of command ({w[0]}; tests/test_readme_commands.py: add one)"


# --------------------------------------------------------------------------------------------- the tests


def test_the_pages_commands_are_found_and_each_kind_has_a_rule() -> None:
    readme = page_commands("README.md")
    kinds = {c.kind for c in readme}
    assert {"train", "module", "make", "source", "bash"} <= kinds
    assert sum(c.kind == "train" for c in readme) >= 25
    assert sum(c.kind == "train" for c in page_commands("docs/getting-started.md")) >= 5
    assert not [str(c) for c in ALL if c.kind == "other"]
    assert not [str(c) for c in ALL if c.kind == "module" and c.words[2] not in MODULE_RULES]
    assert set(EXPECTED_SKIP) <= {c.text.removeprefix("python ") for c in ALL}


def test_the_set_up_activates_the_environment_so_python_is_its_python() -> None:
    """The set-up block ends with the activation: every later ``python`` is the environment's, as printed."""
    setup = re.search(r"<!-- --8<-- \[start:setup\] -->(.*?)<!-- --8<-- \[end:setup\] -->", _readme(), re.S)
    assert setup
    block = commands(setup.group(1), "README.md")
    assert [c.words[:2] for c in block if c.kind == "source"] == [["source", f"{_venv()}/bin/activate"]]
    assert [c for c in block if c.kind == "make"], "the set-up makes the environment"


def _readme() -> str:
    return (REPO / "README.md").read_text()


def test_parsing_follows_bash() -> None:
    text = (
        "```bash\n"
        "python train.py 'model.layers=[{mask: {name: a}}, {}]' d_k=8   # a comment # and more\n"
        "PYTHONPATH=. python train.py \\\n    imports=[m] variant=x\n"
        "# only a comment\n"
        "```\n"
        "```console\n$ make test ARGS=\"-m 'not slow'\"\noutput line\n```\n"
        "```python\npython train.py never=read\n```\n"
    )
    a, b, c = commands(text)
    assert a.words == ["python", "train.py", "model.layers=[{mask: {name: a}}, {}]", "d_k=8"]
    assert a.comment == "a comment # and more" and a.where == "page:2"
    assert (b.env, b.words, b.where) == (
        {"PYTHONPATH": "."},
        ["python", "train.py", "imports=[m]", "variant=x"],
        "page:3",
    )
    assert c.words == ["make", "test", "ARGS=-m 'not slow'"] and c.kind == "make"


@pytest.mark.usefixtures("quick_plan")
def test_a_broken_readme_command_fails_the_check(cache_dir: Path) -> None:
    """The checks are not vacuous: the README with a misspelt key, choice, target, script or section fails them, and
    a command documented as refused must be refused."""
    text = _readme()
    plants = {
        "python train.py variant=additive debug=fast": "python train.py variant=additive debug=fast d_kk=8",
        "python train.py variant=gla variant.params.gate=channel": "python train.py variant=glaa",
        "python -m attnlab.bench --only decode": "python -m attnlab.bench --only decod",
        "python -m attnlab.dashboard outputs/": "python -m attnlab.dashboard outputs/ --cvs x.csv",
        "make lint": "make lnt",
        "bash experiments/pruning/run.sh": "bash experiments/prunning/run.sh",
    }
    for good, bad in plants.items():
        text, n = re.subn(rf"^{re.escape(good)}(?=\s)", bad, text, count=1, flags=re.M)
        assert n == 1, good
    planted = {c.text: c for c in commands(text, "README.md")}
    for bad in plants.values():
        c = planted[bad]
        problem = (
            dry_run(c, cache_dir) if c.kind == "train" else check_module(c) if c.kind == "module" else check_static(c)
        )
        assert problem, f"the planted command passed: {bad}"
    (refused,) = commands("```bash\npython train.py variant=additive attention.backend=sdpa   # refused: dot only\n```")
    assert refused.expected_code == 2 and dry_run(refused, cache_dir) is None
    (wrong,) = commands("```bash\npython train.py variant=additive   # refused, it says, but is not\n```")
    assert dry_run(wrong, cache_dir) is not None


@pytest.mark.usefixtures("quick_plan")
@pytest.mark.parametrize("c", _unique("train", lambda c: not _imports(c)))
def test_a_train_command_plans_as_printed(c: Command, cache_dir: Path) -> None:
    if c.text.removeprefix("python ") in EXPECTED_SKIP:
        pytest.skip(EXPECTED_SKIP[c.text.removeprefix("python ")])
    problem = dry_run(c, cache_dir)
    assert problem is None, problem


@pytest.mark.parametrize("c", _unique("module"))
def test_a_module_command_passes_its_rule(c: Command) -> None:
    problem = check_module(c)
    assert problem is None, problem


@pytest.mark.parametrize("c", _unique("module", lambda c: c.words[2] == "attnlab.card"))
def test_a_card_command_plans_as_printed(c: Command, cache_dir: Path, quick_plan: None) -> None:
    problem = check_module(c, card_dry_run=True, cache=cache_dir)
    assert problem is None, problem


@pytest.mark.parametrize("c", _unique("make") + _unique("source") + _unique("bash") + _unique("pip"))
def test_a_make_source_bash_or_pip_command_names_what_exists(c: Command) -> None:
    problem = check_static(c)
    assert problem is None, problem


@pytest.mark.slow
@pytest.mark.parametrize("c", _unique("make"))
def test_make_dry_runs_a_make_command(c: Command) -> None:
    proc = subprocess.run(["make", "-n", *c.words[1:]], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("c", _unique("bash"))
def test_bash_reads_a_script_command(c: Command) -> None:
    proc = subprocess.run(["bash", "-n", *c.words[1:]], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.slow
def test_after_the_activation_python_train_py_works_as_printed(cache_dir: Path) -> None:
    """The user's report: a fresh shell's ``python train.py`` (no torch). After the set-up block's ``source``, the
    README's first single ``python train.py`` command runs as printed, in a bash whose PATH has no Python of the
    project's (only the system's directories)."""
    activate = REPO / _venv() / "bin" / "activate"
    if not activate.is_file():
        pytest.skip(f"no {activate}: the set-up has not run here")
    first = next(c for c in page_commands("README.md") if c.kind == "train" and "-m" not in c.words)
    line = f"source {_venv()}/bin/activate && {shlex.join(first.words)} --dry-run"
    env = {
        "PATH": "/usr/bin:/bin",
        "HOME": os.environ.get("HOME", "/tmp"),
        "ATTNLAB_CACHE_DIR": str(cache_dir),
        "OMP_NUM_THREADS": "1",
        "WANDB_MODE": "offline",
    }
    proc = subprocess.run(
        ["bash", "--noprofile", "--norc", "-c", line], cwd=REPO, env=env, capture_output=True, text=True, timeout=180
    )
    assert proc.returncode == 0, f"{line}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    assert proc.stdout.startswith("dry run: python train.py"), proc.stdout[:500]


# the driver of the commands with imports=[...]: each in one interpreter, as run_cli runs them (helpers)
_DRIVER = """
import json, sys
sys.path.insert(0, sys.argv[1])
from helpers import run_cli
from attnlab.training import plan
timed = plan.step_time
plan.step_time = lambda module, batch, length, steps=1: timed(module, batch, length, 1)
plan._flops = lambda module, datamodule: None
out = []
for args in json.loads(sys.argv[2]):
    proc = run_cli(*args, cwd=sys.argv[3], PYTHONPATH=".")
    refused = [line for line in proc.stdout.splitlines() if "would be refused" in line]
    out.append([proc.returncode, refused, proc.stdout[-1500:] + proc.stderr[-2500:]])
print("RESULTS " + json.dumps(out))
"""


def user_modules(text: str) -> dict[str, str]:
    """The page's ```python blocks that begin with ``# my_x.py`` (or ``# my_x.py (continued)``): file name → code."""
    files: dict[str, str] = {}
    for block in re.findall(r"```python\n(.*?)```", text, re.S):
        match = re.match(r"# (\w+\.py)( \(continued\))?\n", block)
        if match:
            files[match.group(1)] = files.get(match.group(1), "") + "\n" + block
    return files


@pytest.mark.slow
@pytest.mark.parametrize("page", [p for p in PAGES if any(c.kind == "train" and _imports(c) for c in page_commands(p))])
def test_the_commands_with_the_pages_own_modules_plan_as_printed(page: str, tmp_path: Path, cache_dir: Path) -> None:
    """``PYTHONPATH=. python train.py 'imports=[my_x]' ...``: in a folder holding the page's ``my_x.py`` files (and
    the README's, which a page may refer to), each plans (one subprocess for them all)."""
    cmds = [c for c in page_commands(page) if c.kind == "train" and _imports(c)]
    own = user_modules((REPO / page).read_text())
    readme = user_modules((REPO / "README.md").read_text())  # (a page may run the README's example: my_tasks.py)
    for name, code in {**readme, **own}.items():
        (tmp_path / name).write_text(code)
    for c in cmds:
        needed = re.search(r"imports=\[([^\]]*)\]", " ".join(c.words)).group(1).split(",")
        assert all((tmp_path / f"{m.strip()}.py").is_file() for m in needed), (str(c), needed)
        assert c.env == {"PYTHONPATH": "."}, str(c)
    argvs = [c.words[2:] + ([] if "--dry-run" in c.words else ["--dry-run"]) for c in cmds]
    env = {**os.environ, "ATTNLAB_CACHE_DIR": str(cache_dir), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", _DRIVER, str(REPO / "tests"), json.dumps(argvs), str(tmp_path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.split("RESULTS ", 1)[1])
    for c, (code, refused, tail) in zip(cmds, results, strict=True):
        assert code == c.expected_code and not refused, f"{c}: exit {code}\n{refused}\n{tail}"
