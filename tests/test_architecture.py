"""The package's shape: no import cycles, and a runtime side that never loads the compiler.

* the import graph of ``tvm_layerfuse`` (every ``import``/``from ... import`` in every
  module, at module level or inside functions, read with ``ast``) has no cycle;
* importing ``tvm_layerfuse.runtime`` (and the ``run`` command a bundle holds) in a fresh
  interpreter loads neither ``tvm.relax`` nor ``onnx`` nor TVM's compiler library, nor any
  compile-side module of the package;
* the files a bundle copies import nothing of the package outside themselves.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

from tvm_layerfuse.deploy import bundle

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "tvm_layerfuse"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _imports(name: str, path: Path, known: set[str], *, module_level: bool = False) -> set[str]:
    """The package modules that ``name`` (at ``path``) imports anywhere in its source (only
    in its module-level statements with ``module_level=True``)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    tree = ast.parse(path.read_text(), str(path))
    nodes = tree.body if module_level else ast.walk(tree)
    for node in nodes:
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            # `from pkg import name`: the module pkg.name when there is one, else pkg itself
            targets = [f"{origin}.{a.name}" if f"{origin}.{a.name}" in known else origin for a in node.names]
        else:
            continue
        found.update(t for t in targets if t in known and t != name)
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    modules = _modules()
    graph = {name: _imports(name, path, set(modules)) for name, path in modules.items()}
    assert sum(len(v) for v in graph.values()) > 50  # the graph was read
    assert "tvm_layerfuse.relax._ir" in graph["tvm_layerfuse.lowering.split_outputs"]
    assert _cycles(graph) == []


def test_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_runtime_imports_no_compiler():
    code = (
        "import json, sys\n"
        "import tvm_layerfuse.runtime, tvm_layerfuse.runtime.io, tvm_layerfuse.cli.run\n"
        "import tvm_layerfuse.runtime.vta.loader, tvm_layerfuse.runtime.vta.runtime, tvm_layerfuse.runtime.vta.rpc_server\n"
        "maps = open('/proc/self/maps').read()\n"
        "print(json.dumps({'modules': sorted(sys.modules), 'compiler_lib': 'libtvm_compiler' in maps}))\n"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    modules = set(result["modules"])
    assert "tvm_layerfuse.runtime.loader" in modules and "tvm_layerfuse.cli.run" in modules
    assert not result["compiler_lib"]
    forbidden = ("tvm.relax", "onnx", "tvm_layerfuse.compile", "tvm_layerfuse.relax", "tvm_layerfuse.lowering")
    loaded = sorted(m for m in modules if m.startswith(forbidden))
    assert loaded == []


def test_runtime_side_imports_nothing_of_the_compile_side():
    """Every module under ``runtime/`` (the VTA runtime included) imports, anywhere in its source,
    only the runtime package itself and the package root and its errors: never a compile-side floor."""
    modules = _modules()
    known = set(modules)
    runtime = {n: p for n, p in modules.items() if n == "tvm_layerfuse.runtime" or n.startswith("tvm_layerfuse.runtime.")}
    assert "tvm_layerfuse.runtime.vta.sim" in runtime and "tvm_layerfuse.runtime.vta.loader" in runtime
    allowed = set(runtime) | {"tvm_layerfuse", "tvm_layerfuse.errors"}
    climbs = {n: sorted(_imports(n, p, known) - allowed) for n, p in runtime.items()}
    assert {n: c for n, c in climbs.items() if c} == {}


def test_bundle_files_are_closed_under_import():
    """What a bundle copies (the runtime package and the files around it) needs nothing else
    when imported, and the ``run`` command it holds needs nothing else when it runs."""
    files = {p for p in (PACKAGE / bundle.RUNTIME_PACKAGE).rglob("*.py")} | {PACKAGE / n for n in bundle.LOADER}
    copied = {_module_name(p) for p in files}
    known = set(_modules())
    needed = {m for p in files for m in _imports(_module_name(p), p, known, module_level=True)}
    runtime_side = files - {PACKAGE / "cli" / "__init__.py"}  # its lazy main() is the full command line
    needed |= {m for p in runtime_side for m in _imports(_module_name(p), p, known)}
    assert "tvm_layerfuse.runtime.loader" in copied and "tvm_layerfuse.cli.run" in copied
    assert "tvm_layerfuse.runtime.vta.runtime" in copied and "tvm_layerfuse.runtime.vta.loader" in copied
    assert "tvm_layerfuse.runtime.vta.rpc_server" in copied and "tvm_layerfuse.runtime.vta.sim" in copied
    assert needed - copied == set()
