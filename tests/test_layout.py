"""The project's shape: no import cycles among its own modules, no module over 450 lines,
hetjax/config.py at most 350 (docs/DESIGN.md, "Layout")."""

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# folder -> the package name it is imported (installed) as
PACKAGES = {"hetjax": "hetjax", "models": "hetjax.models", "configs": "hetjax.configs",
            "launch": "hetjax.launch", "bench": "bench"}
MAX_LINES = 450
MAX_CONFIG_LINES = 350


def modules(root: Path, packages: dict[str, str]) -> dict[str, Path]:
    """Every module's dotted name (as installed) -> its file."""
    found = {}
    for folder, name in packages.items():
        for path in sorted((root / folder).rglob("*.py")):
            parts = list(path.relative_to(root / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([name, *parts])] = path
    return found


def import_graph(root: Path, packages: dict[str, str]) -> dict[str, set[str]]:
    """module -> the project's modules it imports, at module level or inside functions.
    `from X import Y` counts as importing X.Y when that is a module, else X."""
    mods = modules(root, packages)
    # A folder's own name (`models.llama`) reaches the same file as its installed name.
    aliases = {folder: name for folder, name in packages.items() if folder != name}

    def canonical(name: str) -> str | None:
        head, _, rest = name.partition(".")
        if head in aliases:
            name = aliases[head] + ("." + rest if rest else "")
        while name and name not in mods:  # `import a.b.C` or an attribute: its longest module prefix
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for mod, path in mods.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{a.name}" for a in node.names]  # canonical() drops a non-module name
            else:
                continue
            edges |= {t for t in map(canonical, targets) if t is not None and t != mod}
        graph[mod] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None."""
    state, stack = {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == "open":
                return stack[stack.index(n):] + [n]
            if n not in state and (cycle := visit(n)):
                return cycle
        stack.pop()
        state[m] = "done"
        return None

    for m in sorted(graph):
        if m not in state and (cycle := visit(m)):
            return cycle
    return None


def all_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Import cycles, searched again without each found cycle's modules, so separate cycles are all named."""
    cycles, rest = [], {m: set(e) for m, e in graph.items()}
    while cycle := find_cycle(rest):
        cycles.append(cycle)
        for m in cycle:  # drop the group so the next search finds another one
            rest.pop(m, None)
        rest = {m: e - set(cycle) for m, e in rest.items()}
    return cycles


def test_no_import_cycles():
    cycles = all_cycles(import_graph(ROOT, PACKAGES))
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_no_module_over_the_line_limit():
    lengths = {path: len(path.read_text().splitlines()) for path in modules(ROOT, PACKAGES).values()}
    too_long = {str(p.relative_to(ROOT)): n for p, n in lengths.items() if n > MAX_LINES}
    config = lengths[ROOT / "hetjax" / "config.py"]
    assert not too_long, f"modules over {MAX_LINES} lines (one file, one idea): {too_long}"
    assert config <= MAX_CONFIG_LINES, f"hetjax/config.py has {config} lines; it only composes the parts' configs"


def test_the_wheel_installs_every_package_inside_hetjax():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(project["packages"])
    tree = {name for name, path in modules(ROOT, PACKAGES).items()
            if path.name == "__init__.py" and not name.startswith("bench")}
    assert listed == tree, f"pyproject.toml's packages differ from the tree: {sorted(listed ^ tree)}"
    assert all(name == "hetjax" or name.startswith("hetjax.") for name in listed)
    assert {project["package-dir"][f"hetjax.{d}"] for d in ("models", "configs", "launch")} == {"models", "configs", "launch"}


def test_the_graph_finds_a_planted_cycle(tmp_path):
    files = {"pkg/__init__.py": "from pkg.a import f\n",
             "pkg/a.py": "import os\nfrom . import b\n\ndef f():\n    pass\n",
             "pkg/b.py": "def g():\n    from pkg.c import h\n",  # a function-level import counts
             "pkg/c.py": "from pkg import a\n",  # `from X import Y` with Y a module
             "pkg/d.py": "from top.util import x\n",  # reached by the folder's own name
             "top/__init__.py": "",
             "top/util.py": "import pkg.d\n"}
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    graph = import_graph(tmp_path, {"pkg": "pkg", "top": "pkg.top"})
    assert graph["pkg.a"] == {"pkg.b"} and graph["pkg.b"] == {"pkg.c"} and graph["pkg.c"] == {"pkg.a"}
    assert graph["pkg"] == {"pkg.a"} and graph["pkg.d"] == {"pkg.top.util"}
    assert find_cycle(graph) == ["pkg.a", "pkg.b", "pkg.c", "pkg.a"]
    assert sorted(map(sorted, all_cycles(graph))) == [["pkg.a", "pkg.a", "pkg.b", "pkg.c"],
                                                       ["pkg.d", "pkg.d", "pkg.top.util"]]
    del graph["pkg.c"]
    graph["pkg.top.util"] = set()
    assert find_cycle(graph) is None
