"""A small GLA language model written naively in plain PyTorch, trained with gla_inductor.

    python examples/gla_block.py [--device cuda] [--steps 5] [--no-timing]

The attention is the textbook time loop; nothing in the model knows about gla_inductor.
Compiled with `backend=gla_inductor.backend`, the loop becomes one GLA op per layer. At the end,
one layer and its attention alone are timed forward, eager against compiled, at T = 512.
"""

import argparse
import statistics
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


def progress(text):
    print(text, flush=True)


def sample(fn, calls, sync):
    """Seconds per call of fn, over `calls` calls."""
    sync()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    sync()
    return (time.perf_counter() - start) / calls


ROUNDS = 15


def compare(eager, compiled, sync, sample_s=0.02):
    """Eager and compiled timed in alternation, ROUNDS times, so that a busy machine slows both
    alike; each sample averages enough calls to last about `sample_s`. Returns the medians of both
    (seconds) and the sorted speed-ups of the rounds."""
    calls = [max(1, round(sample_s / sample(fn, 1, sync))) for fn in (eager, compiled)]
    times = [(sample(eager, calls[0], sync), sample(compiled, calls[1], sync)) for _ in range(ROUNDS)]
    ratios = sorted(e / c for e, c in times)
    return statistics.median(e for e, _ in times), statistics.median(c for _, c in times), ratios


def report(label, eager_s, compiled_s, ratios):
    q1, _, q3 = statistics.quantiles(ratios, n=4)
    spread = f"middle half {q1:.1f}-{q3:.1f}x, all {ratios[0]:.1f}-{ratios[-1]:.1f}x"
    print(f"  {label + ':':<16} eager {eager_s * 1e3:6.1f} ms, compiled {compiled_s * 1e3:5.1f} ms: "
          f"{statistics.median(ratios):4.1f}x faster ({spread})")


def time_layer(device, B=2, T=512, dim=256, heads=4):
    """Forward time of one block and of its attention alone, eager and compiled, at a size where
    the time loop dominates (K = V = 64)."""
    torch.manual_seed(0)
    block = GLABlock(dim, heads).to(device)
    x = torch.randn(B, T, dim, device=device)
    with torch.no_grad():
        h = block.norm1(x)
        q, k, v = block.qkv(h).view(B, T, 3, heads, dim // heads).unbind(2)
        g = F.logsigmoid(block.gate(h)).view(B, T, heads, dim // heads) / 16
    sync = torch.cuda.synchronize if device == "cuda" else lambda: None
    layer, attention = torch.compile(block, backend=gla_inductor.backend), torch.compile(
        block.attention, backend=gla_inductor.backend)

    progress(f"\ntiming: compiling one layer and its attention alone at T = {T} (Dynamo traces the {T} "
             "steps, ~15 s)")
    with torch.no_grad():
        layer(x), attention(q, k, v, g)
        progress(f"timing: eager and compiled forward in alternation, {ROUNDS} rounds (a few seconds)")
        results = [("one layer", *compare(lambda: block(x), lambda: layer(x), sync)),
                   ("attention alone", *compare(lambda: block.attention(q, k, v, g),
                                                lambda: attention(q, k, v, g), sync))]
    print(f"forward on {device} at B={B}, T={T}, H={heads}, K=V={dim // heads}, median of {ROUNDS} rounds:")
    for label, eager_s, compiled_s, ratios in results:
        report(label, eager_s, compiled_s, ratios)
    if any(q3 > 1.5 * q1 for q1, _, q3 in (statistics.quantiles(r[3], n=4) for r in results)):
        print("  the rounds disagree: other processes were using the cores; rerun on an idle machine")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--no-timing", action="store_true", help="skip the eager/compiled timing")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = TinyLM().to(args.device)
    tokens = torch.randint(0, 256, (4, args.seq + 1), device=args.device)

    progress("explain: compiling the model's forward once to see what the backend rewrites (the first "
             "run builds the CPU kernels, ~15 s; later runs reuse them)")
    print(gla_inductor.explain(model, tokens[:, :-1]))
    compiled = torch.compile(model, backend=gla_inductor.backend)
    progress("\ncompiling forward and backward for training (~5-10 s on the first run)")
    start = time.perf_counter()
    compiled(tokens[:, :-1]).sum().backward()
    print(f"compiled in {time.perf_counter() - start:.1f} s")

    losses = train(compiled, tokens, args.steps)
    print("training loss:", " ".join(f"{x:.3f}" for x in losses))
    assert losses[-1] < losses[0], "the loss should go down"
    if not args.no_timing:
        time_layer(args.device)


if __name__ == "__main__":
    main()
