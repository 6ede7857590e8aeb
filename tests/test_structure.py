"""The package's import structure: the layers docs/architecture.md lists, each module importing only from its own
layer or an earlier one; no import cycle between its modules; and no import of one of its modules inside a function
unless that module needs an optional library (the import waits for the feature that uses it).

An import inside a function is how a cycle hides: the graph below counts imports at module level and inside
functions alike (``if TYPE_CHECKING:`` blocks aside), so a cycle fails here whichever way it is written. Shared
small pieces belong in a module below both users (`units`, `version`, `weight_files`), and an adapter that another
module must not import registers itself (`delayed_init.huggingface`).

The test suite's own rule (tests/README.md) is checked here too: a test file imports from the shared test modules
only, never from another test file.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import lightning_smp

PACKAGE = Path(lightning_smp.__file__).parent
ARCHITECTURE = PACKAGE.parent / "docs" / "architecture.md"
OPTIONAL_LIBRARIES = {"transformers", "peft", "safetensors", "matplotlib", "jsonargparse"}
"""The extras' libraries (setup.cfg): a module importing one at module level is imported where it is used."""


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _resolve(name: str) -> str:
    """The package module that ``name`` (a module, or a name imported from one) is defined in."""
    while name not in MODULES:
        name = name.rpartition(".")[0]
    return name


class _Imports(ast.NodeVisitor):
    """The package modules a module imports, each with whether it is imported inside a function; and the
    third-party top-level names it imports at module level."""

    def __init__(self, module: str) -> None:
        self.module, self.depth = module, 0
        self.package: list[tuple[str, bool, int]] = []
        self.libraries: set[str] = set()
        self.trainer_api = False  # imports lightning.pytorch (or the whole `lightning`), anywhere in the module

    def visit_If(self, node: ast.If) -> None:
        if "TYPE_CHECKING" not in ast.unparse(node.test):
            self.generic_visit(node)

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name, node.lineno)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level or not node.module:
            return
        for alias in node.names:
            self._add(f"{node.module}.{alias.name}", node.lineno)

    def _add(self, name: str, line: int) -> None:
        if name == "lightning" or name.startswith("lightning.pytorch"):
            self.trainer_api = True
        if name.split(".")[0] != "lightning_smp":
            if self.depth == 0:
                self.libraries.add(name.split(".")[0])
            return
        target = _resolve(name)
        if target != self.module and not self.module.startswith(f"{target}."):  # a package's own submodule
            self.package.append((target, self.depth > 0, line))


def _imports() -> dict[str, _Imports]:
    found = {}
    for module, path in MODULES.items():
        visitor = _Imports(module)
        visitor.visit(ast.parse(path.read_text()))
        found[module] = visitor
    return found


IMPORTS = _imports()


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(edges[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
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

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def _edges(imports: dict[str, _Imports]) -> dict[str, set[str]]:
    return {module: {target for target, _, _ in found.package} for module, found in imports.items()}


def test_no_import_cycle_between_the_packages_modules():
    cycles = _cycles(_edges(IMPORTS))
    assert cycles == [], (
        "these modules import each other (directly or around a circle; imports inside functions count): move the "
        "piece they share into a module below them"
    )


@pytest.mark.parametrize("module", sorted(MODULES))
def test_a_module_is_imported_inside_a_function_only_for_an_optional_library(module):
    hidden = [
        f"{module}:{line} imports {target}"
        for target, inside, line in IMPORTS[module].package
        if inside and not IMPORTS[target].libraries & OPTIONAL_LIBRARIES
    ]
    assert hidden == [], "import these at module level (a cycle they hide fails the test above)"


def _layers(page: str) -> list[tuple[str, list[str]]]:
    """The page's layers in order: each ``## N. Name`` heading with the modules of its ``Modules:`` paragraph."""
    layers = []
    for section in re.split(r"^## ", page, flags=re.MULTILINE)[1:]:
        heading, _, body = section.partition("\n")
        listed = re.search(r"^Modules: (.*?)(?:\n\n|\Z)", body, flags=re.MULTILINE | re.DOTALL)
        if listed:
            names = re.findall(r"`([\w.]+)`", listed.group(1))
            layers.append((heading, [name if name == "lightning_smp" else f"lightning_smp.{name}" for name in names]))
    return layers


LAYERS = _layers(ARCHITECTURE.read_text())


def test_the_architecture_page_lists_every_module_once():
    listed = [module for _, modules in LAYERS for module in modules]
    assert len(LAYERS) == 6
    assert sorted(set(MODULES) - set(listed)) == [], "add these modules to a layer of docs/architecture.md"
    assert sorted(set(listed) - set(MODULES)) == [], "docs/architecture.md lists modules that do not exist"
    assert len(listed) == len(set(listed)), "docs/architecture.md lists a module twice"


def test_no_module_imports_from_a_later_layer():
    layer_of = {module: index for index, (_, modules) in enumerate(LAYERS) for module in modules}
    upward = [
        f"{module} ({LAYERS[layer_of[module]][0]}) imports {target} ({LAYERS[layer_of[target]][0]}) at line {line}"
        for module, found in IMPORTS.items()
        for target, _, line in found.package
        if module in layer_of and target in layer_of and layer_of[target] > layer_of[module]
    ]
    assert upward == [], "move the imported piece down a layer, or the importing module up (docs/architecture.md)"


def test_the_cycle_check_finds_a_cycle_and_the_import_scan_sees_inside_functions(tmp_path):
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    visitor = _Imports("lightning_smp.progress")
    visitor.visit(ast.parse("def f():\n    from lightning_smp.memory import format_bytes\nimport matplotlib\n"))
    assert visitor.package == [("lightning_smp.memory", True, 2)] and visitor.libraries == {"matplotlib"}
    page = "## 1. A\n\ntext\n\nModules: `a`, `b.c`\n\n## 2. B\n\nModules: `lightning_smp`\n"
    assert _layers(page) == [("1. A", ["lightning_smp.a", "lightning_smp.b.c"]), ("2. B", ["lightning_smp"])]


TRAINER_ADAPTERS = {
    "lightning_smp._compat": "the one shim over Lightning's private names",
    "lightning_smp.strategy": "the Trainer's door",
    "lightning_smp.precision": "the Trainer's precision plugin",
    "lightning_smp.pipeline.lightning_results": "a pipelined step's logs and metrics, into the LightningModule",
    "lightning_smp.preemption": "saving the agreed step through the Trainer",
    "lightning_smp.data_position": "the Trainer's loader at a resumed batch",
    "lightning_smp.fault_tolerance": "the scheduler's signal, stopped at a Trainer's optimizer step",
    "lightning_smp.checkpoint.names": "a LightningOptimizer unwrapped to name its state",
    "lightning_smp.activation_memory": "the memory planner runs a LightningModule's training_step",
    "lightning_smp.cli": "LightningCLI",
}
"""The modules that import ``lightning.pytorch``, and why: the Trainer's adapters. The step engine, the precision
rules, the build path and the other doors (``smp`` scripts, Fabric) reach Lightning's Trainer only through them."""


def test_only_the_trainer_adapters_import_lightning_pytorch():
    importers = {module for module, found in IMPORTS.items() if found.trainer_api}
    assert importers - set(TRAINER_ADAPTERS) == set(), (
        "these modules import lightning.pytorch but are not Trainer adapters: take what they need from "
        "lightning.fabric, torch or a package module below them, or list them in TRAINER_ADAPTERS with the reason"
    )
    assert set(TRAINER_ADAPTERS) - importers == set(), "TRAINER_ADAPTERS lists modules that no longer import it"


SHARED_TEST_MODULES = {"conftest", "distributed", "gpt", "models", "parity"}
"""What a file of tests/ may import from tests/ (tests/README.md): the shared pieces, never another test file."""


def _test_imports(source: str) -> list[tuple[str, int]]:
    """``(module, line)`` of every ``tests.<module>`` a file of tests/ imports, at any depth."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module == "tests":
            names = [f"tests.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module is not None:
            names = [node.module]
        else:
            continue
        found += [(name.split(".")[1], node.lineno) for name in names if name.startswith("tests.")]
    return found


def test_a_test_file_imports_only_the_shared_test_modules():
    tests = Path(__file__).parent
    imports = {path.name: _test_imports(path.read_text()) for path in sorted(tests.glob("*.py"))}
    other = [f"{file}:{line} imports tests.{name}" for file, found in imports.items() for name, line in found]
    other = [line for line in other if line.rpartition("tests.")[2] not in SHARED_TEST_MODULES]
    assert other == [], f"move what they share into one of {sorted(SHARED_TEST_MODULES)} (tests/README.md)"
    assert _test_imports("import tests.test_x as x\nfrom tests import parity, test_y\n") == [
        ("test_x", 1),
        ("parity", 2),
        ("test_y", 2),
    ]
