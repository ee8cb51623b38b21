"""The package layering: no import cycle anywhere, counting imports inside functions."""

import grimp
import networkx as nx


def test_no_import_cycles():
    graph = grimp.build_graph("autopar", "cost", "passes", "runtime")
    edges = nx.DiGraph()
    for module in graph.modules:
        for imported in graph.find_modules_directly_imported_by(module):
            edges.add_edge(module, imported)
    cycles = list(nx.simple_cycles(edges))
    assert cycles == [], f"import cycles: {cycles[:5]}"
    # imports inside function bodies count too: the CLI imports the benchmarks only when asked
    assert "autopar.bench.cost_model" in graph.find_modules_directly_imported_by("autopar.cli")
