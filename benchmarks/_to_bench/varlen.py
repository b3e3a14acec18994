"""GPU benchmark of packed variable-length sequences (``chunk_gla(..., cu_seqlens=...)``).

    python benchmarks/_to_bench/varlen.py [--out varlen.json] [--rep 50]

Per case (bf16, H = 16, K = V = 128, layout [1, T, H, D] packed), median ms of:
  * ours packed: ``gla_inductor.chunk_gla`` with cu_seqlens, vector gate (forward, forward + backward,
    forward with the prefix states every 64 steps) and scalar gate (forward);
  * FLA packed (if ``fla`` imports): ``fla.ops.gla.chunk_gla`` and ``fla.ops.simple_gla.chunk_simple_gla``
    with the same cu_seqlens;
  * ours fixed-length at the same total tokens: [N, L] for N equal sequences of L steps, and
    [1, T] for the mixed case (what packing should cost nothing against).
Each timed two ways: ``triton.testing.do_bench`` (host launch overhead included) and CUDA-graph
replays (``do_bench_cudagraph``, the GPU time alone; None where the call cannot be captured).
The cases are the issue's anchors: 8 x 2048 packed, and 12 mixed-length sequences (25.7k tokens).
Targets: packed forward >= 2.5x FLA chunk_gla, forward + backward >= 2x, scalar gate >= 1.5x
chunk_simple_gla, and packed within 1.1x of our fixed-length time at equal tokens.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F

H, K, V = 16, 128, 128
DTYPE = torch.bfloat16
CASES = {
    "8x2048": [2048] * 8,
    # 12 mixed lengths, 25.7k tokens: long and short, lengths off the chunk grid, one single step
    "mixed12": [4096, 517, 3001, 1024, 64, 2048, 5999, 1, 777, 2500, 3900, 1773],
}


def bench(fn, rep: int) -> dict:
    from triton.testing import do_bench, do_bench_cudagraph

    out = {"ms": do_bench(fn, warmup=10, rep=rep, return_mode="median")}
    try:
        out["graph_ms"] = do_bench_cudagraph(fn, rep=rep, return_mode="median")
    except Exception as e:  # noqa: BLE001 - a call that synchronizes cannot be captured
        out["graph_ms"] = None
        out["graph_error"] = f"{type(e).__name__}: {e}"[:200]
    return out


def inputs(B: int, T: int, gate: str):
    q, k = (torch.randn(B, T, H, K, device="cuda", dtype=DTYPE) for _ in range(2))
    v = torch.randn(B, T, H, V, device="cuda", dtype=DTYPE)
    shape = (B, T, H, K) if gate == "vector" else (B, T, H)
    g = (F.logsigmoid(torch.randn(shape, device="cuda")) / 16).to(DTYPE if gate == "vector" else torch.float32)
    return [x.requires_grad_() for x in (q, k, v, g)]


def forward_fn(fn, args, **kwargs):
    def run():
        with torch.no_grad():
            fn(*args, **kwargs)
    return run


def train_fn(fn, args, **kwargs):
    o = fn(*args, **kwargs)[0]
    do = torch.randn_like(o)

    def run():
        o = fn(*args, **kwargs)[0]
        torch.autograd.grad(o, args, do)
    return run


def case_results(lengths: list[int], rep: int) -> dict:
    import gla_inductor

    N, T = len(lengths), sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
    res = {"lengths": lengths, "tokens": T}
    vec, sca = inputs(1, T, "vector"), inputs(1, T, "scalar")
    ours = gla_inductor.chunk_gla
    res["ours_packed_fwd"] = bench(forward_fn(ours, vec, cu_seqlens=cu), rep)
    res["ours_packed_fwdbwd"] = bench(train_fn(ours, vec, cu_seqlens=cu), rep)
    res["ours_packed_scalar_fwd"] = bench(forward_fn(ours, sca, cu_seqlens=cu), rep)
    # the forward that also stores every sequence's state each 64 steps (prefix caching)
    res["ours_packed_prefix_states_fwd"] = bench(forward_fn(ours, vec, cu_seqlens=cu, output_prefix_states=True), rep)
    # fixed length at the same tokens: N x L where the sequences are equal, else one sequence of T
    B, L = (N, lengths[0]) if len(set(lengths)) == 1 else (1, T)
    fixed_vec, fixed_sca = inputs(B, L, "vector"), inputs(B, L, "scalar")
    res["fixed_shape"] = [B, L]
    res["ours_fixed_fwd"] = bench(forward_fn(ours, fixed_vec), rep)
    res["ours_fixed_fwdbwd"] = bench(train_fn(ours, fixed_vec), rep)
    res["ours_fixed_scalar_fwd"] = bench(forward_fn(ours, fixed_sca), rep)
    try:
        from fla.ops.gla import chunk_gla as fla_gla
        from fla.ops.simple_gla import chunk_simple_gla as fla_simple
    except ImportError as e:
        res["fla"] = f"not available: {e}"
        return res
    cu64 = cu.long()
    res["fla_packed_fwd"] = bench(forward_fn(fla_gla, vec, cu_seqlens=cu64), rep)
    res["fla_packed_fwdbwd"] = bench(train_fn(fla_gla, vec, cu_seqlens=cu64), rep)
    res["fla_simple_packed_fwd"] = bench(forward_fn(fla_simple, sca, cu_seqlens=cu64), rep)
    return res


def check_correctness(lengths: list[int]) -> float:
    """Max relative error of our packed forward against FLA's, or against our per-sequence calls."""
    import gla_inductor

    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
    q, k, v, g = (x.detach() for x in inputs(1, sum(lengths), "vector"))
    o, _ = gla_inductor.chunk_gla(q, k, v, g, cu_seqlens=cu)
    parts = [gla_inductor.chunk_gla(q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e])[0]
             for s, e in zip(cu.tolist(), cu[1:].tolist()) if e > s]
    ref = torch.cat(parts, 1)
    return ((o.float() - ref.float()).norm() / ref.float().norm()).item()


def ratio(a, b):
    return None if a is None or b is None else round(a / b, 2)


def table(results: dict) -> str:
    rows = ["| case | what | ours packed | ours fixed | FLA packed | FLA / ours | packed / fixed |",
            "|---|---|---|---|---|---|---|"]
    pairs = [("fwd", "ours_packed_fwd", "ours_fixed_fwd", "fla_packed_fwd"),
             ("fwd+bwd", "ours_packed_fwdbwd", "ours_fixed_fwdbwd", "fla_packed_fwdbwd"),
             ("scalar fwd", "ours_packed_scalar_fwd", "ours_fixed_scalar_fwd", "fla_simple_packed_fwd")]
    for name, r in results.items():
        for what, ours, fixed, fla in pairs:
            for key in ("graph_ms", "ms"):
                o, f, x = (r.get(n, {}).get(key) if isinstance(r.get(n), dict) else None for n in (ours, fixed, fla))
                rows.append(f"| {name} | {what} ({key}) | {o} | {f} | {x} | {ratio(x, o)} | {ratio(o, f)} |")
    return "\n".join(rows)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--rep", type=int, default=50)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    for name, lengths in CASES.items():
        results[name] = case_results(lengths, args.rep)
        results[name]["rel_err_vs_per_sequence"] = check_correctness(lengths)
    print(json.dumps(results, indent=1))
    print(table({n: r for n, r in results.items() if isinstance(r, dict)}))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
