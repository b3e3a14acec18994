"""A small GLA language model written naively in plain PyTorch, trained with gla_inductor.

    python examples/gla_block.py [--device cuda] [--steps 5]

The attention is the textbook time loop; nothing in the model knows about gla_inductor.
Compiled with `backend=gla_inductor.backend`, the loop becomes one GLA op per layer.
"""

import argparse
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import gla_inductor


class GLABlock(nn.Module):
    """Pre-norm block: projections, a gated linear attention loop, output gate, MLP."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.norm1, self.norm2 = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.gate = nn.Sequential(nn.Linear(dim, 16, bias=False), nn.Linear(16, dim))
        self.out_gate = nn.Linear(dim, dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def attention(self, q, k, v, g):
        # q, k, g: [B, T, H, K]; v: [B, T, H, V]; the recurrence S_t = diag(e^g_t) S + k_t^T v_t.
        B, T, H, K = q.shape
        S = q.new_zeros(B, H, K, v.shape[-1])
        o = torch.zeros_like(v)
        for t in range(T):
            S = S * g[:, t].exp()[..., None] + k[:, t, :, :, None] * v[:, t, :, None, :]
            o[:, t] = (q[:, t, :, :, None] * S).sum(-2) * K**-0.5
        return o

    def forward(self, x):
        B, T, _ = x.shape
        h = self.norm1(x)
        q, k, v = self.qkv(h).view(B, T, 3, self.heads, self.head_dim).unbind(2)
        g = F.logsigmoid(self.gate(h)).view(B, T, self.heads, self.head_dim) / 16
        o = self.attention(q, k, v, g).reshape(B, T, -1)
        x = x + self.proj(o * F.silu(self.out_gate(h)))
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    def __init__(self, vocab=256, dim=64, heads=2, layers=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(GLABlock(dim, heads) for _ in range(layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def train(model, tokens, steps):
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(steps):
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def timed(fn, repeat=3):
    fn()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--seq", type=int, default=32)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = TinyLM().to(args.device)
    tokens = torch.randint(0, 256, (4, args.seq + 1), device=args.device)

    print(gla_inductor.explain(model, tokens[:, :-1]))
    compiled = torch.compile(model, backend=gla_inductor.backend)
    start = time.perf_counter()
    compiled(tokens[:, :-1]).sum().backward()
    print(f"\ncompile (forward + backward): {time.perf_counter() - start:.1f} s")

    losses = train(compiled, tokens, args.steps)
    print("training loss:", " ".join(f"{x:.3f}" for x in losses))
    assert losses[-1] < losses[0], "the loss should go down"

    step = lambda m: m(tokens[:, :-1]).sum().backward()  # noqa: E731
    eager_s, compiled_s = timed(lambda: step(model)), timed(lambda: step(compiled))
    print(f"forward + backward: eager {eager_s * 1e3:.1f} ms, compiled {compiled_s * 1e3:.1f} ms "
          f"({eager_s / compiled_s:.1f}x)")


if __name__ == "__main__":
    main()
