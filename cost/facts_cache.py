"""The values the cost model derives from one `StepFacts` and reuses across layouts.

A search prices thousands of layouts of one step; most share their node times, pipeline cut,
saved bytes or recompute choice with many others. `StepFacts.cache` (a `FactsCache`) keeps
each such value once, under its kind (`KINDS`: what the value is) and the key parts that
determine it (the layout's degrees, the cluster's parameters where it reads them).

What invalidates an entry: nothing in place: the facts' tables are never changed once built,
and every key names all it depends on. A new facts object (`StepFacts.rebatch`,
`dataclasses.replace`) starts with an empty cache (the field is not an init argument, so a
copy never shares its original's). A calibration that prices the same facts under new cost
parameters drops the cluster-dependent entries (`drop_cluster_dependent`) to bound memory; the
kinds that depend on the graph and the degrees alone (`GRAPH_ONLY`) stay.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, TypeVar

T = TypeVar("T")

Kind = Literal[
    "times", "fp8_choice", "one_chunk", "chunk_map", "chunk_map_memory", "stage_map",
    "stage_params", "param_slots", "block_params", "local_saved", "columns", "rebuilt_sweep",
    "recompute_choices", "knapsack", "tp_comm", "tp_small_sites", "slot_index", "chunks", "choices",
]

# kind -> what its value is (the module that builds it)
KINDS: dict[str, str] = {
    "times": "kernel seconds of every node for one micro-batch (terms.compute.node_times)",
    "fp8_choice": "the FP8 groups 'auto' runs in FP8 (autopar.search.choices.choose_fp8)",
    "one_chunk": "the slot -> chunk map without a pipeline (terms.compute.slot_chunks)",
    "chunks": "a chosen cut's slot -> chunk map as an array (terms.compute.slot_chunks)",
    "chunk_map": "the pipeline cut balancing time, with the slots' seconds (search.choices)",
    "chunk_map_memory": "the cut balancing time under each stage's memory (search.choices)",
    "choices": "a layout with its open choices made (autopar.search.choices.choose)",
    "stage_map": "slot -> pipeline rank under virtual stages (terms.compute.slot_stages)",
    "stage_params": "parameters held by each stage (terms.compute.params_per_stage)",
    "param_slots": "each parameter's local size by slot (terms.compute._param_slots)",
    "block_params": "parameters of one block on one device (terms.common.block_params)",
    "local_saved": "bytes of each saved row on one device (terms.recompute.local_saved_bytes)",
    "columns": "kept, rebuilt and rerun rows of a recompute choice (terms.recompute.columns)",
    "rebuilt_sweep": "the order of a choice's rebuilt spans (terms.recompute.choice_sweep)",
    "recompute_choices": "'auto's choice per stage of a layout (search.recompute_choice)",
    "knapsack": "a stage's knapsack inputs (search.recompute_choice.knapsack_choice's cache)",
    "tp_comm": "exposed and hidden TP seconds per stage (terms.tensor_parallel.tp_comm)",
    "tp_small_sites": "the replicated block weights SP all-reduces (terms.tensor_parallel)",
    "slot_index": "the slot of each row of a facts table's block column (terms.compute.stage_of)",
}
# the kinds that depend on the graph and the layout's degrees only, never on the cluster
GRAPH_ONLY = frozenset({"block_params", "tp_small_sites", "columns", "rebuilt_sweep",
                        "param_slots", "one_chunk", "slot_index", "chunks"})


class FactsCache:
    """Values derived from one `StepFacts`, each built once: ``get(kind, key, build)``."""

    def __init__(self) -> None:
        self._values: dict[tuple, Any] = {}

    def get(self, kind: Kind, key: tuple, build: Callable[[], T]) -> T:
        """The value of ``kind`` under ``key``; ``build()`` the first time it is asked."""
        full = (kind, *key)
        try:
            return self._values[full]
        except KeyError:
            value = self._values[full] = build()
            return value

    def keys(self, kind: Kind) -> list[tuple]:
        """The keys held under ``kind`` (without the kind)."""
        return [k[1:] for k in self._values if k[0] == kind]

    def put(self, kind: Kind, key: tuple, value: Any) -> None:
        """Replace a value (a test that prices a given cut)."""
        self._values[(kind, *key)] = value

    def drop(self, *kinds: Kind) -> None:
        """Forget every value of ``kinds``."""
        for k in [k for k in self._values if k[0] in kinds]:
            del self._values[k]

    def drop_cluster_dependent(self) -> None:
        """Forget what depends on the cluster or its cost parameters (all but `GRAPH_ONLY`)."""
        self.drop(*(k for k in KINDS if k not in GRAPH_ONLY))

    def __len__(self) -> int:
        return len(self._values)
