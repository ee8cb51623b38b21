"""The training step returns what the module returns, in its structure.

A forward returning ``(loss, logits)``, a dict (with a None field and a scalar metric) and a
transformers ModelOutput: ``pm(*batch)`` gives back the same structure, the step's loss in the
loss's place (equal to one device's on the whole batch), every other tensor equal to one
device's on this rank's slice of the batch (DDP's semantics; whole logits under TP), the
micro-batches' values concatenated, a float mean over the batch and a weight's norm averaged,
a float sum over the batch and an int32 count summed, a loss over the labels a mask keeps
weighted by each micro-batch's kept labels, each in its dtype, under a pipeline on every rank;
a copy of the loss (over its normaliser, which counts labels the ranks ignore unevenly) is the
step's value on every rank, as the loss is;
gradients and SGD updates as on one device (only the loss is differentiated). Layouts
dp=2 x grad_accum=2, tp=2 and pp=2 x grad_accum=2 on two gloo ranks (one spawn).
"""

import copy

import torch
import torch.nn.functional as F
from parity_checks import close, sgd, train_and_compare
from torch import nn
from torch.utils import _pytree as pytree

from runtime.launch import spawn

V = 16


class Own(nn.Module):
    """Embedding, MLP, vocabulary head; returns (loss, logits) or a dict."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        torch.manual_seed(4)
        self.emb, self.mlp = nn.Embedding(V, 16), nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 16))
        self.head = nn.Linear(16, V)
        self.kind = kind

    def forward(self, ids, labels):
        logits = self.head(self.mlp(self.emb(ids)))
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        if self.kind == "tuple":
            return loss, logits
        energy = logits.pow(2).mean()  # a scalar metric (argmax over TP-sharded logits is refused)
        count = (logits > 0).sum().to(torch.int32)  # an int32 count: summed, kept int32
        return {"logits": logits, "loss": loss, "past": None, "energy": energy,
                "hidden": self.emb(ids) * 2, "count": count,
                "total": logits.pow(2).sum(),  # a float sum over the batch: summed
                "norm": self.head.weight.norm(),  # no batch in it: alike in every micro-batch
                "masked": self._masked_loss(logits, labels),
                "copy": loss.detach() * 2}  # over the loss's normaliser: the step's, as the loss

    @staticmethod
    def _masked_loss(logits, labels):
        """The cross-entropy over the labels that are not 0: a ratio of batch sums, its
        micro-batches weighted by their kept labels (`_batch` keeps fewer in the first rows)."""
        keep = (labels != 0).float()
        per_token = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none")
        return (per_token * keep.flatten()).sum() / keep.sum()


def _batch(rows: int = 8, seq: int = 6):
    g = torch.Generator().manual_seed(7)
    ids, labels = torch.randint(0, V, (rows, seq), generator=g), torch.randint(0, V, (rows, seq), generator=g)
    labels[:2, :4] = 0  # the first micro-batch keeps fewer labels than the others
    labels[0, :5] = -100  # ignored by the cross-entropy: its count differs over the dp ranks
    return ids, labels


def _same_outputs(out, ref_slice, ref_loss, loss_leaf: int, label) -> list[tuple]:
    """``out`` has the structure of ``ref_slice``; its loss leaf is ``ref_loss``, every other
    leaf that of ``ref_slice``."""
    leaves, spec = pytree.tree_flatten(out)
    ref_leaves, ref_spec = pytree.tree_flatten(ref_slice)
    if spec != ref_spec or type(out) is not type(ref_slice):
        return [(*label, "structure", str(spec), str(ref_spec))]
    failures = []
    for i, (a, b) in enumerate(zip(leaves, ref_leaves)):
        b = ref_loss if i == loss_leaf else b
        if isinstance(b, torch.Tensor):
            if (not isinstance(a, torch.Tensor) or a.shape != b.shape or a.dtype != b.dtype
                    or not close(a.float(), b.detach().float())):
                failures.append((*label, f"leaf {i}", getattr(a, "shape", a), tuple(b.shape)))
            elif i != loss_leaf and a.requires_grad:
                failures.append((*label, f"leaf {i} requires grad"))
        elif a != b:
            failures.append((*label, f"leaf {i}", a, b))
    return failures


def _check(make, batch, degrees: dict, label) -> list[tuple]:
    """One step's outputs against one device's, then the training parity (SGD)."""
    import autopar

    model = make()
    ref = copy.deepcopy(model)
    world = torch.distributed.get_world_size()
    pm = autopar.parallelize(model, world, example_inputs=batch, layout=autopar.Layout(**degrees))
    label = (*label, pm.plan.layout.short())
    dp, rank = pm.plan.layout.dp, torch.distributed.get_rank()
    mine = tuple(x.chunk(dp)[rank // (world // dp)] for x in batch)
    out = pm(*batch)
    with torch.no_grad():
        ref_loss, ref_slice = pytree.tree_leaves(ref(*batch))[_loss_leaf(ref(*batch))], ref(*mine)
    if isinstance(ref_slice, dict) and "copy" in ref_slice:  # the step's value, as the loss
        ref_slice = {**ref_slice, "copy": ref_loss * 2}
    failures = _same_outputs(out, ref_slice, ref_loss, _loss_leaf(ref_slice), label)
    return failures + train_and_compare(_Loss(pm), _Loss(ref), batch, label, steps=2, optimizers=(sgd,))


def _loss_leaf(out) -> int:
    """Where the loss sits among an output's leaves: a mapping's "loss", else the first."""
    leaves = pytree.tree_leaves(out)
    if hasattr(out, "keys"):
        return next(i for i, x in enumerate(leaves) if x is out["loss"])
    return 0


class _Loss(nn.Module):
    """The module's loss alone (what `train_and_compare` steps on), its parameters the same."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *batch):
        out = self.inner(*batch)
        return out if isinstance(out, torch.Tensor) else pytree.tree_leaves(out)[_loss_leaf(out)]


def _hf():
    from hf_tiny import build

    return build("llama", seed=2, output=True)


def _worker(rank: int, world: int, layouts: list[tuple[dict, tuple[str, ...]]]) -> list[tuple]:
    from hf_tiny import batch as hf_batch

    failures = []
    for degrees, kinds in layouts:
        for kind in kinds:
            failures += _check(lambda k=kind: Own(k), _batch(), degrees, ("own", kind))
        failures += _check(_hf, hf_batch(size=4, seq=8), degrees, ("hf llama",))
    return failures


def test_outputs_in_the_module_structure_on_two_ranks():
    # the dict's "hidden" is made on the first pipeline stage, its logits on the last
    layouts = [({"dp": 2, "grad_accum": 2}, ("tuple", "dict")), ({"tp": 2}, ("tuple",)),
               ({"pp": 2, "grad_accum": 2}, ("dict",))]
    assert spawn(_worker, 2, (layouts,), timeout_s=900) == [[], []]
