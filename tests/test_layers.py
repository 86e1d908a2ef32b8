"""The dependency direction between the packages (docs/architecture.md): each layer imports only the layers below
it, and no module imports itself back through others."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# lowest first; a module may import its own layer and the ones before it
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("base", ("attnmt.errors", "attnmt.fileio", "attnmt.config", "attnmt.registry", "attnmt.signals",
              "attnmt.settings")),
    ("data", ("attnmt.data", "attnmt.scoring", "attnmt.progress")),
    ("models", ("attnmt.models",)),
    ("components", ("attnmt.criterions", "attnmt.optim", "attnmt.tasks", "attnmt.checkpoint", "attnmt.backends")),
    ("inference", ("attnmt.generation", "attnmt.inference", "attnmt.checkpoint.averaging")),
    ("work", ("attnmt.training", "attnmt.preprocess", "attnmt.plots", "attnmt.interop")),
    ("service", ("attnmt.api", "attnmt.serve")),
    ("commands", ("attnmt.cli",)),
]
# the one upward import: the package's public names, re-exported from the API on first use
ALLOWED = {("attnmt", "attnmt.api"), ("attnmt", "attnmt.errors")}


def _modules() -> dict[str, Path]:
    found = {}
    for base, prefix in ((ROOT / "attnmt", "attnmt"), (ROOT / "cli", "attnmt.cli")):
        for path in base.rglob("*.py"):
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([prefix, *parts])] = path
    return found


def _layer(module: str) -> int:
    for i, (_, prefixes) in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return i
    return -1  # the attnmt package itself (its version)


def _imports(module: str, path: Path, known: set[str]) -> set[str]:
    """Every attnmt module that ``module`` imports, at the top or inside a function."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("attnmt"))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("attnmt"):
            for a in node.names:  # ``from attnmt.x import y``: y may be a module of its own
                sub = f"{node.module}.{a.name}"
                out.add(sub if sub in known else node.module)
    out.discard(module)
    return out


def test_every_module_has_a_layer():
    assert [m for m in _modules() if _layer(m) < 0 and m != "attnmt"] == []


def test_imports_go_down_the_layers():
    mods = _modules()
    wrong = []
    for m, path in mods.items():
        for dep in _imports(m, path, set(mods)):
            if _layer(dep) > _layer(m) and (m, dep) not in ALLOWED:
                wrong.append(f"{m} ({LAYERS[_layer(m)][0]}) imports {dep} ({LAYERS[_layer(dep)][0]})")
    assert wrong == []


def test_no_import_cycles():
    mods = _modules()
    graph = {m: {d for d in _imports(m, p, set(mods)) if d in mods and (m, d) not in ALLOWED} for m, p in mods.items()}
    for pkg in [m for m in mods if mods[m].name == "__init__.py"]:  # a package's modules may use its __init__
        for m in graph:
            if m.startswith(pkg + "."):
                graph[pkg].discard(m)
    state: dict[str, int] = {}
    cycles = []

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                cycles.append(" -> ".join(stack[stack.index(d):] + [d]))
            elif d not in state:
                visit(d, stack + [d])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert cycles == []


@pytest.mark.parametrize("layer", range(len(LAYERS)), ids=[name for name, _ in LAYERS])
def test_each_layer_imports_alone(layer):
    """Importing a layer's modules in a fresh interpreter loads nothing from the layers above it."""
    mods = sorted(m for m in _modules() if _layer(m) == layer and not m.endswith("__main__"))
    code = ("import sys\n" + "".join(f"import {m}\n" for m in mods)
            + "print('\\n'.join(m for m in sys.modules if m.startswith('attnmt')))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                            cwd=ROOT).stdout.split()
    above = [m for m in loaded if _layer(m) > layer]
    assert above == [], f"importing the {LAYERS[layer][0]} layer loads {above}"
