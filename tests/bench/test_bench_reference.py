"""The benchmarks' reference files: every table names its source, and the loader says when one
does not or a table is missing."""

from __future__ import annotations

import pytest

from bench.reference import (
    ReferenceDataError,
    check_sources,
    load_reference,
    reference_table,
)


@pytest.mark.parametrize("name", ["cost_model", "solver"])
def test_every_table_names_its_source(name):
    doc = load_reference(name)
    assert doc["source"].strip()
    tables = {k: v for k, v in doc.items() if isinstance(v, dict)}
    assert tables
    for table in tables.values():
        assert table["source"].strip()


def test_missing_source_or_table_is_an_error():
    with pytest.raises(ReferenceDataError, match="top-level"):
        check_sources({"t": {"source": "x"}}, "f.json")
    with pytest.raises(ReferenceDataError, match="table 't'"):
        check_sources({"source": "x", "t": {"values": [1]}}, "f.json")
    with pytest.raises(ReferenceDataError, match="table 't'"):
        check_sources({"source": "x", "t": {"source": " "}}, "f.json")
    check_sources({"source": "x", "t": {"source": "y"}, "role": "text"}, "f.json")
    with pytest.raises(ReferenceDataError, match="no table"):
        reference_table("cost_model", "not-a-table")
