"""ParallelModule used as PyTorch users use a module, and misused as they misuse one, on 2 gloo
ranks (dp=2): keyword arguments, inputs in another memory layout (column-major token ids,
channels_last images), an optimizer over the original model's parameters, ranks passing
different data or batch sizes (an error on every rank, never a hang), a one-device state dict
loaded and the whole state read back. One spawn for all.
"""

import copy
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from runtime.launch import spawn


class TinyConvNet(nn.Module):
    """Conv2d -> ReLU -> mean-pool -> Linear; cross-entropy over 3 classes."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.head = nn.Linear(4, 3)

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.head(F.relu(self.conv(images)).mean(dim=(2, 3))), labels)


def _raises(fn, *needles: str) -> str | None:
    """None when ``fn()`` raises an InputError whose text holds every needle; else what happened."""
    from autopar.errors import InputError

    try:
        fn()
    except InputError as exc:
        missing = [n for n in needles if n not in str(exc)]
        return f"message lacks {missing}: {exc}" if missing else None
    except Exception as exc:  # noqa: BLE001 - reported as the failure it is
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _close(a, b) -> bool:
    return torch.allclose(a.detach(), b.detach(), rtol=1e-5, atol=1e-6)


def _worker(rank: int, world: int) -> dict:
    import autopar
    from autopar import models
    from autopar.execution.module import check_same_batch, guard_original

    failures, costs = [], {}
    layout = autopar.Layout(dp=world)
    # tiny-llama: keyword arguments, column-major token ids
    model = models.build("tiny-llama", seed=3)
    ref = copy.deepcopy(model)
    tokens, labels = models.example_inputs("tiny-llama", batch=4, seq=16)
    pm = autopar.parallelize(model, world, example_inputs=(tokens, labels), layout=layout)
    want = ref(tokens, labels)
    if not _close(pm(tokens=tokens, labels=labels), want):
        failures.append("keyword arguments: another loss")
    if not _close(pm(tokens, labels=labels), want):
        failures.append("mixed positional and keyword arguments: another loss")
    column_major = tokens.t().contiguous().t()
    assert not column_major.is_contiguous()
    if not _close(pm(column_major, labels), want):
        failures.append("column-major ids: another loss")
    for call, needles in ((lambda: pm(tokens=tokens, target=labels), ("forward(tokens, labels)",)),
                          (lambda: pm(tokens=tokens), ("2 positional inputs", "forward(tokens, labels)"))):
        problem = _raises(call, *needles)
        if problem:
            failures.append(f"bad keywords: {problem}")
    # an optimizer over the original model (the DDP habit) fails at its first step
    guard_original(model)
    problem = _raises(lambda: torch.optim.SGD(model.parameters(), lr=0.1).step(),
                      "opt = torch.optim.SGD(pm.parameters()")
    if problem:
        failures.append(f"optimizer over the original: {problem}")
    # ranks passing different data, or a batch of other shapes on one rank: an error everywhere
    other = tokens.clone()
    if rank == 1:
        other[0, 0] = (other[0, 0] + 1) % 64
    problem = _raises(lambda: pm(other, labels), "passed different data", "local_batch=True")
    if problem:
        failures.append(f"different data: {problem}")
    short = (tokens[:2], labels[:2]) if rank == 1 else (tokens, labels)
    problem = _raises(lambda: pm(*short), "rank 1 passed a batch whose shapes differ")
    if problem:
        failures.append(f"one rank's other shapes: {problem}")
    # what the check costs per call, against the step it guards
    start = time.perf_counter()
    for _ in range(20):
        check_same_batch((tokens, labels), pm.mesh, False, True, pm._input_shapes)
    costs["check"] = (time.perf_counter() - start) / 20
    start = time.perf_counter()
    for _ in range(3):
        pm(tokens, labels).backward()
    costs["step"] = (time.perf_counter() - start) / 3
    # a one-device state dict loads (whole tensors into each rank's shards) and comes back whole
    other_model = models.build("tiny-llama", seed=4)
    sd = other_model.state_dict()
    pm.load_state_dict(sd)
    if not _close(pm(tokens, labels), other_model(tokens, labels)):
        failures.append("load_state_dict of a one-device state dict: another loss")
    back = pm.full_state_dict()
    wrong = [k for k, v in sd.items() if not torch.equal(back[k], v)]
    if wrong or set(back) != set(sd):
        failures.append(f"full_state_dict after loading: {wrong[:3]} differ, keys {set(back) ^ set(sd)}")
    pm.load_full_state_dict(ref.state_dict())
    if not _close(pm(tokens, labels), want):
        failures.append("load_full_state_dict: another loss")
    # local_batch=True: each rank its own slice, of one size on every rank
    images = torch.randn(8, 3, 6, 6, generator=torch.Generator().manual_seed(rank))
    classes = torch.randint(0, 3, (8,), generator=torch.Generator().manual_seed(10 + rank))
    torch.manual_seed(0)
    conv = TinyConvNet()
    pm = autopar.parallelize(conv, world, example_inputs=(images.repeat(world, 1, 1, 1), classes.repeat(world)),
                             layout=layout, local_batch=True)
    ref = copy.deepcopy(conv)
    if not _close(pm(images.to(memory_format=torch.channels_last), classes), pm(images, classes)):
        failures.append("channels_last images: another loss")
    if not _close(pm.eval()(images, classes), ref.eval()(*_all_slices(images, classes, world))):
        failures.append("local_batch eval: not the global batch's loss")
    pm.train()
    uneven = (images[:6], classes[:6]) if rank == 0 else (images, classes)
    problem = _raises(lambda: pm(*uneven), "shapes differ")
    if problem:
        failures.append(f"local_batch, another size on one rank: {problem}")
    return {"failures": failures, "costs": costs}


def _all_slices(images, classes, world):
    """Every rank's slice, concatenated: rank r seeds its generators with r and 10 + r."""
    parts = [(torch.randn(8, 3, 6, 6, generator=torch.Generator().manual_seed(r)),
              torch.randint(0, 3, (8,), generator=torch.Generator().manual_seed(10 + r))) for r in range(world)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def test_misuse_is_caught_and_pytorch_habits_work(capsys):
    results = spawn(_worker, 2, timeout_s=600)
    for r in results:
        assert not r["failures"], r["failures"]
    with capsys.disabled():
        print("\nbatch check / step of tiny-llama (s) per rank:",
              [(round(r["costs"]["check"], 5), round(r["costs"]["step"], 4)) for r in results])


if __name__ == "__main__":
    pytest.main([__file__, "-q", "-s"])
