"""CPU: recognition time, the naive loop compiled against eager, and the CPU ops alone.

Parts (--parts):
  recognition  ``rewrite_graph`` alone on the captured Dynamo graph of a T=1024 time loop (best of 3);
  forward      the naive time loop of the README at B=2, T=512, H=4, K=V=64, fp32, eager against the
               same code compiled with the backend: one eager call and three compiled ones per
               round, rounds interleaved (on a shared machine the box's speed moved 2x within a
               minute); the speed-up is the median over rounds of eager / compiled. Also minor page
               faults per compiled call, compile time and the error against eager;
  train        the same for a training step (forward and backward);
  ops          the CPU implementations alone at that shape, every gate kind: the C++ step loops
               against the chunked PyTorch ones, forward and backward, ms and page faults per call;
  inductor     (not by default) whether Inductor's CPU codegen would run the chunked forward faster
               than the op's PyTorch implementation (``benchmarks.cpu_inductor``).
To compare code versions, run alternating processes with each version first on PYTHONPATH: page
faults depend on what the process allocated before, and the box's speed on its neighbours.
"""

from __future__ import annotations

import os
import resource
import time

import torch

from benchmarks import harness, inputs, report

PARTS = ("recognition", "forward", "train", "ops", "inductor")
SHAPE, QUICK_SHAPE = (2, 512, 4, 64, 64), (1, 64, 2, 16, 16)


def add_arguments(p) -> None:
    p.add_argument("--parts", default="recognition,forward,train,ops", help="of " + ",".join(PARTS))
    p.add_argument("--rounds", type=int, default=15, help="interleaved rounds of the forward (training: a third)")


def cpu_inputs(B, T, H, K, V, gate="vector"):
    return inputs.gla_inputs(B, T, H, K, V, gate=gate, device="cpu", dtype=torch.float32)


def recognition_seconds(T: int, repeat: int = 3) -> tuple:
    """(best seconds of ``rewrite_graph`` on the loop's graph, the graph's node count)."""
    from benchmarks import internals

    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    best, nodes = float("inf"), 0
    for _ in range(repeat):  # a pristine graph each time: the rewrite changes it in place
        graphs.clear()
        torch._dynamo.reset()
        torch.compile(inputs.naive_loop, backend=capture, fullgraph=True)(*cpu_inputs(1, T, 2, 8, 8))
        nodes = len(graphs[0].graph.nodes)
        start = time.perf_counter()
        found = internals.rewrite_graph(graphs[0])
        best = min(best, time.perf_counter() - start)
        if len(found.matches) != 1:
            raise RuntimeError(f"the T={T} loop gave {len(found.matches)} rewrites, expected 1")
    return best, nodes


def page_faults(fn, repeat: int = 10) -> float:
    """Minor page faults per call: memory the allocator gave back to the OS and faults in again."""
    fn()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(repeat):
        fn()
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / repeat


def per_call(fn, calls: int) -> tuple:
    """(ms, minor page faults) per call, after 5 warm-up calls."""
    for _ in range(5):
        fn()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    ms = (time.perf_counter() - start) / calls * 1e3
    return ms, (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / calls


def train_step(fn, x) -> None:
    leaves = [t.detach().requires_grad_() for t in x]
    fn(*leaves).square().sum().backward()


def eager_vs_compiled(eager, compiled, rounds: int) -> dict:
    t = harness.measure({"eager": eager, "compiled": compiled}, clock="cpu", rounds=rounds, warmup_ms=0,
                        calls={"eager": 1, "compiled": 3})
    e, c = t["eager"], t["compiled"]
    return {"eager_ms": e.median, "eager_min_ms": e.min, "compiled_ms": c.median, "compiled_min_ms": c.min,
            "speedup": harness.round_ratio(e, c)}


def run_forward(shape, rounds: int, train: bool) -> list:
    import gla_inductor

    x = cpu_inputs(*shape)
    torch._dynamo.reset()
    compiled = torch.compile(inputs.naive_loop, backend=gla_inductor.backend, fullgraph=True)
    _, first, warm = harness.first_and_warm(lambda: compiled(*x), "cpu")
    rows = []
    with torch.no_grad():
        fwd = eager_vs_compiled(lambda: inputs.naive_loop(*x), lambda: compiled(*x), rounds)
        want = inputs.naive_loop(*x)
        err = ((compiled(*x) - want).abs().max() / want.abs().max()).item()
        rows.append({"part": "forward", "shape": list(shape), **fwd, "page_faults": page_faults(lambda: compiled(*x)),
                     "compile_s": first - warm, "max_rel_err": err})
    if train:
        t = eager_vs_compiled(lambda: train_step(inputs.naive_loop, x), lambda: train_step(compiled, x),
                              max(2, rounds // 3))
        rows.append({"part": "train", "shape": list(shape), **t})
    return rows


def run_ops(shape, calls: int) -> list:
    from benchmarks import internals

    B, T, H, K, V = shape
    do = torch.randn(B, T, H, V)
    rows = []
    # every gate kind through the backward's step loop, also those the ops leave to the chunked one
    with internals.cpu_backward_gates(("vector", "scalar", "constant", "none")):
        for gate in ("vector", "scalar", "none"):
            q, k, v, g = cpu_inputs(B, T, H, K, V, gate)
            scale = K**-0.5
            cases = {
                "forward, step loop": lambda: internals.cpu_step_forward(q, k, v, g, scale=scale),
                "forward, chunked": lambda: internals.chunked_forward_torch(q, k, v, g, scale=scale),
                "backward, step loop": lambda: internals.cpu_step_backward(q, k, v, g, do, scale=scale),
                "backward, chunked": lambda: internals.chunked_backward_torch(q, k, v, g, do, scale=scale),
            }
            for what, fn in cases.items():
                ms, faults = per_call(fn, calls)
                rows.append({"part": "ops", "gate": gate, "what": what, "shape": list(shape), "ms": ms,
                             "page_faults": faults})
                harness.log(rows[-1])
    return rows


def run(args):
    parts = args.parts.split(",")
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        raise SystemExit(f"unknown parts {unknown}; choose from {PARTS}")
    shape = QUICK_SHAPE if args.quick else SHAPE
    rounds = 3 if args.quick else args.rounds
    load_before = os.getloadavg()[0]
    result = report.new_result("cpu", "CPU: recognition, the compiled naive loop, the CPU ops", "cpu",
                               shape=list(shape))
    if "recognition" in parts:
        T = 64 if args.quick else 1024
        s, nodes = recognition_seconds(T)
        result.rows.append({"part": "recognition", "T": T, "nodes": nodes, "seconds": s})
    if "forward" in parts or "train" in parts:
        result.rows += run_forward(shape, rounds, "train" in parts)
    if "ops" in parts:
        result.rows += run_ops(shape, 3 if args.quick else 30)
    if "inductor" in parts:
        from benchmarks import cpu_inductor

        result.rows += cpu_inductor.run_experiment(shape, rounds)
    result.meta["load_average"] = f"{load_before:.2f} before, {os.getloadavg()[0]:.2f} after"
    result.sections += markdown(result.rows)
    return result


def markdown(rows: list) -> list:
    lines = []
    for r in rows:
        if r["part"] == "recognition":
            lines.append(f"| recognition of a T={r['T']} loop graph ({r['nodes']} nodes) "
                         f"| {r['seconds'] * 1e3:.0f} ms |")
        elif r["part"] in ("forward", "train"):
            what = "naive loop" if r["part"] == "forward" else "training step (forward + backward)"
            shape = "B={} T={} H={} K={} V={}".format(*r["shape"])
            lines += [f"| {what} {shape}, eager | {r['eager_ms']:.2f} ms (min {r['eager_min_ms']:.2f}) |",
                      f"| same, compiled with gla_inductor | {r['compiled_ms']:.3f} ms "
                      f"(min {r['compiled_min_ms']:.3f}) |",
                      "| speed-up (median over rounds of eager / compiled, timed in alternation) "
                      f"| {r['speedup']:.1f}x |"]
            if r["part"] == "forward":
                lines += [f"| minor page faults per compiled call | {r['page_faults']:.0f} |",
                          f"| compile time | {r['compile_s']:.1f} s |",
                          f"| max relative error vs eager | {r['max_rel_err']:.1e} |"]
        elif r["part"] == "inductor":
            lines.append(f"| chunked forward experiment: {r['what']} | {r['ms']:.2f} ms |")
    out = ["| what | value |\n|---|---|\n" + "\n".join(lines)] if lines else []
    ops = [r for r in rows if r["part"] == "ops"]
    if ops:
        out.append("The CPU ops alone (ms and minor page faults per call):\n\n" + report.table(ops, [
            ("gate", "gate", ""), ("what", "what", ""), ("ms", "ms", ".2f"), ("page faults", "page_faults", ".0f")]))
    return out
