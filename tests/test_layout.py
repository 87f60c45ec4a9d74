"""The package's layers (docs/architecture.md): no import cycles, imports point down the layers, and
no private name is imported from another subpackage. Read from the source: every import statement,
inside functions too."""

import ast
import pathlib

SRC = pathlib.Path(__file__).resolve().parents[1] / "src"
PACKAGE = "fxtools"
LAYERS = ["cli", "training", "transforms", "rules", "capture", "codegen", "signature", "passes"]  # top to bottom
SHARED = {"errors", "registry", "functional"}  # at the root, below every layer
BOTTOM = "graph"  # node metadata and helpers: below the root modules too
FACE = {PACKAGE, f"{PACKAGE}.__main__"}  # the public API imports from everywhere
MAX_LONG_PARAMETER_LISTS = 10  # functions with 9 or more parameters (issue 31)


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in (SRC / PACKAGE).rglob("*.py"):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imports():
    """(importer, imported module, names taken from it) for every import between fxtools modules."""
    modules = _modules()
    edges = []
    for mod, path in modules.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    edges.append((mod, sub, []) if sub in modules else (mod, target, [alias.name]))
            elif isinstance(node, ast.Import):
                edges += [(mod, alias.name, []) for alias in node.names]
    return modules, [(a, b, names) for a, b, names in edges if b in modules and b != a]


def _layer(mod: str):
    """Index in LAYERS (0 is the top), len(LAYERS) for the shared root modules, one more for
    ``graph``, None if unplaced."""
    parts = mod.split(".")
    if len(parts) >= 2 and parts[1] in LAYERS:
        return LAYERS.index(parts[1])
    if len(parts) == 2 and parts[1] in SHARED:
        return len(LAYERS)
    if len(parts) >= 2 and parts[1] == BOTTOM:
        return len(LAYERS) + 1
    return None


def test_no_import_cycles():
    modules, edges = _imports()
    graph = {m: sorted({b for a, b, _ in edges if a == m and b not in FACE}) for m in modules if m not in FACE}
    state, stack, cycles = {}, [], []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for n in graph[m]:
            if state.get(n) == "open":
                cycles.append(" -> ".join(stack[stack.index(n) :] + [n]))
            elif n not in state:
                visit(n)
        stack.pop()
        state[m] = "done"

    for m in graph:
        if m not in state:
            visit(m)
    assert not cycles, f"{len(cycles)} import cycles, such as:\n" + "\n".join(cycles[:5])


def test_imports_point_down_the_layers():
    _, edges = _imports()
    upward = [
        f"{a} imports {b}"
        for a, b, _ in edges
        if a not in FACE and _layer(a) is not None and _layer(b) is not None and _layer(b) < _layer(a)
    ]
    assert not upward, "imports that climb to a higher layer:\n" + "\n".join(upward)


def test_no_private_names_across_subpackages():
    modules, edges = _imports()

    def subpackage(mod):  # fxtools.rules for fxtools.rules.nn and fxtools.rules; fxtools for fxtools.errors
        return ".".join(modules[mod].parent.relative_to(SRC).parts[:2])

    private = [
        f"{a} imports {', '.join(n for n in names if n.startswith('_'))} from {b}"
        for a, b, names in edges
        if subpackage(a) != subpackage(b) and any(n.startswith("_") and not n.startswith("__") for n in names)
    ]
    assert not private, "give what another subpackage needs a public name:\n" + "\n".join(private)


def test_the_checks_see_the_imports():
    """The checks above read real edges: the public API imports its transforms, a cycle would be seen."""
    modules, edges = _imports()
    assert len(modules) > 30 and len(edges) > 150
    assert any(a == PACKAGE and b.endswith(".errors") for a, b, _ in edges)


def test_no_private_names_across_modules():
    """No module takes another fxtools module's private name: neither ``from .x import _y`` nor
    ``x._y`` on an imported fxtools module (what two modules share gets a public name)."""
    modules, edges = _imports()
    private = [
        f"{a} imports {n} from {b}" for a, b, names in edges for n in names if n.startswith("_") and not n.startswith("__")
    ]
    for mod, path in modules.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        aliases = {}  # local name -> fxtools module it names
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                for alias in node.names:
                    if f"{target}.{alias.name}" in modules:
                        aliases[alias.asname or alias.name] = f"{target}.{alias.name}"
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name in modules and alias.asname:
                        aliases[alias.asname] = alias.name
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in aliases
                and aliases[node.value.id] != mod
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
            ):
                private.append(f"{mod} reads {node.value.id}.{node.attr}")
    assert not private, "give what another module needs a public name:\n" + "\n".join(sorted(set(private)))


def _names_a_transform(node) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("fxtools.")


def test_no_code_compares_transform_names():
    """A transform is a record (``registry.Transform``): code asks its properties (``forward_mode``,
    ``batches``), never compares a string naming it (``made_by == "fxtools.vmap"``), and passes the
    record itself as ``made_by`` (``made_by=JVP``, not ``made_by="fxtools.jvp"``)."""
    found = []
    for mod, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                found += [
                    f"{mod}:{node.lineno} compares with {s.value!r}"
                    for s in [node.left, *node.comparators]
                    if _names_a_transform(s)
                ]
            elif isinstance(node, ast.keyword) and node.arg == "made_by" and _names_a_transform(node.value):
                found.append(f"{mod}:{node.value.lineno} made_by={node.value.value!r}")
            elif isinstance(node, ast.Assign) and _names_a_transform(node.value):
                if any(isinstance(t, ast.Name) and t.id == "made_by" for t in node.targets):
                    found.append(f"{mod}:{node.lineno} made_by = {node.value.value!r}")
    assert not found, "compare and pass a transform's record, not its name:\n" + "\n".join(found)


def _functions():
    """(module, function node) for every function of the package."""
    for mod, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield mod, node


def _parameters(fn) -> int:
    a = fn.args
    n = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs) + (a.vararg is not None) + (a.kwarg is not None)
    return n - (1 if a.args and a.args[0].arg in ("self", "cls") else 0)


def test_few_long_parameter_lists():
    """Parameters that travel together are one object (``pipeline.Inputs``, ``backend.Options``,
    a convolution's ``rules.nn.Conv``): at most 10 functions of the package take 9 or more (public
    signatures that mirror PyTorch's, such as ``compile``). A rule takes its op's configuration past
    the tensors as ``**config`` (``registry.by_schema``), not as one parameter per schema argument."""
    long = sorted(f"{mod}:{fn.lineno} {fn.name} ({_parameters(fn)})" for mod, fn in _functions() if _parameters(fn) >= 9)
    assert len(long) <= MAX_LONG_PARAMETER_LISTS, f"{len(long)} functions take 9 or more parameters:\n" + "\n".join(long)


def test_short_functions():
    """Functions at most 80 lines outside ``rules/`` (one function per op there, some tables long)."""
    long = [
        f"{mod}:{fn.lineno} {fn.name} ({fn.end_lineno - fn.lineno + 1} lines)"
        for mod, fn in _functions()
        if ".rules" not in mod and fn.end_lineno is not None and fn.end_lineno - fn.lineno + 1 > 80
    ]
    assert not long, "split these functions:\n" + "\n".join(long)


def test_one_style_of_state():
    """State lives in objects passed down or in ContextVars: no ``global`` statement, no
    ``threading.local``."""
    found = []
    for mod, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Global):
                found.append(f"{mod}:{node.lineno} global {', '.join(node.names)}")
            elif isinstance(node, ast.Attribute) and node.attr == "local" and getattr(node.value, "id", None) == "threading":
                found.append(f"{mod}:{node.lineno} threading.local")
    assert not found, "use a ContextVar or pass the state down:\n" + "\n".join(found)
