"""The one-way dependency rule, read off every module's imports (top-level and inside functions alike):
kernels <- models <- engine.tasks <- scripts, and kernels <- engine core <- engine.tasks. The core never imports a
model family or a task, models never import the engine, and no package's modules import each other in a cycle."""
import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("kernels", "models", "engine", "scripts")


def _layer(module):
    if module.startswith("engine.tasks"):
        return "tasks"
    return module.split(".")[0]


# What each layer may import (besides itself).
ALLOWED = {"kernels": set(), "models": {"kernels"}, "engine": {"kernels"},
           "tasks": {"kernels", "models", "engine"}, "scripts": {"kernels", "models", "engine", "tasks"}}


def _modules():
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            yield name, path


def _imports(name, path):
    """The project modules `name` imports (resolving `from pkg import mod` to pkg.mod where that is a module)."""
    known = dict(_modules())
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                found.add(sub if sub in known else node.module)
    return {m for m in found if m.split(".")[0] in PACKAGES and m != name}


def test_dependencies_run_one_way():
    bad = []
    for name, path in _modules():
        for target in _imports(name, path):
            source_layer, target_layer = _layer(name), _layer(target)
            if source_layer != target_layer and target_layer not in ALLOWED[source_layer]:
                bad.append(f"{path.relative_to(ROOT)} imports {target} ({source_layer} -> {target_layer})")
    assert not bad, "imports against the one-way rule:\n" + "\n".join(bad)


def test_no_import_cycles():
    """No two modules reach each other through imports (a package's __init__ re-exporting its own modules
    excluded: it is the package's face, not a dependency of its modules)."""
    graph = {}
    for name, path in _modules():
        graph[name] = {t for t in _imports(name, path) if not name.startswith(t + ".") and t != name}
    for name in graph:  # a module importing its own package means its package's __init__, which re-exports it
        graph[name] = {t for t in graph[name] if t in graph and not (graph[t] and name.startswith(t + "."))}

    cycles, state = [], {}

    def visit(node, stack):
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_no_installed_package_shadows_ours():
    """Hugging Face's `kernels` (required by transformers >= 5.25) has this project's top-level name: installed in
    the same environment it would replace ours in subprocesses (pyproject.toml pins transformers below it)."""
    import importlib.metadata  # noqa: PLC0415

    for name in PACKAGES:
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        raise AssertionError(f"the installed distribution {dist.metadata['Name']} {dist.version} provides a "
                             f"top-level '{name}', this project's package; uninstall it")
