"""The shape of ``experiments/``: thin entry points over library packages, imports that follow the data flow,
and committed reports without machine paths; short functions and modules in every package."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXPERIMENTS = ROOT / "experiments"
MAX_FUNCTION_LINES = 60
MAX_FILE_LINES = 400
# The one drafter class is read in one sitting, training forward and draft side by side (issue 51): its file
# may be longer, up to this.
MAX_DRAFTER_LINES = 700
PACKAGES = [ROOT / name for name in ("drafters", "losses", "verify", "experiments")]  # the code the checks below cover


def is_entry_point(path: Path) -> bool:
    """A module run as ``python -m ...``: it ends in ``if __name__ == "__main__":``."""
    tree = ast.parse(path.read_text())
    return any(isinstance(node, ast.If) and "__name__" in ast.unparse(node.test) for node in tree.body)


def entry_points(root: Path = EXPERIMENTS) -> dict[str, Path]:
    """Dotted name -> file of every entry point under ``root`` (an ``experiments`` folder)."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        if path.name != "__init__.py" and is_entry_point(path):
            parts = path.relative_to(root.parent).with_suffix("").parts
            found[".".join(parts)] = path
    return found


def imported_modules(path: Path, package: str) -> set[str]:
    """Every module ``path`` imports (``from a import b`` counts as ``a`` and ``a.b``; relative imports
    resolved against ``package``), wherever the import statement stands."""
    return tree_imports(ast.parse(path.read_text()), package)


def tree_imports(tree: ast.AST, package: str) -> set[str]:
    """:func:`imported_modules` of a parsed module."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            out.add(base)
            out |= {f"{base}.{alias.name}" for alias in node.names}
    return out


def entry_point_imports(root: Path = EXPERIMENTS) -> list[str]:
    """``"a imports b"`` for every entry point ``a`` under ``root`` that imports another entry point ``b``."""
    points = entry_points(root)
    bad = []
    for name, path in points.items():
        package = name.rsplit(".", 1)[0]
        for module in sorted(imported_modules(path, package) & set(points)):
            if module != name:
                bad.append(f"{name} imports {module}")
    return bad


def test_no_entry_point_imports_another():
    assert entry_point_imports() == []


def test_the_check_sees_an_entry_point_importing_another(tmp_path):
    root = tmp_path / "experiments"
    root.mkdir()
    main = 'if __name__ == "__main__":\n    main()\n'
    (root / "train.py").write_text("def main():\n    pass\n\n\n" + main)
    (root / "evaluate.py").write_text("from experiments.train import main\n\n\n" + main)
    (root / "report.py").write_text("def later():\n    from experiments import evaluate\n\n\n" + main)
    (root / "library.py").write_text("from experiments import train\n")  # a library module may
    assert entry_point_imports(root) == ["experiments.evaluate imports experiments.train",
                                         "experiments.report imports experiments.evaluate"]


def test_experiments_top_level_holds_only_entry_points():
    """Every module at the top of experiments/ is a thin entry point that the README's layout table names."""
    top = {p.stem for p in EXPERIMENTS.glob("*.py") if p.name != "__init__.py"}
    assert all(is_entry_point(EXPERIMENTS / f"{name}.py") for name in top)
    row = next(line for line in (ROOT / "README.md").read_text().splitlines() if line.startswith("| `experiments/*.py`"))
    assert [name for name in sorted(top) if f"`{name}`" not in row] == []


def bench_gaps(bench: Path, doc: Path, tests: Path) -> list[str]:
    """What a module of ``bench`` lacks: a section of ``doc`` headed by its name in backquotes, or a test file under
    ``tests`` that imports it; and a section of ``doc`` that names no module."""
    modules = {p.stem for p in bench.glob("*.py") if p.name != "__init__.py"}
    sections = set(re.findall(r"^#+ `(\w+)`\s*$", doc.read_text(), flags=re.MULTILINE))
    tested = set()
    for path in tests.glob("test_*.py"):
        tested |= {m.split(".")[2] for m in imported_modules(path, "tests") if m.startswith("experiments.bench.")}
    return ([f"{m}: no section in {doc.name}" for m in sorted(modules - sections)]
            + [f"{m}: no test imports it" for m in sorted(modules - tested)]
            + [f"{s}: a section of {doc.name} without a module" for s in sorted(sections - modules)])


def test_every_bench_is_documented_and_smoke_tested():
    """Every module of experiments/bench/ is a tool a user runs: docs/bench.md says what it measures and how to run
    it, and a test runs it."""
    assert bench_gaps(EXPERIMENTS / "bench", ROOT / "docs" / "bench.md", ROOT / "tests") == []


def test_the_bench_check_sees_an_undocumented_untested_module(tmp_path):
    bench, tests = tmp_path / "bench", tmp_path / "tests"
    bench.mkdir(), tests.mkdir()
    for name in ("__init__", "cost", "orphan"):
        (bench / f"{name}.py").write_text("")
    (tmp_path / "bench.md").write_text("# Benchmarks\n\n### `cost`\n\n### `gone`\n")
    (tests / "test_cost.py").write_text("def test_it():\n    from experiments.bench import cost\n")
    assert bench_gaps(bench, tmp_path / "bench.md", tests) == [
        "orphan: no section in bench.md", "orphan: no test imports it", "gone: a section of bench.md without a module"]


def function_lengths(root: Path = EXPERIMENTS) -> dict[str, int]:
    """``file:line name`` -> lines (decorators included) of every function under ``root``."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                out[f"{path.relative_to(ROOT)}:{node.lineno} {node.name}"] = node.end_lineno - start + 1
    return out


def test_functions_are_short():
    long = {k: n for root in PACKAGES for k, n in function_lengths(root).items() if n > MAX_FUNCTION_LINES}
    assert long == {}, f"split these into named steps (at most {MAX_FUNCTION_LINES} lines): {long}"


def test_modules_are_short():
    lengths = {p.relative_to(ROOT).as_posix(): len(p.read_text().splitlines())
               for root in PACKAGES for p in sorted(root.rglob("*.py"))}
    assert len(lengths) > 50 and lengths["verify/generate.py"] > 100  # the walk sees the packages
    limit = {"drafters/model.py": MAX_DRAFTER_LINES}
    long = {k: n for k, n in lengths.items() if n > limit.get(k, MAX_FILE_LINES)}
    assert long == {}, f"split these by responsibility (at most {MAX_FILE_LINES} lines): {long}"


MACHINE_PATH = re.compile(r"""(?:^|["'`\s(=])(?:~/|/(?:home|root|tmp|work|Users|var/folders)/)""")


@pytest.mark.parametrize("path", sorted(p.relative_to(ROOT).as_posix() for folder in ("results", "assets")
                                        for p in (EXPERIMENTS / folder).rglob("*") if p.suffix in {".json", ".md"}))
def test_committed_reports_hold_no_machine_paths(path):
    """Reports and asset cards name paths relative to the repository, never this checkout's own folder."""
    text = (ROOT / path).read_text()
    hits = [m.group(0) for m in MACHINE_PATH.finditer(text)] + [str(ROOT)] * text.count(str(ROOT) + "/")
    assert hits == [], f"{path}: paths of the machine that wrote it ({len(hits)}), e.g. {hits[:3]}"


# The floors of the code, lowest first: a module imports only from its own floor or below (DESIGN.md §7).
# ``experiments/__init__`` registers the config resolvers every entry point needs: it stands with the entry points.
FLOORS = {"verify": 0, "losses": 0, "drafters": 1, "conf": 1, "experiments.data": 2, "experiments.pipeline": 3,
          "experiments.serving": 4, "experiments.reporting": 4, "experiments.jobs": 5, "experiments.bench": 5}


def module_floors(root: Path = ROOT) -> dict[str, tuple[int, Path]]:
    """Dotted module name -> (floor, file) for every module of the packages (entry points: the top floor)."""
    out = {}
    for package in PACKAGES:
        for path in sorted((root / package.name).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            prefix = next((p for p in sorted(FLOORS, key=len, reverse=True) if name == p or name.startswith(p + ".")),
                          None)
            out[name] = (FLOORS[prefix] if prefix else 6, path)
    return out


def runtime_imports(path: Path, package: str, known: set[str]) -> set[str]:
    """The modules of ``known`` that ``path`` imports when it runs (imports under ``if TYPE_CHECKING:`` left out;
    ``from a import b`` imports the module a.b where there is one, else a's ``__init__``)."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            node.body = [ast.Pass()]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = next(iter(tree_imports(ast.Module(body=[ast.ImportFrom(node.module, [], node.level)],
                                                     type_ignores=[]), package)))
            out |= {f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names}
    return out & known


def import_problems(root: Path = ROOT) -> list[str]:
    """``"a -> b"`` for each import up a floor, and each circle of modules importing each other when they run."""
    floors = module_floors(root)
    graph = {name: runtime_imports(path, name if path.name == "__init__.py" else name.rsplit(".", 1)[0], set(floors))
             - {name} for name, (_, path) in floors.items()}
    problems = [f"{a} -> {b} (floor {floors[a][0]} imports floor {floors[b][0]})"
                for a, targets in sorted(graph.items()) for b in sorted(targets) if floors[b][0] > floors[a][0]]
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                problems.append("circle: " + " -> ".join([*path[path.index(nxt):], nxt]))
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for name in sorted(graph):
        if name not in state and floors[name][0] < 6:
            visit(name, [name])
    return problems


def test_imports_run_one_way_and_never_in_a_circle():
    assert import_problems() == []


def test_the_import_check_sees_an_arrow_up_and_a_circle(tmp_path):
    for package, text in (("verify", "import drafters.a\n"), ("drafters", "import drafters.b\n")):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
        (tmp_path / package / "a.py").write_text(text)
    (tmp_path / "drafters" / "b.py").write_text("from drafters import a\n")
    for name in ("losses", "experiments"):
        (tmp_path / name).mkdir()
    problems = import_problems(tmp_path)
    assert "verify.a -> drafters.a (floor 0 imports floor 1)" in problems
    assert any(p.startswith("circle: drafters.a -> drafters.b -> drafters.a") for p in problems), problems
