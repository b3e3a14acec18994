"""A small GLA language model trained with its sequence split over 2 processes (context parallel).

    python examples/gla_context_parallel.py [--steps 5] [--seq 128] [--compile] [--dtensor]

Both processes hold the whole model and their half of every sequence. Everything but the
attention works token by token, so it runs on the local half unchanged; the attention's state
crosses the split through ``gla_inductor.distributed.context_parallel_gla`` (one all-gather of
[B, H, K, V] states per layer). Each rank's loss is the sum over its tokens divided by the
global token count, so the ranks' losses and gradients add up to the single-process ones: the
gradients are summed over the ranks before each optimizer step.

Process 0 also trains the same model, from the same initialization, in one process on the whole
sequence, with the attention as the textbook time loop (compiled with ``gla_inductor.backend``
under --compile, which rewrites the loop into one GLA op). The two losses are printed side by
side. Runs on CPU with gloo, or with NCCL on 2 GPUs when there are 2.
"""

import argparse
import copy
import datetime
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

import gla_inductor
from gla_inductor.distributed import context_parallel_gla

WORLD = 2
# NVLink multicast stays off on the multi-GPU machines, in every process this example starts
PROCESS_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}


def naive_gla(q, k, v, g):
    """q, k, g: [B, T, H, K]; v: [B, T, H, V]; S_t = diag(e^g_t) S_{t-1} + k_t^T v_t, o_t = q_t S_t / sqrt(K)."""
    B, T, H, K = q.shape
    S = q.new_zeros(B, H, K, v.shape[-1])
    o = torch.zeros_like(v)
    for t in range(T):
        S = S * g[:, t].exp()[..., None] + k[:, t, :, :, None] * v[:, t, :, None, :]
        o[:, t] = (q[:, t, :, :, None] * S).sum(-2) * K**-0.5
    return o


def sequence_parallel_gla(q, k, v, g):
    """The same map on this rank's slice of the sequence, the state passed between the ranks."""
    return context_parallel_gla(q, k, v, g)[0]


def dtensor_naive_gla(mesh):
    """The textbook loop itself, on this rank's slices as DTensors sharded over time (Shard(1)),
    compiled with gla_inductor.backend: the rewrite sees the placements and turns the loop into
    ``context_parallel_gla``. (Not eager: DTensor would run the loop's per-step writes o[:, t] on
    each rank's local indices.)"""
    loop = torch.compile(naive_gla, backend=gla_inductor.backend, fullgraph=True)

    def attention(q, k, v, g):
        q, k, v, g = (DTensor.from_local(x, mesh, [Shard(1)], run_check=False) for x in (q, k, v, g))
        return loop(q, k, v, g).to_local()

    return attention


class GLABlock(nn.Module):
    """Pre-norm block: projections, gated linear attention, output gate, MLP (as examples/gla_block.py)."""

    def __init__(self, dim: int, heads: int, attention):
        super().__init__()
        self.heads, self.head_dim, self.attention = heads, dim // heads, attention
        self.norm1, self.norm2 = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.gate = nn.Sequential(nn.Linear(dim, 16, bias=False), nn.Linear(16, dim))
        self.out_gate = nn.Linear(dim, dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        B, T, _ = x.shape
        h = self.norm1(x)
        q, k, v = self.qkv(h).view(B, T, 3, self.heads, self.head_dim).unbind(2)
        g = F.logsigmoid(self.gate(h)).view(B, T, self.heads, self.head_dim) / 16
        o = self.attention(q, k, v, g).reshape(B, T, -1)
        x = x + self.proj(o * F.silu(self.out_gate(h)))
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    def __init__(self, attention, vocab=256, dim=64, heads=2, layers=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(GLABlock(dim, heads, attention) for _ in range(layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def token_loss_sum(model, inputs, targets):
    logits = model(inputs)
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")


def train_single(model, tokens, steps) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(steps):
        loss = token_loss_sum(model, tokens[:, :-1], tokens[:, 1:]) / tokens[:, 1:].numel()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def train_sharded(model, tokens, steps, rank) -> list[float]:
    """Each rank trains on its contiguous slice of every sequence; gradients summed over the ranks."""
    inputs, targets = (x.chunk(WORLD, dim=1)[rank] for x in (tokens[:, :-1], tokens[:, 1:]))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(steps):
        loss = token_loss_sum(model, inputs, targets) / tokens[:, 1:].numel()
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
        opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item())
    return losses


def worker(rank: int, port: int, args) -> None:
    os.environ.update(PROCESS_ENV)
    cuda = torch.cuda.device_count() >= WORLD
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)  # the processes share the CPU's cores
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD, timeout=datetime.timedelta(seconds=120))
    torch.manual_seed(0)  # the same initialization and data on every rank
    sharded = TinyLM(sequence_parallel_gla).to(device)
    single = copy.deepcopy(sharded)
    single.blocks.apply(lambda m: setattr(m, "attention", naive_gla) if isinstance(m, GLABlock) else None)
    if args.dtensor:
        attention = dtensor_naive_gla(init_device_mesh(device.type, (WORLD,)))
        sharded.blocks.apply(lambda m: setattr(m, "attention", attention) if isinstance(m, GLABlock) else None)
    tokens = torch.randint(0, 256, (4, args.seq + 1), device=device)
    if args.compile:
        sharded = torch.compile(sharded, backend=gla_inductor.backend)
        single = torch.compile(single, backend=gla_inductor.backend)

    losses = train_sharded(sharded, tokens, args.steps, rank)
    rewrites = counters["gla_inductor"]["rewrites"]  # the sharded model's (the layers share one compiled loop)
    if rank == 0:
        reference = train_single(single, tokens, args.steps)
        print(f"{WORLD} ranks ({'NCCL' if cuda else 'gloo'}), sequence {args.seq} split in {WORLD}:")
        print(" step  sharded   one process")
        for step, (a, b) in enumerate(zip(losses, reference)):
            print(f"{step:5d}  {a:.6f}  {b:.6f}")
        worst = max(abs(a - b) / abs(b) for a, b in zip(losses, reference))
        print(f"largest relative difference: {worst:.1e}")
        assert worst < 1e-4, "the sharded run should follow the single-process one"
        assert losses[-1] < losses[0], "the loss should go down"
        if args.dtensor:
            print(f"the time loop on DTensors, rewritten into context parallelism: {rewrites} graph(s)")
            assert rewrites >= 1, "the loop on DTensors should have been rewritten"
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--compile", action="store_true", help="compile both models with gla_inductor.backend")
    parser.add_argument("--dtensor", action="store_true",
                        help="the sharded model's attention: the textbook loop on DTensors sharded over time, "
                             "compiled (rewritten into context parallelism)")
    args = parser.parse_args()
    os.environ.update(PROCESS_ENV)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(port, args), nprocs=WORLD)


if __name__ == "__main__":
    main()
