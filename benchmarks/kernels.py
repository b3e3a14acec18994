"""The kernels against FLA, in one process (CUDA).

Per shape (B, T, H, K, V), bf16, [B, T, H, D]:
  * ours: ``gla_inductor.chunk_gla`` with a vector gate and with a scalar gate;
  * fla: FLA's ``chunk_gla`` and ``chunk_simple_gla`` (skipped, with a note, where FLA is absent);
  * naive: the naive parallel scalar-gate form, eager (only where its [B, H, T, T] matrices fit);
  * compiled: the same form under default ``torch.compile``.
Forward and forward+backward ms (events: the host's launch overhead included where the host is the
slower side), the forward in a CUDA graph (GPU time alone), the forward's share of its byte floor
(q, k, v, g read once and o written once at the copy bandwidth measured in the same run), the peak
extra memory of forward+backward, and the first call's seconds (compiles, FLA's autotuning).
Implementations are timed in interleaved rounds, shape by shape. FLA's saved autotune results
(``benchmarks/fla_autotune``, see ``fla_warm.py``) are loaded into Triton's cache first: where they
hold its tuning keys, FLA's first call compiles instead of autotuning for up to minutes.
"""

from __future__ import annotations

import time

import torch

from benchmarks import fla_warm, harness, inputs, report

IMPLS = ("ours", "fla", "naive", "compiled")
NAIVE_BYTES_LIMIT = 40 * 2**30  # three [B, H, T, T] fp32 matrices above this are not attempted


def add_arguments(p) -> None:
    p.add_argument("--impls", default=",".join(IMPLS), help="of " + ",".join(IMPLS))
    p.add_argument("--gates", default="vector,scalar",
                   help="gate kinds (FLA autotunes minutes per kernel and shape: measure what a run needs)")
    p.add_argument("--shapes", help="indices into the standard shapes " + str(inputs.KERNEL_SHAPES)
                   + " (default: all)")
    p.add_argument("--custom", help="shapes 'B,T,H,K,V;...' instead of the standard ones")
    p.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds")
    fla_warm.add_autotune_arguments(p)


def implementations(names: list, gates: list, notes: list) -> dict:
    """name -> (gate kind, fn(q, k, v, g) -> o)."""
    out = {}
    if "ours" in names:
        import gla_inductor

        out["ours_vector"] = ("vector", lambda q, k, v, g: gla_inductor.chunk_gla(q, k, v, g)[0])
        out["ours_scalar"] = ("scalar", lambda q, k, v, g: gla_inductor.chunk_gla(q, k, v, g)[0])
    if "fla" in names:
        fla, why = inputs.fla_ops()
        if fla is None:
            notes.append(why)
        else:
            out["fla_chunk_gla"] = ("vector", lambda q, k, v, g: fla.chunk_gla(q, k, v, g)[0])
            out["fla_chunk_simple_gla"] = ("scalar", lambda q, k, v, g: fla.chunk_simple_gla(q, k, v, g)[0])
    if "naive" in names:
        out["naive_parallel_eager"] = ("scalar", inputs.naive_parallel_scalar)
    if "compiled" in names:
        out["naive_parallel_compiled"] = ("scalar", torch.compile(inputs.naive_parallel_scalar))
    return {name: impl for name, impl in out.items() if impl[0] in gates}


def training_step(fn, args):
    """fn's forward and backward with a fixed output gradient; gradients reset each call."""
    do = torch.randn_like(fn(*args))

    def step():
        for a in args:
            a.grad = None
        fn(*args).backward(do)

    return step


def prepare(name, gate, fn, shape, bw) -> tuple:
    """(row, forward, training step or None), after a first training step (compiles, autotunes)."""
    B, T, H, K, V = shape
    args = inputs.gla_inputs(B, T, H, K, V, gate=gate, requires_grad=True)
    row = {"impl": name, "gate": gate, "shape": list(shape),
           "floor_ms": harness.floor_ms(harness.tensor_bytes(*args) + B * T * H * V * 2, bw)}
    step = training_step(fn, args)
    start = time.perf_counter()
    try:
        step()
        torch.cuda.synchronize()
        row["first_call_s"] = time.perf_counter() - start
    except Exception as e:  # a backward that refuses (FLA's chunk_simple_gla on Triton 3.6) leaves the forward
        row["bwd_error"] = harness.error_text(e)
        step = None

    def forward():
        with torch.no_grad():
            return fn(*args)

    return row, forward, step


def run_shape(shape, impls: dict, bw: float, rounds: int) -> list:
    B, T, H, K, V = shape
    prepared = {}
    for name, (gate, fn) in impls.items():
        if name.startswith("naive") and B * H * T * T * 4 * 3 > NAIVE_BYTES_LIMIT:
            continue
        try:
            prepared[name] = prepare(name, gate, fn, shape, bw)
        except Exception as e:  # one failing implementation must not hide the others
            prepared[name] = ({"impl": name, "gate": gate, "shape": list(shape), "error": harness.error_text(e)},
                              None, None)
    ok = {n: p for n, p in prepared.items() if p[1] is not None}
    graph_errors = {}
    stages = [("fwd_", "events", {n: p[1] for n, p in ok.items()}),
              ("fwd_graph_", "graph", {n: p[1] for n, p in ok.items()}),
              ("fwdbwd_", "events", {n: p[2] for n, p in ok.items() if p[2] is not None})]
    for prefix, clock, fns in stages:
        try:
            timings = harness.measure(fns, clock=clock, rounds=rounds, errors=graph_errors)
        except Exception as e:  # noqa: BLE001 - recorded on every row of the stage
            for n in fns:
                prepared[n][0][f"{prefix}error"] = harness.error_text(e)
            continue
        for n, t in timings.items():
            if t is not None:
                prepared[n][0].update(t.fields(prefix))
    for n, p in ok.items():
        row = p[0]
        if n in graph_errors:
            row["fwd_graph_error"] = graph_errors[n]
        if p[2] is not None:
            row["peak_extra_mib"] = harness.peak_extra_mib(p[2])
        if "fwd_ms" in row:
            row["floor_pct"] = 100 * row["floor_ms"] / row["fwd_ms"]
    rows = [p[0] for p in prepared.values()]
    for r in rows:
        harness.log(r)
    harness.free_memory()
    return rows


def run(args):
    harness.require_cuda("kernels")
    fla_warm.cache_dir()  # before the first compile
    notes = []
    fla_warm.autotune_before(args, notes)
    gates = args.gates.split(",")
    impls = implementations(args.impls.split(","), gates, notes)
    if args.custom:
        shapes = harness.parse_shapes(args.custom)
    elif args.quick:
        shapes = inputs.QUICK_SHAPES
    else:
        idx = range(len(inputs.KERNEL_SHAPES)) if not args.shapes else map(int, args.shapes.split(","))
        shapes = [inputs.KERNEL_SHAPES[i] for i in idx]
    bw = harness.copy_bandwidth(1 << 30)
    result = report.new_result("kernels", "GLA kernels against FLA", "cuda", copy_bandwidth_tbs=round(bw / 1e12, 3),
                               dtype="bfloat16")
    result.notes += notes + [
        "ms: median of interleaved rounds, CUDA events, L2 flushed before each call (host launch time included "
        "where the host is slower); graph: CUDA-graph replays (GPU time alone)",
        "gates: vector bf16, scalar fp32, both logsigmoid(randn) / 16"]
    for shape in shapes:
        result.rows += run_shape(shape, impls, bw, 2 if args.quick else args.rounds)
    result.sections += [pairs_table(result.rows), naive_table(result.rows)]
    result.plot = lambda path: report.bar_plot(path, [r for r in result.rows if "fwd_ms" in r],
                                               lambda r: ",".join(map(str, r["shape"])), "impl",
                                               ["fwd_ms", "fwdbwd_ms"])
    fla_warm.autotune_after(args)
    return result


PAIRS = (("ours_vector", "fla_chunk_gla"), ("ours_scalar", "fla_chunk_simple_gla"))


def pairs_table(rows: list) -> str:
    by = {(r["impl"], tuple(r["shape"])): r for r in rows}
    out = []
    for shape in dict.fromkeys(tuple(r["shape"]) for r in rows):
        for ours, fla in PAIRS:
            a, b = by.get((ours, shape)), by.get((fla, shape), {})
            if a is None:
                continue
            out.append({
                "shape": shape, "gate": a["gate"], "ours": a.get("fwd_ms"), "fla": b.get("fwd_ms"),
                "fwd_x": report.ratio(b.get("fwd_ms"), a.get("fwd_ms")), "ours_graph": a.get("fwd_graph_ms"),
                "fla_graph": b.get("fwd_graph_ms"), "ours_fb": a.get("fwdbwd_ms"), "fla_fb": b.get("fwdbwd_ms"),
                "fb_x": report.ratio(b.get("fwdbwd_ms"), a.get("fwdbwd_ms")), "floor": a.get("floor_pct"),
                "mib": f"{report.fmt(a.get('peak_extra_mib'), '.0f')} / {report.fmt(b.get('peak_extra_mib'), '.0f')}",
                "first": a.get("first_call_s"),
                "error": a.get("error") or a.get("bwd_error") or b.get("error") or b.get("bwd_error")})
    return report.table(out, [
        ("B, T, H, K, V", "shape", ""), ("gate", "gate", ""), ("ours fwd ms", "ours", ".3f"),
        ("FLA fwd ms", "fla", ".3f"), ("fwd speed-up", "fwd_x", ""), ("ours graph ms", "ours_graph", ".3f"),
        ("FLA graph ms", "fla_graph", ".3f"), ("ours fwd+bwd ms", "ours_fb", ".3f"),
        ("FLA fwd+bwd ms", "fla_fb", ".3f"),
        ("fwd+bwd speed-up", "fb_x", ""), ("ours % of byte floor (fwd)", "floor", ".0f"),
        ("extra MiB ours / FLA (fwd+bwd)", "mib", ""), ("ours first call s", "first", ".1f"),
        ("error", lambda r: (r["error"] or "")[:80] or None, "")])


def naive_table(rows: list) -> str:
    naive = [r for r in rows if r["impl"].startswith("naive")]
    if not naive:
        return ""
    return "Naive parallel scalar-gate form (fp32 math), for reference:\n\n" + report.table(naive, [
        ("B, T, H, K, V", "shape", ""), ("impl", "impl", ""), ("fwd ms", "fwd_ms", ".3f"),
        ("graph ms", "fwd_graph_ms", ".3f"), ("fwd+bwd ms", "fwdbwd_ms", ".3f"),
        ("error", lambda r: (r.get("error") or r.get("bwd_error") or "")[:80] or None, "")])
