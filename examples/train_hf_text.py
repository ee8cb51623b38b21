"""Train a small transformers Llama on real text with autopar, next to one device, and plot both.

    pip install -e '.[examples]'
    torchrun --nproc-per-node 4 examples/train_hf_text.py [--steps 60] [--layout dp=2,tp=2,sp=1]

The text is this repository's own documentation (README.md, docs/*.md and NOTES.md when
present), read as bytes: nothing is downloaded. Each sequence is a window of the text;
about a third of the rows are cut short, as documents shorter than the window are, and padded
with labels -100, so that each rank and micro-batch holds a different number of valid tokens.

Every rank runs the same script: autopar plans the step for this machine (or takes --layout),
rewrites the per-rank graph and trains; rank 0 also trains the unchanged model on the same
global batches. Rank 0 prints both losses per step, and writes results/train_hf_text.json and
(with matplotlib) results/train_hf_text.png with the two loss curves.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
import transformers

import autopar

ROOT = Path(__file__).resolve().parent.parent
TEXTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "NOTES.md"]


class CausalLM(torch.nn.Module):
    """(ids, labels) -> the next-token loss over the labels that are not -100."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, labels=labels, use_cache=False).loss


def corpus() -> torch.Tensor:
    """The text as byte tokens (0 is kept for padding)."""
    data = b"\n\n".join(p.read_bytes() for p in TEXTS if p.exists())
    return torch.tensor(list(data), dtype=torch.int64).clamp(min=1)


def batches(tokens: torch.Tensor, batch: int, seq: int, steps: int, seed: int = 0):
    """Global batches of windows; a third of the rows are cut short and padded (labels -100)."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        starts = torch.randint(0, len(tokens) - seq, (batch,), generator=gen)
        ids = torch.stack([tokens[s:s + seq] for s in starts.tolist()])
        labels = ids.clone()
        lengths = torch.randint(seq // 4, seq, (batch,), generator=gen)
        short = torch.rand(batch, generator=gen) < 1 / 3
        pad = short[:, None] & (torch.arange(seq)[None, :] >= lengths[:, None])
        yield ids.masked_fill(pad, 0), labels.masked_fill(pad, -100)


def parse_layout(text: str | None) -> autopar.Layout | None:
    if not text:
        return None
    fields = dict(kv.split("=") for kv in text.split(","))
    return autopar.Layout(**{k: (v in ("1", "true", "True")) if k == "sp" else int(v) for k, v in fields.items()})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch", type=int, default=16, help="global batch (sequences)")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--layout", default=None, help="e.g. dp=2,tp=2,sp=1 (default: the solver's)")
    parser.add_argument("--out", default=str(ROOT / "results" / "train_hf_text"))
    args = parser.parse_args()

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=90))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    transformers.logging.set_verbosity_error()

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=352,
                                      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=args.seq, pad_token_id=0)
    model = CausalLM(transformers.AutoModelForCausalLM.from_config(config))
    reference = copy.deepcopy(model)
    tokens = corpus()
    data = list(batches(tokens, args.batch, args.seq, args.steps))

    pm = autopar.parallelize(model, world, example_inputs=data[0], layout=parse_layout(args.layout))
    if rank == 0:
        print(f"{len(tokens):,} bytes of text; plan: {pm.plan.layout.short()}")
    opt = torch.optim.AdamW(pm.parameters(), lr=3e-3)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=3e-3)
    history = []
    for step, batch in enumerate(data):
        loss = pm(*batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if rank == 0:
            ref_loss = reference(*batch)
            ref_loss.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            history.append({"step": step, "autopar": loss.item(), "one_device": ref_loss.item()})
            print(f"step {step:3d}: autopar on {world} ranks {loss.item():.5f}   one device "
                  f"{ref_loss.item():.5f}")
    if rank == 0:
        _write(history, Path(args.out), f"{pm.plan.layout.short()} on {world} gloo ranks")
    dist.destroy_process_group()


def _write(history: list[dict], out: Path, label: str) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    worst = max(abs(h["autopar"] - h["one_device"]) / abs(h["one_device"]) for h in history)
    out.with_suffix(".json").write_text(json.dumps({"layout": label, "max_relative_difference": worst,
                                                    "steps": history}, indent=1))
    print(f"largest relative loss difference: {worst:.2e}; wrote {out.with_suffix('.json')}")
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[examples]'): no plot")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    steps = [h["step"] for h in history]
    ax.plot(steps, [h["one_device"] for h in history], label="one device", linewidth=3, alpha=0.5)
    ax.plot(steps, [h["autopar"] for h in history], label=f"autopar: {label}", linestyle="--")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (mean over valid tokens)")
    ax.set_title("tiny Llama (transformers) on this repository's text")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=120)
    print(f"wrote {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
