"""Train a tiny Llama with autopar's plan on CPU ranks, next to a single-device run.

    torchrun --nproc-per-node 4 examples/train_llama.py [--steps 5] [--model tiny-llama]

Every rank runs the same script: autopar plans the step for this machine (`Cluster.local()`,
after `autopar calibrate` if you have run it), rewrites the per-rank graph and trains. Rank 0
also trains the unchanged model on the whole batch and prints both losses per step.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import os

import torch
import torch.distributed as dist

import autopar
from autopar import models


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    parser.add_argument("--seq", type=int, default=32)
    args = parser.parse_args()

    # A dead or stuck rank makes the others fail after a minute instead of hanging forever.
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))

    model = models.build(args.model, seed=0)
    reference = copy.deepcopy(model)
    batch = models.example_inputs(args.model, batch=args.batch, seq=args.seq)

    pm = autopar.parallelize(model, world, example_inputs=batch)
    if rank == 0:
        print(pm.plan.summary().splitlines()[1])
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    for step in range(args.steps):
        loss = pm(*batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if rank == 0:
            ref_loss = reference(*batch)
            ref_loss.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            print(f"step {step}: autopar on {world} ranks {loss.item():.6f}   "
                  f"one device {ref_loss.item():.6f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
