"""The package layering: no import cycle anywhere, counting imports inside functions."""

import grimp
import networkx as nx


def test_no_import_cycles():
    # a type-only import (under TYPE_CHECKING) names a type and runs nothing: not a dependency
    graph = grimp.build_graph("autopar", "cost", "passes", "runtime", "vocab", exclude_type_checking_imports=True)
    edges = nx.DiGraph()
    for module in graph.modules:
        for imported in graph.find_modules_directly_imported_by(module):
            edges.add_edge(module, imported)
    cycles = list(nx.simple_cycles(edges))
    assert cycles == [], f"import cycles: {cycles[:5]}"
    # imports inside function bodies count too: the CLI imports the planner only when asked
    assert "autopar.planning.planner" in graph.find_modules_directly_imported_by("autopar.cli")


# The plan's vocabulary: the only modules of the project that passes and runtime may import.
VOCABULARY = {"vocab", "vocab.plan_types", "vocab.layout"}


def test_passes_and_runtime_import_only_the_vocabulary_torch_and_stdlib():
    """An allowlist, not a list of forbidden modules: a new module of cost/ or autopar/ is
    out of reach of the passes and the runtime until it is named here."""
    import sys

    graph = grimp.build_graph("autopar", "cost", "passes", "runtime", "vocab", exclude_type_checking_imports=True,
                              include_external_packages=True)
    allowed_roots = set(sys.stdlib_module_names) | {"torch"}
    wrong = []
    for package in ("passes", "runtime"):
        for module in graph.find_children(package) | graph.find_descendants(package) | {package}:
            for imported in graph.find_modules_directly_imported_by(module):
                root = imported.split(".")[0]
                if root == package or root in allowed_roots or imported in VOCABULARY:
                    continue
                wrong.append(f"{module} imports {imported}")
    assert wrong == [], "passes and runtime read the plan's vocabulary, torch and the standard library only: " + "; ".join(sorted(wrong))
