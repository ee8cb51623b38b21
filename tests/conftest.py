"""Shared fixtures: captured steps of small real-shaped models, built once per session."""

import dataclasses

import pytest
import torch

from autopar import models
from autopar.search.step import step_facts


def _small(name: str, layers: int = 2, **changes):
    """A zoo config with fewer layers (and any other changes): real widths, quick to capture."""
    return dataclasses.replace(models.config(name), n_layers=layers, **changes)


@pytest.fixture(scope="session")
def llama_step():
    """llama3-8b widths, 2 layers, batch 16 x seq 1024, captured in bf16."""
    cfg = _small("llama3-8b")
    model = models.build(cfg, device="meta", dtype=torch.bfloat16)
    inputs = models.example_inputs(cfg, batch=16, seq=1024, device="meta")
    step, _ = step_facts(model, inputs, None, torch.bfloat16)
    return cfg, model, inputs, step


def _starts_ranks(path) -> bool:
    """Whether a test file launches gloo ranks (directly or through the parity harness)."""
    text = path.read_text()
    return "spawn(" in text or "parity_checks" in text


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (``-n 2 --dist loadgroup``, the default of pyproject.toml), every test
    that launches ranks runs in one worker, one after the other: two worlds at once would
    oversubscribe a 2-core machine and push collectives towards their timeouts, while the
    single-process tests share the other core."""
    seen: dict = {}
    for item in items:
        path = item.path
        if path not in seen:
            seen[path] = _starts_ranks(path)
        if seen[path]:
            item.add_marker(pytest.mark.xdist_group("ranks"))
