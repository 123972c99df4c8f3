"""The package's architecture: every module of zen/ imports only from its own layer or the layers below
(imports inside functions included), and no modules import each other in a circle. The layers, bottom to
top, are listed in zen/__init__.py's docstring."""
import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "zen"
LAYERS = {
    "zen._C": 0,
    "zen.ops": 1, "zen.wire": 1,
    "zen.geometry": 2, "zen.units": 2,
    "zen.transport": 3, "zen.lane": 3, "zen.schedules": 3, "zen.agreement": 3,
    "zen.cost": 4,
    "zen.schemes": 5, "zen.schemes.balanced": 5,
    "zen.measurement": 6,
    "zen.auto": 7, "zen.topk": 7, "zen.hierarchy": 7,
    "zen": 8, "zen.collective": 8, "zen.hook": 8, "zen.bucket_plan": 8, "zen.totals": 8, "zen.prediction": 8, "zen.planner": 8, "zen.info": 8,
    "zen.testing": 8,
}
NO_DISTRIBUTED = (0, 1, 2, 4)  # kernels, geometry and the cost model never import torch.distributed
MAX_LINES = 450


def module_name(path: pathlib.Path) -> str:
    parts = ["zen"] + list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer(module: str) -> int:
    """The layer of ``module``: its own entry, or its package's (zen.cost.terms is zen.cost's)."""
    name = module
    while name not in LAYERS:
        if "." not in name:
            raise AssertionError(f"{module} is in no layer: add it to LAYERS and to zen/__init__.py's docstring")
        name = name.rsplit(".", 1)[0]
    return LAYERS[name]


def is_module(name: str) -> bool:
    path = ROOT.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists() or name == "zen._C"


def imports(path: pathlib.Path):
    """(line, imported module) of every import in the file, in functions too; relative ones resolved."""
    return imports_of(path.read_text(), module_name(path), path.name == "__init__.py")


def imports_of(source: str, module: str, is_package: bool = False):
    package = module if is_package else module.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([node.module] if node.module else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                yield node.lineno, sub if is_module(sub) else base


def modules():
    return sorted(ROOT.rglob("*.py"))


def zen_edges():
    """{module: {imported zen module: line}} over every module of the package."""
    edges = {}
    for path in modules():
        mine = edges.setdefault(module_name(path), {})
        for line, name in imports(path):
            if name == "zen" or name.startswith("zen."):
                mine.setdefault(name, line)
    return edges


def test_every_import_runs_down_the_layers():
    problems = []
    for path in modules():
        module = module_name(path)
        for line, name in imports(path):
            where = f"{path.relative_to(ROOT.parent)}:{line}"
            if (name == "zen" or name.startswith("zen.")) and layer(name) > layer(module):
                problems.append(f"{where}: {module} (layer {layer(module)}) imports {name} (layer {layer(name)})")
            if name.startswith("torch.distributed") and layer(module) in NO_DISTRIBUTED:
                problems.append(f"{where}: {module} (layer {layer(module)}) imports {name}")
    assert not problems, "imports that run up the layers:\n" + "\n".join(problems)


def test_no_import_cycles():
    edges = zen_edges()
    state, stack, cycles = {}, [], []

    def visit(module):
        state[module] = "open"
        stack.append(module)
        for target in edges.get(module, {}):
            if state.get(target) == "open":
                cycle = stack[stack.index(target):] + [target]
                cycles.append(" -> ".join(f"{a} (line {edges[a][b]})" for a, b in zip(cycle, cycle[1:])))
            elif target not in state:
                visit(target)
        stack.pop()
        state[module] = "done"

    for module in sorted(edges):
        if module not in state:
            visit(module)
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


@pytest.mark.parametrize("path", modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_modules_stay_small(path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{path.relative_to(ROOT.parent)} has {lines} lines (at most {MAX_LINES})"


def test_the_checker_resolves_imports():
    """Relative imports, in functions too, resolve to the modules they load (a name imported from a package
    is the package unless it is a module of it), so an upward import hidden in a function is seen."""
    source = ("from . import ops\nfrom .geometry import doubling_plan\n"
              "def f():\n    from .cost import Profile\n    from .schemes import call\n    from .. import auto\n")
    found = [name for _, name in imports_of(source.replace("from ..", "from ."), "zen.transport")]
    assert found == ["zen.ops", "zen.geometry", "zen.cost", "zen.schemes.call", "zen.auto"]
    assert [layer(name) for name in found] == [1, 2, 4, 5, 7] and layer("zen.transport") == 3
    found = [name for _, name in imports_of(source, "zen.measurement.probe")]
    assert found[-1] == "zen.auto" and layer(found[-1]) > layer("zen.measurement.probe")
