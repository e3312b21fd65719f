"""Train a small transformer with FSDP2 on CPU, checkpointing asynchronously; resume on another world size.

    torchrun --nproc-per-node 4 examples/train_fsdp.py --ckpt ckpt/fsdp --steps 20
    torchrun --nproc-per-node 2 examples/train_fsdp.py --ckpt ckpt/fsdp --steps 30

The whole training state (model, optimizer, LR scheduler, step counter, each
rank's data sampler and RNG states) is one ``tsckpt.torch.TrainState``. A
``CheckpointManager`` saves it every ``--every`` steps with ``save_async``:
the loop waits only while the state is copied to host memory, and the write
and commit go on in the background while it trains. The first run trains 20
steps on 4 ranks; the second finds step 20, restores it in place into a model
sharded over 2 ranks (each rank reads only its shards) and trains to step 30.
Without torchrun it runs in a single process, no process group.
"""

from __future__ import annotations

import argparse
import math
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import tsckpt.torch

VOCAB, CTX, DIM, LAYERS, HEADS, BATCH = 64, 16, 64, 2, 4, 16


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.qkv, self.proj = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, HEADS, c // HEADS).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, DIM), nn.Embedding(CTX, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.tok.weight  # tied: stored once in the checkpoint
        nn.init.normal_(self.tok.weight, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))


class Sampler:
    """Draws global batches from its own generator; this rank takes its slice."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        self.gen = torch.Generator().manual_seed(0)
        self.seen = 0
        zipf = 1.0 / torch.arange(1, VOCAB + 1)  # a skewed token distribution: something to learn fast
        self.data = torch.multinomial(zipf, 5000, replacement=True, generator=torch.Generator().manual_seed(1))

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(0, len(self.data) - CTX - 1, (BATCH,), generator=self.gen)
        rows = torch.stack([self.data[s : s + CTX + 1] for s in starts.tolist()])
        per = BATCH // self.world
        rows = rows[self.rank * per : (self.rank + 1) * per]
        self.seen += len(rows)
        return rows[:, :-1], rows[:, 1:]

    def state_dict(self) -> dict:
        return {"gen": self.gen.get_state(), "seen": self.seen}

    def load_state_dict(self, state: dict) -> None:
        self.gen.set_state(state["gen"])
        self.seen = int(state["seen"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", required=True, help="checkpoint root: resumes from its latest step, if any")
    ap.add_argument("--steps", type=int, default=20, help="train until this step")
    ap.add_argument("--every", type=int, default=5, help="save every this many steps")
    args = ap.parse_args()

    torch.set_num_threads(1)
    distributed = "WORLD_SIZE" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)

    torch.manual_seed(0)
    model = GPT()
    if distributed:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for blk in model.blocks:
            fully_shard(blk, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, 30) / 30)))
    sampler = Sampler(rank, world)

    state = tsckpt.torch.TrainState(model, opt, extra={"scheduler": sched}, per_rank={"sampler": sampler})
    manager = tsckpt.CheckpointManager(args.ckpt, keep_last=2)
    step = 0
    if manager.latest_step() is not None:
        step = manager.restore(target=state)  # the latest complete step, straight into the live objects
        if rank == 0:
            print(f"resumed {args.ckpt} at step {step} on {world} rank(s)")

    while step < args.steps:
        x, y = sampler.next()
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        step += 1
        loss = loss.detach()
        if distributed:
            dist.all_reduce(loss)
            loss /= world
        if rank == 0 and (step % 5 == 0):
            print(f"step {step:3d}  loss {loss.item():.4f}  lr {sched.get_last_lr()[0]:.2e}")
        if step % args.every == 0 or step == args.steps:
            manager.save_async(step, state)  # every rank; returns once the state is staged

    manager.close()  # waits for the last save's commit (and raises if it failed)
    if rank == 0:
        print(f"saved steps {manager.all_steps()} to {args.ckpt}")
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
