"""Steps of llama-shaped zoo models captured on the meta device, for cost-model tests."""

from __future__ import annotations

import dataclasses

import torch

from autopar import models
from autopar.search.step import captured_step


def llama_like(batch: int, seq: int, **shape):
    """(model, its bf16 captured step) of llama3-8b's family with ``shape`` overriding its
    config (n_layers, hidden, vocab, ...), on the meta device."""
    cfg = dataclasses.replace(models.config("llama3-8b"), **shape)
    model = models.build(cfg, device="meta", dtype=torch.bfloat16)
    inputs = models.example_inputs(cfg, batch=batch, seq=seq, device="meta")
    return model, captured_step(model, inputs, None, torch.bfloat16)
