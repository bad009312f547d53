"""The layers of ARCHITECTURE.md, checked on the source: imports run downward only, and no module
imports itself back through others (every import counts: module level, inside functions, TYPE_CHECKING).

A failure names the importing module and what it imported, so the fix is to move the shared piece down
(ciuic_doctor/measures/, jobs/options.py, report/blocks.py are the examples), not to hide the import.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# area -> areas it must never import (an area is the first name under ciuic_doctor, or probes)
FORBIDDEN = {
    "probes": {"cli", "commands", "checkup", "report", "compare", "recommend", "analysis", "importers"},
    "jobs": {"cli", "commands", "checkup", "report", "compare", "recommend", "analysis"},
    "analysis": {"cli", "commands", "checkup", "report", "compare", "recommend", "probes", "jobs"},
    "importers": {"cli", "commands", "checkup", "report", "compare", "recommend", "analysis", "probes"},
    "compare": {"cli", "commands", "checkup", "report", "probes", "verify"},
    "recommend": {"cli", "commands", "checkup", "report", "probes", "verify"},
    "report": {"cli", "commands", "checkup", "probes", "verify"},
    "verify": {"cli", "commands", "checkup"},  # re-runs the job; the report only reads its file
    # the live view (top, export) reads /proc and run directories and judges with analysis' rules
    "live": {"cli", "commands", "checkup", "report", "probes", "jobs"},
    "measures": {
        "cli",
        "commands",
        "checkup",
        "report",
        "compare",
        "recommend",
        "analysis",
        "probes",
        "jobs",
    },
}
FORBIDDEN["mfu"] = FORBIDDEN["measures"]  # FLOPs and peaks: pure arithmetic on the floor
# the run directory (every file format) and the machine's facts are the floor too: everything reads runs
# through them, so they import nothing above them
FORBIDDEN["rundir"] = FORBIDDEN["measures"] | {"importers", "live", "verify", "mfu"}
FORBIDDEN["machine"] = FORBIDDEN["rundir"] | {"rundir"}
# running blocks on every core or a Dask cluster: below everything that has blocks to run
FORBIDDEN["parallel"] = FORBIDDEN["rundir"] | {"rundir", "machine", "cluster"}
# the scheduler (Slurm): allocations, nodes, job steps; the run directory names records by its node
FORBIDDEN["cluster"] = FORBIDDEN["machine"] | {"machine", "launch"}
# checkup runs phases; it names them itself and never reaches up into the sub-commands
FORBIDDEN["checkup"] = {"cli", "commands"}


def _modules() -> dict[str, Path]:
    found = {}
    for base, prefix in ((ROOT / "ciuic_doctor", "ciuic_doctor"), (ROOT / "probes", "ciuic_doctor.probes")):
        for path in base.rglob("*.py"):
            parts = [p for p in path.relative_to(base).with_suffix("").parts if p != "__init__"]
            found[".".join([prefix, *parts])] = path
    return found


MODULES = _modules()


def _imports(path: Path) -> set[str]:
    """Every project module `path` imports, resolved to the deepest module that exists."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            candidates = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            candidates = [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        for candidate in candidates:
            name = candidate
            while name and name not in MODULES:
                name = name.rpartition(".")[0]
            if name.startswith("ciuic_doctor"):
                names.add(name)
    return names


GRAPH = {name: _imports(path) - {name} for name, path in MODULES.items()}


def area(module: str) -> str:
    """`ciuic_doctor.probes.watch.hooks` -> probes; `ciuic_doctor.analysis.memory` -> analysis."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_the_source_tree_is_found():
    assert "ciuic_doctor.probes.watch.session" in MODULES
    assert "ciuic_doctor.analysis.memory" in MODULES
    assert "ciuic_doctor.rundir.store" in GRAPH["ciuic_doctor.analysis.memory"] | {
        m for dep in GRAPH["ciuic_doctor.analysis.memory"] for m in GRAPH[dep]
    }


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_imports_run_downward(layer):
    upward = sorted(
        f"{module} imports {target}"
        for module, targets in GRAPH.items()
        if area(module) == layer
        for target in targets
        if area(target) in FORBIDDEN[layer]
    )
    assert not upward, "\n".join(upward)


def test_no_import_cycles():
    """Tarjan's strongly connected components over the whole graph: each of more than one module is a
    circle (the last wave had seven, e.g. jobs/train -> commands/job -> jobs/train)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in GRAPH[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in GRAPH:
        if node not in index:
            visit(node)
    assert not cycles, "\n".join(" <-> ".join(c) for c in cycles)


def test_no_module_over_500_lines():
    """GUIDE: one probe or analysis a module, ~200-300 lines; split before 500."""
    long = {
        str(p.relative_to(ROOT)): n for p in MODULES.values() if (n := len(p.read_text().splitlines())) > 500
    }
    assert not long, long


def test_every_probe_package_says_what_it_measures_and_writes():
    probes = ROOT / "probes"
    assert sorted(p.name for p in probes.glob("*.py")) == ["__init__.py"]
    for package in sorted(p for p in probes.iterdir() if (p / "__init__.py").exists()):
        doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
        assert "Writes" in doc or "writes" in doc, f"{package.name}/__init__.py: say what it writes"


MAX_MODULES_PER_FOLDER = 20  # commands/ (one module per sub-command) holds 18
FAMILY = 3  # three modules sharing a name prefix are a package


def _folders() -> list[Path]:
    return sorted({p.parent for base in ("ciuic_doctor", "probes") for p in (ROOT / base).rglob("*.py")})


def test_no_folder_over_twenty_modules():
    """torchtitan's rule of thumb: a concern gets a folder once it has three files; a folder past ~20 is
    split by concern."""
    crowded = {
        str(folder.relative_to(ROOT)): n
        for folder in _folders()
        if (n := len([p for p in folder.glob("*.py") if p.name != "__init__.py"])) > MAX_MODULES_PER_FOLDER
    }
    assert not crowded, crowded


def prefix_families(names: list[str]) -> dict[str, list[str]]:
    """Module names grouped by the word before their first underscore (a leading one ignored).

    >>> prefix_families(["hang", "hang_last", "hang_poll", "hooks"])
    {'hang': ['hang', 'hang_last', 'hang_poll']}
    """
    groups: dict[str, list[str]] = {}
    for name in sorted(names):
        groups.setdefault(name.lstrip("_").split("_")[0], []).append(name)
    return {prefix: members for prefix, members in groups.items() if len(members) >= FAMILY}


def test_prefix_families_are_packages():
    families = {
        str(folder.relative_to(ROOT)): found
        for folder in _folders()
        if (found := prefix_families([p.stem for p in folder.glob("*.py") if p.name != "__init__.py"]))
    }
    assert not families, families


def test_prefix_families_are_found():
    """The rule above can fail: the families the flat analysis/ had are caught."""
    flat = ["memory", "_memory_data", "_memory_leaks", "stability", "_stability_curve", "steps", "_desync"]
    assert prefix_families(flat) == {"memory": ["_memory_data", "_memory_leaks", "memory"]}


def test_analysis_is_one_package_per_analysis():
    """analysis/ holds packages; the only loose modules are its front and what is not a family."""
    from ciuic_doctor.analysis import analysis_modules

    analyses = {m.__name__.rsplit(".", 1)[-1] for m in analysis_modules()}
    expected = {"checkpoint", "comm", "hang", "loader", "memory", "moe", "stability", "steps", "throughput"}
    assert analyses == expected
    loose = sorted(p.name for p in (ROOT / "ciuic_doctor" / "analysis").glob("*.py"))
    assert loose == ["__init__.py", "run_end.py"]
    assert len(list((ROOT / "ciuic_doctor").glob("*.py"))) <= 10


def test_declared_packages_match_the_tree():
    """pyproject.toml lists every package (a wheel built from it must hold verify/, rundir/, ...)."""
    import tomllib

    declared = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    on_disk = {
        ".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "ciuic_doctor").rglob("__init__.py")
    }
    on_disk |= {
        ".".join(("ciuic_doctor", *p.parent.relative_to(ROOT).parts))
        for p in (ROOT / "probes").rglob("__init__.py")
    }
    assert on_disk <= declared, sorted(on_disk - declared)
