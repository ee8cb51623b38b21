"""Check example inputs against the model before any tracing."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence

import torch
from torch import nn

from autopar.errors import InputError

IGNORE_INDEX = -100  # labels cross_entropy leaves out of the loss and of its mean


def validate_inputs(
    model: nn.Module, example_inputs: Sequence, loss_fn: Callable | None = None
) -> None:
    """Raise `InputError` when the example inputs cannot be a call of ``model``.

    Checks the argument count against ``forward``'s signature, that every input is a tensor,
    and, for models that carry a ``config`` with a vocabulary (the zoo), the token and label
    shapes, dtypes, sequence length and (on real tensors) the token range.
    """
    if not isinstance(model, nn.Module):
        raise InputError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(example_inputs, (tuple, list)):
        raise InputError(
            f"example_inputs must be a tuple of tensors, got {type(example_inputs).__name__}; "
            "wrap a single tensor as (x,)"
        )
    for i, x in enumerate(example_inputs):
        if not isinstance(x, torch.Tensor):
            raise InputError(f"example_inputs[{i}] is a {type(x).__name__}, not a tensor")
    call_args = example_inputs[:-1] if loss_fn is not None else example_inputs
    try:
        inspect.signature(model.forward).bind(*call_args)
    except TypeError as exc:
        raise InputError(
            f"{type(model).__name__}.forward{inspect.signature(model.forward)} cannot take "
            f"{len(call_args)} example inputs: {exc}"
        ) from None
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "vocab") and hasattr(config, "max_seq"):
        _validate_token_inputs(config, example_inputs)


def _validate_token_inputs(config, example_inputs: Sequence[torch.Tensor]) -> None:
    """Zoo language models take (tokens, labels), int64 [batch, seq] with seq <= max_seq."""
    names = ("tokens", "labels")
    for name, x in zip(names, example_inputs):
        if x.dtype not in (torch.int64, torch.int32):
            raise InputError(
                f"{name} must be integer token ids (torch.int64), got {x.dtype}: build them with "
                f"autopar.models.example_inputs({config.name!r}, ...)"
            )
        if x.dim() != 2:
            raise InputError(f"{name} must be [batch, seq], got shape {list(x.shape)}")
        if x.shape[1] > config.max_seq:
            raise InputError(
                f"{name} have sequence length {x.shape[1]} > {config.name}'s max_seq "
                f"{config.max_seq}: shorten the sequence"
            )
        if x.device.type == "meta" or not x.numel():
            continue
        # labels may be -100: cross_entropy's ignore_index (padding, prompt tokens)
        ids = x[x != IGNORE_INDEX] if name == "labels" else x
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= config.vocab):
            allowed = f"[0, {config.vocab})" + (f" or {IGNORE_INDEX} (ignored)" if name == "labels" else "")
            raise InputError(
                f"{name} hold ids outside {allowed} (min {int(ids.min())}, max {int(ids.max())}): "
                f"the vocabulary of {config.name} has {config.vocab} tokens"
            )
    if len(example_inputs) >= 2 and example_inputs[0].shape != example_inputs[1].shape:
        raise InputError(
            f"tokens {list(example_inputs[0].shape)} and labels {list(example_inputs[1].shape)} "
            "must have the same shape"
        )
