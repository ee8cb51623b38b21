"""The benchmarks' reference data: published numbers kept in JSON files under ``data/``.

One file per benchmark (``cost_model.json``, ``solver.json``). Each has a top-level ``source``
naming where its numbers come from, and every table in it carries its own ``source``, so a
number can be traced to its publication without reading the code that compares against it.
"""

from __future__ import annotations

import json
from functools import cache
from importlib import resources


class ReferenceDataError(ValueError):
    """A reference file is missing a source, or a table it should hold."""


@cache
def load_reference(name: str) -> dict:
    """The parsed ``data/<name>.json``; ReferenceDataError if it or a table lacks a source.

    Read through importlib.resources so that it works from a wheel as well as from the tree.
    Cached: the benchmarks look tables up repeatedly and the file does not change during a run.
    """
    text = resources.files(__package__).joinpath("data", f"{name}.json").read_text("utf-8")
    doc = json.loads(text)
    check_sources(doc, f"data/{name}.json")
    return doc


def check_sources(doc: dict, where: str) -> None:
    """ReferenceDataError unless ``doc`` and every table (dict) in it name a non-empty source:
    a number without a source cannot be checked against its publication."""
    if not isinstance(doc.get("source"), str) or not doc["source"].strip():
        raise ReferenceDataError(f"{where} has no top-level 'source'")
    for key, value in doc.items():
        if isinstance(value, dict) and not (isinstance(value.get("source"), str)
                                            and value["source"].strip()):
            raise ReferenceDataError(f"{where}: table {key!r} has no 'source'")


def reference_table(name: str, table: str) -> dict:
    """One table of ``data/<name>.json`` (a dict with its own ``source``)."""
    doc = load_reference(name)
    if table not in doc:
        raise ReferenceDataError(f"data/{name}.json has no table {table!r}")
    return doc[table]
