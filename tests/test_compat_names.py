"""The old names (:mod:`attnlab.compat`, issue 60): every entry of the table reads, through its old path, the object
of its new path (or, where the call changed, compat's function that keeps the old signature, computing what the new
path computes), with a ``DeprecationWarning`` that names the replacement and the version it goes away in; the table
is complete (no module of attnlab re-exports a name from elsewhere but through it), and nothing of the repository
but this file reads an old name.

The scans of the code read the source with :mod:`ast` (the code is not run).
"""

from __future__ import annotations

import ast
import importlib
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import randn

from attnlab import compat, transition
from attnlab.compat import MOVED, Moved
from attnlab.transition import Transition

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "attnlab"
ENTRIES = {entry.old: entry for entry in MOVED}

# the files whose re-exports are not yet in the table: another change restructures them (issue 60; it moves their
# old names here as it goes). attnlab/attention.py and attnlab/config.py are done (their old names are in MOVED),
# and attnlab/backends/base.py and the other forms hand on nothing; attnlab/forms/softmax.py still lists
# expand_heads (attnlab.forms.base's) in its __all__, which nothing reads from there
RESERVED = ("attnlab/forms/softmax.py",)
# the modules that hand on names of another and are not in the table (yet): file → what they hand on, and why not
NOT_IN_THE_TABLE = {
    "attnlab/training/sweep.py": "the multirun's state and reports (attnlab.training.multirun), a split of the sweep",
    "attnlab/backends/normalized.py": "POOL, BufferPool, NormalizedAttention (attnlab.backends.rowwise), read here",
    "attnlab/encoder.py": "the positional encodings (attnlab.positions), beside the encoder that builds them",
    "attnlab/kernels/additive.py": "KernelBuildError (attnlab.kernels.build), the error its functions raise",
    "attnlab/module.py": "IGNORE_INDEX (attnlab.tasks.base), the label its loss ignores",
    "attnlab/training/config/resume.py": "the config readers of attnlab.runs that a resume compares with",
}


def read_old(entry: Moved) -> tuple[object, list[warnings.WarningMessage]]:
    """The object at the entry's old path, read as ``from old.module import name`` does, and the warnings it gave."""
    module = importlib.import_module(entry.module)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        value = getattr(module, entry.name)
    return value, caught


# ------------------------------------------------------------------------------------------------------ the table


def test_the_table_names_each_old_path_once_and_every_entry_goes_away_in_a_version():
    assert len(ENTRIES) == len(MOVED), "an old path is listed twice"
    changed = [entry.name for entry in MOVED if entry.change]
    assert len(changed) == len(set(changed)), "two old functions of the same name would share compat's function"
    for entry in MOVED:
        assert entry.old.startswith("attnlab.") and entry.new.startswith("attnlab."), entry
        assert entry.removed_in == compat.REMOVED_IN == "1.0", entry
        assert entry.old != entry.new, entry


@pytest.mark.parametrize("entry", MOVED, ids=lambda e: e.old)
def test_the_old_path_reads_the_new_object_with_a_deprecation_warning(entry):
    value, caught = read_old(entry)
    new = compat.resolve(entry.new)  # (the new path exists, and reads with no warning)
    if entry.change:
        assert value is getattr(compat, entry.name) and value is not new
    else:
        assert value is new
    mine = [w for w in caught if issubclass(w.category, DeprecationWarning) and entry.old in str(w.message)]
    assert len(mine) == 1, [str(w.message) for w in caught]
    assert entry.new in str(mine[0].message) and f"goes away in {entry.removed_in}" in str(mine[0].message)
    assert mine[0].filename == __file__  # (it points at the line that read the old name)


@pytest.mark.parametrize("entry", MOVED, ids=lambda e: e.old)
def test_from_the_old_module_import_the_old_name_works(entry):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scope: dict[str, object] = {}
        exec(f"from {entry.module} import {entry.name}", scope)
    assert scope[entry.name] is compat.resolve(entry.target)
    assert any(issubclass(w.category, DeprecationWarning) and entry.old in str(w.message) for w in caught)


def test_a_name_that_is_neither_old_nor_there_is_an_attribute_error():
    for module in sorted({entry.module for entry in MOVED}):
        with pytest.raises(AttributeError, match=f"module '{module}' has no attribute 'no_such_name'"):
            _ = importlib.import_module(module).no_such_name


def test_a_star_import_of_the_old_decay_module_brings_its_old_names():
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        scope: dict[str, object] = {}
        exec("from attnlab.recurrences import *", scope)
    assert {"GLA", "state_step", "chunked_form"} <= set(scope)
    assert scope["GLA"] is compat.resolve("attnlab.forms.transitions.GLA")


def test_the_old_modules_bind_none_of_their_old_names():
    """An old name comes from the table only: its old module neither defines nor imports it, nor lists it in
    ``__all__`` (attnlab.recurrences' ``__all__`` is read from the table), so it cannot stay importable silently."""
    for entry in MOVED:
        module = importlib.import_module(entry.module)
        assert entry.name not in vars(module), f"{entry.module} still binds {entry.name} (it must read from the table)"
        tree = parse(module_file(entry.module))
        assert entry.name not in static_all(tree), f"{entry.module}.__all__ lists the old name {entry.name}"


# ------------------------------------------------------------------------------- the old signatures, as they were


def test_the_old_decay_functions_compute_what_the_record_computes():
    B, H, L, D = 2, 3, 7, 4
    q, k, v = (randn(B, H, L, D, seed=s) for s in (1, 2, 3))
    la = torch.nn.functional.logsigmoid(randn(B, H, L, seed=4))
    beta = torch.sigmoid(randn(B, H, L, seed=5))
    k = torch.nn.functional.normalize(k, dim=-1)
    for log_alpha, b in ((None, None), (la, None), (None, beta), (la, beta)):
        record = Transition(log_alpha, b)
        torch.testing.assert_close(
            compat.recurrent_form(q, k, v, log_alpha, b), transition.recurrent(q, k, v, record), rtol=0, atol=0
        )
        torch.testing.assert_close(
            compat.chunked_form(q, k, v, log_alpha, b, chunk_size=3),
            transition.chunked(q, k, v, record, 3),
            rtol=0,
            atol=0,
        )
        torch.testing.assert_close(
            compat.effective_matrix(q, k, log_alpha, b), transition.effective_matrix(q, k, record), rtol=0, atol=0
        )
        at = record.at(0)
        o, state = compat.state_step(None, q[:, :, 0], k[:, :, 0], v[:, :, 0], at.log_decay, at.beta)
        o2, state2 = transition.step(None, q[:, :, 0], k[:, :, 0], v[:, :, 0], at)
        torch.testing.assert_close((o, state), (o2, state2), rtol=0, atol=0)


def positive_features(seed, length, f=3, d=2):
    phi_q = torch.rand(2, 2, length, f, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) + 0.1
    phi_k = torch.rand(2, 2, length, f, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64) + 0.1
    return phi_q, phi_k, randn(2, 2, length, d, seed=seed + 2)


def with_ones(v):
    return torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)


@pytest.mark.parametrize(("normalize", "eps"), [(True, 1e-6), (True, 0.5), (False, 0.0)])
def test_the_old_linear_functions_compute_what_the_record_with_a_column_of_ones_computes(normalize, eps):
    phi_q, phi_k, v = positive_features(20, 7)
    D = v.shape[-1]

    def divided(out):
        return out[..., :D] / (out[..., D:] + eps) if normalize else out[..., :D]

    expected = divided(transition.recurrent(phi_q, phi_k, with_ones(v)))
    got = compat.linear_attention_recurrent(phi_q, phi_k, v, normalize=normalize, eps=eps)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
    for chunk in (1, 3, 64):
        got = compat.linear_attention_chunked(phi_q, phi_k, v, chunk_size=chunk, normalize=normalize, eps=eps)
        torch.testing.assert_close(got, divided(transition.chunked(phi_q, phi_k, with_ones(v), None, chunk)))
    empty, no_v = torch.rand(1, 2, 0, 3, dtype=torch.float64), torch.rand(1, 2, 0, 4, dtype=torch.float64)
    assert compat.linear_attention_chunked(empty, empty, no_v).shape == (1, 2, 0, 4)  # (from test_linear_attention)
    state, new_state = None, None
    for t in range(7):
        out, state = compat.recurrent_step(state, phi_q[:, :, t], phi_k[:, :, t], v[:, :, t], normalize, eps)
        new, new_state = transition.step(new_state, phi_q[:, :, t], phi_k[:, :, t], with_ones(v)[:, :, t])
        torch.testing.assert_close(out, divided(new))
    S, z = state  # the old state (S, z) is the new [S z]
    torch.testing.assert_close(torch.cat([S, z.unsqueeze(-1)], dim=-1), new_state)


def test_make_task_is_build_task():
    """The old name builds a task as build_task does (the check of tests/test_tasks.py, moved here)."""
    with pytest.warns(DeprecationWarning, match="attnlab.tasks.make_task"):
        from attnlab.tasks import make_task
    from attnlab.tasks import ListOps, build_task

    assert make_task is build_task
    assert isinstance(make_task("listops", max_depth=2), ListOps)
    with pytest.raises(ValueError, match="unknown task 'nope'"):
        make_task("nope")


# ---------------------------------------------------------------------------------------------- the source scans


def parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def module_file(module: str) -> Path:
    base = REPO.joinpath(*module.split("."))
    return base / "__init__.py" if base.is_dir() else base.with_suffix(".py")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def static_all(tree: ast.Module) -> list[str]:
    """The names of a literal module-level ``__all__`` (none where it is not a literal list or tuple)."""
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            if isinstance(node.value, (ast.List, ast.Tuple)):
                return [e.value for e in node.value.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
    return []


def absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The module an ``from … import`` reads, relative imports resolved."""
    if not node.level:
        return node.module or ""
    package = module.split(".") if is_package else module.split(".")[:-1]
    base = ".".join(package[: len(package) - (node.level - 1)])
    return f"{base}.{node.module}" if node.module else base


def is_module(dotted: str) -> bool:
    base = REPO.joinpath(*dotted.split("."))
    return dotted.startswith("attnlab") and (base.is_dir() or base.with_suffix(".py").is_file())


def dotted(node: ast.expr) -> str | None:
    """``a.b.c`` of an attribute chain on a name, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


def wholly_old() -> set[str]:
    """The modules that are nothing but old names (their ``__all__`` is their old names): attnlab.recurrences."""
    modules = {entry.module for entry in MOVED}
    return {m for m in modules if getattr(importlib.import_module(m), "__all__", None) == compat.old_names(m)}


def old_reads(path: Path, source: str | None = None) -> Iterator[str]:
    """Where ``path`` (or ``source``, as if it were its text) reads an old name: ``from old.module import name``,
    ``old_module_alias.name`` (the module imported under any name), ``attnlab.old.module.name`` written out, and any
    import of a module that is nothing but old names."""
    module, is_package = module_name(path), path.name == "__init__.py"
    whole = wholly_old()
    tree = ast.parse(path.read_text(encoding="utf-8") if source is None else source, filename=str(path))
    aliases: dict[str, str] = {}  # a local name → the attnlab module it stands for
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            source = absolute(node, module, is_package)
            for alias in node.names:
                if f"{source}.{alias.name}" in ENTRIES or source in whole:
                    yield f"{path.relative_to(REPO)}:{node.lineno}: from {source} import {alias.name}"
                elif is_module(f"{source}.{alias.name}"):
                    aliases[alias.asname or alias.name] = f"{source}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in whole:
                    yield f"{path.relative_to(REPO)}:{node.lineno}: import {alias.name}"
                elif alias.asname:
                    aliases[alias.asname] = alias.name
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            chain = dotted(node)
            if chain is None:
                continue
            head, _, rest = chain.partition(".")
            full = f"{aliases[head]}.{rest}" if head in aliases else chain
            if full in ENTRIES:
                yield f"{path.relative_to(REPO)}:{node.lineno}: {chain}"


def repository_files() -> Iterator[Path]:
    """The Python of the repository that must use the new names: attnlab (but compat, which lists the old ones, and
    the old modules' one line of forwarding), the experiments, the scripts and the tests (but this file)."""
    for folder in ("attnlab", "experiments", "scripts", "tests", "hydra_plugins"):
        for path in sorted((REPO / folder).rglob("*.py")):
            if "__pycache__" in path.parts or path in (PACKAGE / "compat.py", Path(__file__).resolve()):
                continue
            yield path
    yield REPO / "train.py"


def test_no_code_of_the_repository_reads_an_old_name():
    found = [line for path in repository_files() for line in old_reads(path)]
    assert not found, "old names read (use the new path of attnlab.compat.MOVED):\n" + "\n".join(found)


def test_the_scan_finds_each_way_of_reading_an_old_name():
    source = (
        "import attnlab.backends.linear as linear_backends\n"
        "import attnlab.scores\n"
        "from attnlab.dashboard import stats as stats_module\n"
        "from attnlab.recurrences import retnet_decays\n"
        "import attnlab.recurrences\n"
        "from ..scores import T5Bias\n"  # (relative, from attnlab/backends/)
        "linear_backends.recurrent_step\n"
        "attnlab.scores.alibi_slopes(4)\n"
        "stats_module.mean_ci\n"
        "stats_module.aggregate\n"  # (not old)
        "from attnlab.position_bias import alibi_slopes\n"  # (new)
        "from attnlab.transition import step\n"  # (new)
    )
    found = [line.split(": ", 1)[1] for line in old_reads(PACKAGE / "backends" / "_example.py", source)]
    assert sorted(found) == sorted(
        [
            "from attnlab.recurrences import retnet_decays",
            "import attnlab.recurrences",
            "from attnlab.scores import T5Bias",
            "linear_backends.recurrent_step",
            "attnlab.scores.alibi_slopes",
            "stats_module.mean_ci",
        ]
    )


def re_exports(path: Path, source: str | None = None) -> Iterator[str]:
    """The names a module (or ``source``, as if it were its text) takes from another attnlab module and hands on:
    listed in its ``__all__``, or imported with ``# noqa: F401`` (kept for others to read)."""
    module, is_package = module_name(path), path.name == "__init__.py"
    text = path.read_text(encoding="utf-8") if source is None else source
    tree = ast.parse(text, filename=str(path))
    listed = set(static_all(tree))
    lines = text.splitlines()
    for node in tree.body:
        if not isinstance(node, ast.ImportFrom):
            continue
        source = absolute(node, module, is_package)
        if not source.startswith("attnlab"):
            continue
        unused = "noqa: F401" in " ".join(lines[node.lineno - 1 : node.end_lineno])
        for alias in node.names:
            name = alias.asname or alias.name
            if (name in listed or unused) and not is_module(f"{source}.{alias.name}"):
                yield f"{path.relative_to(REPO)}:{node.lineno}: {name} from {source}"


def test_the_table_is_complete():
    """No module of attnlab but compat hands on a name from another module (its ``__all__`` or a ``noqa: F401``
    import), but the faces of packages (``__init__.py``), the files another change restructures (:data:`RESERVED`)
    and those listed in :data:`NOT_IN_THE_TABLE`: a name moved elsewhere reads from its old path through
    attnlab.compat's table only."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(REPO).as_posix()
        if path.name == "__init__.py" or relative == "attnlab/compat.py" or relative in NOT_IN_THE_TABLE:
            continue
        if relative.startswith(RESERVED):
            continue
        found += re_exports(path)
    assert not found, "re-exports outside attnlab.compat's table (add them to MOVED):\n" + "\n".join(found)


def test_the_re_export_scan_finds_a_listed_or_kept_import():
    source = (
        "from attnlab.position_bias import alibi_slopes\n"
        "from attnlab.stats import finite  # noqa: F401\n"
        "from attnlab.stats import mean_ci\n"  # (used here, not handed on)
        "from attnlab import stats\n"  # (a module)
        "__all__ = ['alibi_slopes', 'stats', 'f']\n"
    )
    found = [line.split(": ", 1)[1] for line in re_exports(PACKAGE / "_example.py", source)]
    assert found == ["alibi_slopes from attnlab.position_bias", "finite from attnlab.stats"]


def test_compat_imports_nothing_of_attnlab_when_imported():
    tree = parse(PACKAGE / "compat.py")
    top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    names = [n.module or "" for n in top if isinstance(n, ast.ImportFrom)] + [
        a.name for n in top if isinstance(n, ast.Import) for a in n.names
    ]
    assert not [name for name in names if name.startswith("attnlab")], names
