"""The package's shape: no import cycles (imports inside functions included); no file, function
or class too long to read in one go; no module importing more than 15 others; and no test or
tool reaching a private name of dtrain."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "dtrain"
# More dtrain modules than this in one file: it does more than one thing.
IMPORT_LIMIT = 15
# Calls that name an attribute by a string: getattr(m, "_x"), monkeypatch.setattr(m, "_x", v).
ATTRIBUTE_CALLS = {"getattr", "setattr", "hasattr", "delattr"}
ATTRIBUTE_METHODS = {"setattr", "delattr", "object"}  # monkeypatch.*, mock.patch.object
DOTTED_PATH = re.compile(r"dtrain(\.\w+)+")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports_in(source: str, name: str, is_package: bool, known: set[str]) -> set[str]:
    """The dtrain modules the module ``name`` (source text ``source``) imports anywhere in its
    code: ``from a.b import c`` names the module a.b.c when there is one, else a.b."""
    package = name if is_package else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(source)):
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


def imports_of(path: Path, known: set[str]) -> set[str]:
    """``imports_in`` for the dtrain file ``path``."""
    return imports_in(path.read_text(), module_name(path), path.name == "__init__.py", known)


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


def over_import_limit(imports: dict[str, set[str]], limit: int = IMPORT_LIMIT) -> list[str]:
    """Each module of ``imports`` (module -> the dtrain modules it imports) that imports more
    than ``limit``, as "module: N dtrain modules"."""
    return [f"{name}: {len(found)} dtrain modules" for name, found in sorted(imports.items())
            if len(found) > limit]


def test_the_import_count_counts_each_imported_module_once():
    known = {"dtrain", "dtrain.pkg", "dtrain.pkg.sub"} | {f"dtrain.m{i}" for i in range(16)}
    source = "\n".join([
        "import torch",
        "import dtrain.m0",
        "import dtrain.m0 as again",  # the same module: counted once
        "from dtrain import m1",
        "from dtrain.m2 import thing",
        "from dtrain.pkg import sub",  # a module: dtrain.pkg.sub
        "from dtrain.pkg import Thing",  # not a module: dtrain.pkg
        "def f():",
        "    from . import m3",
        "    from .m4 import other",
        *[f"from dtrain.m{i} import x{i}" for i in range(5, 16)]])
    found = imports_in(source, "dtrain.user", False, known)
    assert found == known - {"dtrain"}
    assert over_import_limit({"dtrain.user": found, "dtrain.m0": {"dtrain.m1"}}) == [
        "dtrain.user: 18 dtrain modules"]
    assert over_import_limit({"dtrain.user": found}, limit=18) == []


def test_no_module_imports_more_than_15_dtrain_modules():
    known = set(modules())
    imports = {name: imports_of(path, known) - {name} for name, path in modules().items()}
    over = over_import_limit(imports)
    assert not over, "\n".join(over)


def in_dtrain(module: str) -> bool:
    return module == "dtrain" or module.startswith("dtrain.")


def is_private(name: str) -> bool:
    """``_name`` and ``__name`` are private; ``__name__`` is not."""
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def foreign_names(source: str) -> set[str]:
    """The names a dtrain module binds by importing another library (``os``, ``nn``): their
    attributes belong to that library, not to dtrain."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names |= {alias.asname or alias.name.partition(".")[0] for alias in node.names
                      if not in_dtrain(alias.name)}
        elif isinstance(node, ast.ImportFrom) and not node.level \
                and not in_dtrain(node.module or ""):
            names |= {alias.asname or alias.name for alias in node.names}
    return names


def private_uses(source: str, filename: str, package: dict[str, set[str]]) -> list[str]:
    """Each place where ``source`` (a test or a tool) reaches a private name of dtrain, as
    "filename:line: dtrain.x._name", in line order. ``package`` maps each dtrain module to its
    ``foreign_names``. Reached are: ``from dtrain.x import _y``; ``m._y`` where ``m`` is a
    dtrain module or anything imported from one, under any name; ``getattr(m, "_y")``,
    ``monkeypatch.setattr(m, "_y", v)`` and the like; a string "dtrain.x._y" (a monkeypatch
    target). An instance's attributes (``trainer._x``) have no type here and are not seen."""
    tree = ast.parse(source)
    bound: dict[str, str] = {}  # a name of this file -> the dtrain module or object it is
    found: set[tuple[int, str]] = set()

    def member(base: str, attr: str) -> str | None:
        """What ``base.attr`` is in dtrain; None where base is not a module or attr is another
        library's."""
        if f"{base}.{attr}" in package or (base in package and attr not in package[base]):
            return f"{base}.{attr}"
        return None

    def stands_for(expr: ast.expr) -> str | None:
        if isinstance(expr, ast.Name):
            return bound.get(expr.id)
        if isinstance(expr, ast.Attribute) and (base := stands_for(expr.value)):
            return member(base, expr.attr)
        return None

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in (a for a in node.names if in_dtrain(a.name)):
                bound[alias.asname or "dtrain"] = alias.name if alias.asname else "dtrain"
                if any(map(is_private, alias.name.split("."))):
                    found.add((node.lineno, alias.name))
        elif isinstance(node, ast.ImportFrom) and not node.level and in_dtrain(node.module):
            for alias in node.names:
                if any(map(is_private, [*node.module.split("."), alias.name])):
                    found.add((node.lineno, f"{node.module}.{alias.name}"))
                if target := member(node.module, alias.name):
                    bound[alias.asname or alias.name] = target
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and is_private(node.attr) \
                and (owner := stands_for(node.value)):
            found.add((node.lineno, f"{owner}.{node.attr}"))
        elif isinstance(node, ast.Call) and len(node.args) >= 2 \
                and (isinstance(node.func, ast.Name) and node.func.id in ATTRIBUTE_CALLS
                     or isinstance(node.func, ast.Attribute)
                     and node.func.attr in ATTRIBUTE_METHODS) \
                and isinstance(name := node.args[1], ast.Constant) \
                and isinstance(name.value, str) and is_private(name.value) \
                and (owner := stands_for(node.args[0])):
            found.add((node.lineno, f"{owner}.{name.value}"))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and DOTTED_PATH.fullmatch(node.value) \
                and any(map(is_private, node.value.split("."))):
            found.add((node.lineno, node.value))
    return [f"{filename}:{line}: {name}" for line, name in sorted(found)]


def test_the_private_name_finder_finds_each_way_in():
    package = {"dtrain": set(), "dtrain.m": {"os", "nn"}, "dtrain.pkg": set(),
               "dtrain.pkg.sub": set()}
    source = "\n".join([
        "import os, dtrain",
        "import dtrain.pkg.sub as sub",
        "from dtrain import m",
        "from dtrain.pkg import Thing, _hidden",  # 4
        "sub._cache.clear()",  # 5: a module's, under another name
        "Thing._state = 1",  # 6: a class's, imported
        "print(m.Thing._x, dtrain.pkg.sub._y)",  # 7: through a module
        "monkeypatch.setattr(m, '_limit', 2); getattr(dtrain.pkg, '_z')",  # 8: by string
        "monkeypatch.setattr('dtrain.pkg.Thing._finish', None)",  # 9: a target path
        # Not dtrain's: another library's, a dunder, a public one, an instance's.
        "os._exit, m.os._exit, m.nn.Module._apply, Thing.__name__, getattr(m, '__doc__')",
        "Thing.public._deep, m.public, trainer._step, setattr(trainer, '_x', 1)"])
    assert private_uses(source, "t.py", package) == [
        "t.py:4: dtrain.pkg._hidden", "t.py:5: dtrain.pkg.sub._cache",
        "t.py:6: dtrain.pkg.Thing._state", "t.py:7: dtrain.m.Thing._x",
        "t.py:7: dtrain.pkg.sub._y", "t.py:8: dtrain.m._limit", "t.py:8: dtrain.pkg._z",
        "t.py:9: dtrain.pkg.Thing._finish"]


def test_no_test_or_tool_reaches_a_private_name_of_dtrain():
    """Tests and tools use dtrain as its users do: what they need is public, with a name and a
    docstring."""
    package = {name: foreign_names(path.read_text()) for name, path in modules().items()}
    found = [use for path in sorted([*ROOT.glob("tests/*.py"), *ROOT.glob("tools/*.py")])
             for use in private_uses(path.read_text(), str(path.relative_to(ROOT)), package)]
    assert not found, "\n".join(found)
