"""The module graph of turnopd/, teachers/ and envs/, read from the source with ast (nothing is
imported): no import circles, function-level imports included, and imports only go down the layers."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("turnopd", "teachers", "envs")

# Lowest first. A module is in the layer of the longest prefix that names it; it may import modules of
# its own layer (without a circle) and of the layers below, never above.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("core", ("turnopd", "turnopd.core")),
    ("algorithm, config, analysis", ("turnopd.algorithm", "turnopd.config", "turnopd.analysis")),
    ("backends", ("turnopd.loaders", "envs", "teachers", "turnopd.rollout", "turnopd.trainer", "turnopd.models")),
    ("orchestration", ("turnopd.orchestration",)),
    ("commands", ("turnopd.commands", "turnopd.cli")),
]


def module_files(root: Path = ROOT) -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in (root / package).rglob("*.py"):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def _literal_strings(tree: ast.Module) -> dict[str, list[str]]:
    """Module-level names bound to a tuple or list of string constants (module lists for import_module)."""
    out = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, (ast.Tuple, ast.List)):
            values = [e.value for e in node.value.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
            if len(values) == len(node.value.elts):
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        out[target.id] = values
    return out


def imported_names(module: str, path: Path) -> list[str]:
    """Every module name `module` imports anywhere in its file (function bodies included), and those
    it imports by `importlib.import_module` of a string constant or of the loop variable of a `for`
    over a module-level tuple of strings (how envs and the CLI load their built-ins)."""
    tree = ast.parse(path.read_text(), str(path))
    lists = _literal_strings(tree)
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    names: list[str] = []
    loop_values: dict[str, list[str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.For) and isinstance(node.target, ast.Name) and isinstance(node.iter, ast.Name):
            loop_values[node.target.id] = lists.get(node.iter.id, [])
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package[: len(package) - node.level + 1], *([base] if base else [])])
            names += [f"{base}.{alias.name}" for alias in node.names] + [base]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "import_module"
              and node.args):
            arg = node.args[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                names.append(arg.value)
            elif isinstance(arg, ast.Name):
                names += loop_values.get(arg.id, [])
    return names


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """module -> the project modules it imports (an imported name maps to the longest module prefix)."""
    files = module_files(root)

    def resolve(name: str) -> str | None:
        parts = name.split(".")
        return next((".".join(parts[:i]) for i in range(len(parts), 0, -1) if ".".join(parts[:i]) in files), None)

    graph = {}
    for module, path in files.items():
        targets = {resolve(name) for name in imported_names(module, path)}
        graph[module] = {t for t in targets if t is not None and t != module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            child = next(edges, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def layer_of(module: str) -> int:
    best = max(((len(prefix), level) for level, (_, prefixes) in enumerate(LAYERS) for prefix in prefixes
                if module == prefix or module.startswith(prefix + ".")), default=None)
    assert best is not None, f"{module} is in no layer: add its package to LAYERS"
    return best[1]


def test_the_cycle_finder_finds_a_circle_and_only_circles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_function_level_and_importlib_imports_are_edges(tmp_path):
    (tmp_path / "turnopd").mkdir()
    (tmp_path / "teachers").mkdir()
    (tmp_path / "envs").mkdir()
    (tmp_path / "turnopd" / "__init__.py").write_text("")
    (tmp_path / "turnopd" / "a.py").write_text("def f():\n    from turnopd.b import g\n")
    (tmp_path / "turnopd" / "b.py").write_text("import importlib\nMODS = ('turnopd.a',)\n"
                                                "for m in MODS:\n    importlib.import_module(m)\n")
    graph = import_graph(tmp_path)
    assert graph["turnopd.a"] == {"turnopd.b"} and graph["turnopd.b"] == {"turnopd.a"}
    assert cycles(graph) == [["turnopd.a", "turnopd.b"]]


def test_no_import_circles():
    assert cycles(import_graph()) == []


def package_of(module: str) -> str:
    """The package a module belongs to: turnopd's subpackages (and top-level modules) each one,
    envs and teachers one each."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "turnopd" and len(parts) > 1 else parts[0]


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The module graph collapsed to packages (an import within a package is no edge)."""
    out: dict[str, set[str]] = {}
    for module, targets in graph.items():
        out.setdefault(package_of(module), set()).update(
            package_of(t) for t in targets if package_of(t) != package_of(module))
    return out


def test_package_circles_are_found():
    graph = {"turnopd.loaders.a": {"turnopd.models.b"}, "turnopd.models.b": {"turnopd.loaders.c"},
             "turnopd.loaders.c": set(), "envs.x.y": {"turnopd.core.z"}, "turnopd.core.z": set()}
    assert cycles(graph) == []  # no module circle
    assert package_graph(graph)["envs"] == {"turnopd.core"}
    assert cycles(package_graph(graph)) == [["turnopd.loaders", "turnopd.models"]]


def test_no_package_circles():
    """No circle among the packages either (turnopd.loaders, turnopd.models, turnopd.rollout, envs,
    teachers, ...): each can be read, and replaced, above the ones it imports."""
    assert cycles(package_graph(import_graph())) == []


def test_imports_go_down_the_layers():
    upward = [f"{module} ({LAYERS[layer_of(module)][0]}) imports {target} ({LAYERS[layer_of(target)][0]})"
              for module, targets in import_graph().items() for target in sorted(targets)
              if layer_of(target) > layer_of(module)]
    assert upward == []


ONE_SCREEN = 60  # lines: the code reads top to bottom, each function in one screen

# "module:function" (methods as Class.method) -> why it is longer than one screen
LONG_FUNCTIONS: dict[str, str] = {}  # "module:function": the reason a longer function is clearer


def long_functions_in(source: str, module: str, limit: int = ONE_SCREEN) -> dict[str, int]:
    """The functions (methods and nested functions included) of a module's source longer than `limit`
    lines, as "module:qualified.name" -> lines."""
    out: dict[str, int] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = getattr(child, "name", None)
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = child.end_lineno - child.lineno + 1
                if lines > limit:
                    out[f"{module}:{prefix}{name}"] = lines
            visit(child, f"{prefix}{name}." if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef
                                                          | ast.ClassDef) else prefix)

    visit(ast.parse(source), "")
    return out


def long_functions(root: Path = ROOT, package: str = "turnopd", limit: int = ONE_SCREEN) -> dict[str, int]:
    """Every function of the package's modules longer than `limit` lines."""
    return {key: lines for module, path in sorted(module_files(root).items())
            if module == package or module.startswith(package + ".")
            for key, lines in long_functions_in(path.read_text(), module, limit).items()}


def test_long_functions_are_found():
    source = ("def short():\n    pass\n\n\ndef long():\n" + "    x = 1\n" * 60
              + "\n\nclass C:\n    def method(self):\n" + "        x = 1\n" * 60)
    assert long_functions_in(source, "turnopd.m") == {"turnopd.m:long": 61, "turnopd.m:C.method": 61}
    assert long_functions_in("def short():\n" + "    x = 1\n" * 59, "turnopd.m") == {}


def test_every_function_fits_one_screen():
    """Every function of turnopd/ fits one screen, but those LONG_FUNCTIONS names with a reason (and
    each of those is still there and still long: a split one leaves the list)."""
    found = long_functions()
    assert sorted(set(found) - set(LONG_FUNCTIONS)) == []
    assert sorted(set(LONG_FUNCTIONS) - set(found)) == []
