"""The package layout shows the data flow: each package of npllama imports only from the
packages before it (file -> weights -> session -> kernels -> logits -> sampler -> text), so
there are no import cycles between packages and the layers can be read bottom up."""
import ast
import pathlib

import npllama

# earlier layers first; a module may import from its own layer and the ones before it
LAYERS = [
    {"errors", "progress", "targets"},
    {"kernels"},
    {"cache"},
    {"arch"},
    {"gguf"},
    {"text"},
    {"engine"},
    {"generation"},
    {"model", "backends"},  # load(device="cuda") makes the backend's Model subclass
    {"bench", "cli", "compile", "predictor", "server"},
    {"__init__", "__main__"},
]
RANK = {name: i for i, layer in enumerate(LAYERS) for name in layer}
ROOT = pathlib.Path(npllama.__file__).parent


def top_of(path: pathlib.Path) -> str:
    """The layer name of a module file: its subpackage, or the top-level module's name."""
    parts = path.relative_to(ROOT).parts
    return parts[0] if len(parts) > 1 else path.stem


def imported_tops(path: pathlib.Path):
    """(line, layer name) of every npllama module that `path` imports, at any depth."""
    return imports_of(path.read_text(), list(path.relative_to(ROOT).parts[:-1]))


def imports_of(source: str, pkg: list):
    """(line, layer name) of every npllama module that `source`, a module of the subpackage
    `pkg` (a list of names; [] for the top), imports, in functions too."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = pkg[:len(pkg) - (node.level - 1)]
            target = base + (node.module.split(".") if node.module else [])
            if target:
                yield node.lineno, target[0]
            else:  # from . import x (at the package root): x is the module
                for alias in node.names:
                    yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("npllama."):
            yield node.lineno, node.module.split(".")[1]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("npllama."):
                    yield node.lineno, alias.name.split(".")[1]


def test_every_module_has_a_layer():
    names = {top_of(p) for p in ROOT.rglob("*.py")}
    assert names <= set(RANK), f"modules or packages without a layer: {sorted(names - set(RANK))}"


def test_packages_import_only_from_earlier_layers():
    wrong = []
    for path in sorted(ROOT.rglob("*.py")):
        here = top_of(path)
        for line, there in imported_tops(path):
            if RANK[there] > RANK[here]:
                wrong.append(f"{path.relative_to(ROOT)}:{line} ({here}) imports {there}")
    assert not wrong, "imports against the data flow:\n" + "\n".join(wrong)


def test_the_layer_check_sees_every_form_of_import():
    """The check itself, on sources it must resolve: relative at any depth, absolute, lazy."""
    assert list(imports_of("def f():\n    from ..generation import api\n", ["engine"])) == [(2, "generation")]
    assert list(imports_of("from . import block\nfrom .. import errors\n", ["engine"])) == [
        (1, "engine"), (2, "errors")]
    assert list(imports_of("from . import cli, model\n", [])) == [(1, "cli"), (1, "model")]
    assert list(imports_of("import npllama.text.chat\nfrom npllama.cache import kvpool\n", ["kernels"])) == [
        (1, "text"), (2, "cache")]
    assert RANK["generation"] > RANK["engine"] > RANK["kernels"]
