"""The package's shape: no import cycles (imports inside functions included) and no file,
function or class too long to read in one go."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "dtrain"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports_of(path: Path, known: set[str]) -> set[str]:
    """The dtrain modules ``path`` imports anywhere in its code: ``from a.b import c`` names
    the module a.b.c when there is one, else a.b."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
    return {name for name in found if name in known}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` as a list of modules (first = last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_cycle_finder_finds_a_function_level_import_cycle(tmp_path):
    # The check itself: a cycle closed by an import inside a function is one.
    (tmp_path / "a.py").write_text("import b\n")
    (tmp_path / "b.py").write_text("def f():\n    from a import x\n")
    known = {"a", "b"}
    graph = {}
    for name in known:
        tree = ast.parse((tmp_path / f"{name}.py").read_text())
        graph[name] = {n.module if isinstance(n, ast.ImportFrom) else n.names[0].name
                       for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom)}
    assert find_cycle(graph) == ["a", "b", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_dtrain_has_no_import_cycle():
    known = set(modules())
    graph = {name: imports_of(path, known) - {name} for name, path in modules().items()}
    assert "dtrain.parallel.context.ring" in graph["dtrain.parallel.context.ops"]
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_no_file_function_or_class_is_too_long():
    # 500 lines a file, 80 a function, 300 a class: each fits in one read.
    too_long = []
    for name, path in modules().items():
        text = path.read_text()
        if len(text.splitlines()) > 500:
            too_long.append(f"{name}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            limit = 80 if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) else \
                300 if isinstance(node, ast.ClassDef) else None
            if limit and node.end_lineno - node.lineno + 1 > limit:
                too_long.append(f"{name}.{node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert not too_long, too_long


def test_the_model_imports_no_training_code():
    """``dtrain.models`` is a plain model: it imports only itself, ``dtrain.kernels`` and
    ``dtrain.dtensor``; what training does to it (step casts, FP8, parallel plans) is applied
    from outside."""
    known = set(modules())
    allowed = ("dtrain.models", "dtrain.kernels", "dtrain.dtensor")
    reached = {name: sorted(i for i in imports_of(path, known)
                            if i != "dtrain" and not i.startswith(allowed))
               for name, path in modules().items() if name.startswith("dtrain.models")}
    assert {name: found for name, found in reached.items() if found} == {}
