"""GPU A/B of the decode op's lowering: the naive one-token step with its fp32 cache
updated in place, compiled by default Inductor and by gla_inductor.backend under each
config.decode_lowering, with and without mode="reduce-overhead" (cache marked static). Prints the
median ms per step (host + device: wall clock over a synchronized block of calls), interleaved rounds.

    PYTHONPATH=. python benchmarks/decode_lowering_ab.py            # B in 1,16,64,256; H=32; K=V=128
    PYTHONPATH=. python benchmarks/decode_lowering_ab.py --steps 4  # a 4-token step from the cache
"""
import argparse, statistics, time, types

import torch

import gla_inductor
from gla_inductor import config


def step1(q, k, v, g, cache):
    S = cache * g.float().exp()[..., None] + k.float()[..., None] * v.float()[..., None, :]
    o = (q.float()[..., None] * S).sum(-2) * q.shape[-1] ** -0.5
    cache.copy_(S)
    return o


def stepT(q, k, v, g, cache):
    S = cache
    out = []
    for t in range(q.shape[1]):
        S = S * g[:, t].float().exp()[..., None] + k[:, t].float()[..., None] * v[:, t].float()[..., None, :]
        out.append((q[:, t].float()[..., None] * S).sum(-2) * q.shape[-1] ** -0.5)
    cache.copy_(S)
    return torch.stack(out, 1)


def make(B, H, K, V, T):
    t = () if T == 1 else (T,)
    r = lambda D: torch.randn(B, *t, H, D, device="cuda", dtype=torch.bfloat16)
    g = torch.nn.functional.logsigmoid(r(K).float() + 2).bfloat16()
    cache = torch.randn(B, H, K, V, device="cuda") * 0.1
    return [r(K), r(K), r(V), g, cache]


def variants(fn):
    fresh = lambda tag: types.FunctionType(fn.__code__.replace(co_name=fn.__name__ + tag), fn.__globals__)
    out = {}
    for mode in (None, "reduce-overhead"):
        sfx = "" if mode is None else "+graphs"
        out["inductor" + sfx] = (torch.compile(fresh("i" + sfx), backend="inductor", mode=mode, fullgraph=True), None)
        for low in ("auto", "decompose", "extern"):
            out[f"ours_{low}{sfx}"] = (torch.compile(fresh(low + sfx), backend=gla_inductor.backend, mode=mode,
                                                     fullgraph=True), low)
    return out


def timed(f, args, n):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        f(*args)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e3


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--batches", default="1,16,64,256")
    p.add_argument("--rounds", type=int, default=7)
    a = p.parse_args()
    fn = step1 if a.steps == 1 else stepT
    print(torch.cuda.get_device_name(), torch.__version__)
    for B in map(int, a.batches.split(",")):
        torch._dynamo.reset()
        times = {}
        with torch.no_grad(), config.patch(cost_rule=False):
            vs = variants(fn)
            args = {}
            for name, (f, low) in vs.items():
                args[name] = make(B, 32, 128, 128, a.steps)
                torch._dynamo.mark_static_address(args[name][4])
                with config.patch(decode_lowering=low or "auto"):
                    for _ in range(3):
                        f(*args[name])  # compile, warm up, record
            for _ in range(a.rounds):
                for name, (f, low) in vs.items():
                    with config.patch(decode_lowering=low or "auto"):
                        times.setdefault(name, []).append(timed(f, args[name], 200))
        base = statistics.median(times["inductor"])
        base_g = statistics.median(times["inductor+graphs"])
        for name, ts in times.items():
            m = statistics.median(ts)
            ref = base_g if name.endswith("+graphs") else base
            print(f"B={B:4d} T={a.steps} {name:26s} {m:.4f} ms  {m / ref:.2f}x Inductor")
    print("cudagraph skips:", dict(torch._dynamo.utils.counters["inductor"]).get("cudagraph_skips", 0))


if __name__ == "__main__":
    main()
