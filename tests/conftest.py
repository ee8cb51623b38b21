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
