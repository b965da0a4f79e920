"""The architecture holds (docs/ARCHITECTURE.md, "Layers"): no module imports one above its layer, the package has
no import cycles, the benchmark wing and the tools are imported by nothing in the engine, and importing the server
loads no JAX at run time."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Lowest first; a module may import its own layer and those below. Prefixes are matched longest first.
LAYERS: dict[str, int] = {
    "pallas_kernels": 0,
    "strata_jax.model": 1,
    "strata_jax.tokenizer": 1,
    "strata_jax.cli_help": 1,
    "strata_jax.compile_cache": 1,
    "strata_jax.weights": 2,
    "strata_jax.host": 2,
    "strata_jax.demo": 2,
    "strata_jax.loaded_model": 3,
    "strata_jax.engine": 4,
    "server": 5,
    "strata_jax.bench": 6,
    "strata_jax.__main__": 7,
    "tools": 7,
}
# The JAX-free contracts the server may import although they live in lower-level packages.
SERVER_MAY_IMPORT = ("strata_jax.engine.protocol", "strata_jax.engine.config", "strata_jax.tokenizer")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _layer(module: str) -> int | None:
    best = None
    for prefix, layer in LAYERS.items():
        if (module == prefix or module.startswith(prefix + ".")) and (best is None or len(prefix) > len(best[0])):
            best = (prefix, layer)
    if best is None and module in ("strata_jax",):
        return 3  # the package's lazy __init__ re-exports load_model
    return None if best is None else best[1]


def _imports(path: Path) -> set[str]:
    """Modules a file imports (absolute and relative), at any depth: lazy imports inside functions count too."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def _sources() -> dict[str, Path]:
    files = [*ROOT.glob("strata_jax/**/*.py"), *ROOT.glob("pallas_kernels/**/*.py"), *ROOT.glob("server/**/*.py"),
             *ROOT.glob("tools/**/*.py")]
    return {_module_name(p): p for p in files}


def _internal_graph() -> dict[str, set[str]]:
    sources = _sources()
    graph = {}
    for name, path in sources.items():
        graph[name] = {m for m in _imports(path) if m in sources and m != name}
    return graph


def test_no_module_imports_above_its_layer() -> None:
    violations = []
    for name, path in _sources().items():
        own = _layer(name)
        assert own is not None, f"{name} has no layer in LAYERS: add it (and to docs/ARCHITECTURE.md)"
        for target in _imports(path):
            layer = _layer(target)
            if layer is None or layer <= own:
                continue
            violations.append(f"{name} (layer {own}) imports {target} (layer {layer})")
        if name.startswith("server"):
            for target in _imports(path):
                if target.startswith("strata_jax") and not target.startswith(SERVER_MAY_IMPORT) \
                        and target not in ("strata_jax", "strata_jax.engine"):
                    violations.append(f"{name} (server) imports {target}: only {SERVER_MAY_IMPORT} are JAX-free")
    assert not violations, "\n".join(violations)


def test_no_import_cycles() -> None:
    """Module-level imports only (a lazy import inside a function cannot form a load-time cycle)."""
    sources = _sources()
    graph = {}
    for name, path in sources.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        top = set()
        for node in tree.body:
            if isinstance(node, ast.Import):
                top.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                top.add(node.module)
                top.update(f"{node.module}.{a.name}" for a in node.names)
        graph[name] = {m for m in top if m in sources and m != name}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            pytest.fail("import cycle: " + " -> ".join(cycle))


def test_benchmarks_import_no_private_engine_names() -> None:
    """Benchmarks use public entry points only: no `from strata_jax... import _private`."""
    bad = []
    for path in ROOT.glob("strata_jax/bench/*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(("strata_jax", "pallas_kernels")):
                if not node.module.startswith("strata_jax.bench"):
                    bad += [f"{path.name}: {node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
    assert not bad, bad


def test_importing_the_server_loads_no_jax() -> None:
    code = ("import sys, server.app, server.main, server.metrics\n"
            "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'flax', 'orbax', "
            "'pallas_kernels'))\n"
            "print(','.join(heavy))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"importing server loaded: {out.stdout.strip()}"
