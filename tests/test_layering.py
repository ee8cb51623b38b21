"""The package layering: no import cycle anywhere, counting imports inside functions."""

import grimp
import networkx as nx


def test_no_import_cycles():
    # a type-only import (under TYPE_CHECKING) names a type and runs nothing: not a dependency
    graph = grimp.build_graph("autopar", "cost", "passes", "runtime", exclude_type_checking_imports=True)
    edges = nx.DiGraph()
    for module in graph.modules:
        for imported in graph.find_modules_directly_imported_by(module):
            edges.add_edge(module, imported)
    cycles = list(nx.simple_cycles(edges))
    assert cycles == [], f"import cycles: {cycles[:5]}"
    # imports inside function bodies count too: the CLI imports the planner only when asked
    assert "autopar.planning.planner" in graph.find_modules_directly_imported_by("autopar.cli")
