"""Packed variable-length sequences (``chunk_gla(..., cu_seqlens=...)``) against FLA (CUDA; --device
cpu runs tiny shapes on CPU).

Per case (bf16, H = 16, K = V = 128, layout [1, T, H, D] packed), ms of:
  * ours packed: ``gla_inductor.chunk_gla`` with cu_seqlens, vector gate (forward, forward + backward,
    forward with the prefix states every 64 steps) and scalar gate (forward);
  * FLA packed (where ``fla`` imports): ``chunk_gla`` and ``chunk_simple_gla`` with the same
    cu_seqlens (int64), their first calls autotuned in a child process under --fla-budget seconds
    (benchmarks/fla_warm.py);
  * ours fixed-length at the same total tokens: [N, L] for N equal sequences of L steps, and
    [1, T] for the mixed case (what packing should cost nothing against).
Timed by the shared harness: CUDA events (host time included) and CUDA-graph replays (GPU time
alone; every input, output gradient included, exists before capture; a call that cannot be
captured gets a note instead), and the time the profiler sees kernels run (GPU time of calls that
cannot be captured, as FLA's packed calls: they read the offsets on the host; kernels overlapping on
two streams count once). Cases (the anchors): 8 x 2048 packed, and 12 mixed lengths (25.7k
tokens). Targets: packed forward >= 2.5x FLA chunk_gla, forward + backward >= 2x, scalar gate
>= 1.5x chunk_simple_gla, and packed within 1.1x of our fixed-length time at equal tokens.
"""

from __future__ import annotations

import sys

import torch

from benchmarks import fla_warm, harness, inputs, report

H, K, V = 16, 128, 128
CASES = {
    "8x2048": [2048] * 8,
    # 12 mixed lengths, 25.7k tokens: long and short, lengths off the chunk grid, one single step
    "mixed12": [4096, 517, 3001, 1024, 64, 2048, 5999, 1, 777, 2500, 3900, 1773],
}
CPU = {"H": 2, "K": 16, "cases": {"4x32": [32] * 4, "mixed4": [40, 5, 1, 17]}}
# (what, gate, training, extra keyword arguments of ours)
PARTS = (("fwd", "vector", False, {}), ("fwd+bwd", "vector", True, {}), ("scalar fwd", "scalar", False, {}),
         ("prefix-states fwd", "vector", False, {"output_prefix_states": True}))


def add_arguments(p) -> None:
    p.add_argument("--cases", default=",".join(CASES), help="of " + ",".join(CASES))
    p.add_argument("--impls", default="ours,fla")
    p.add_argument("--rounds", type=int, default=5)
    fla_warm.add_autotune_arguments(p)
    p.add_argument("--fla-budget", type=float, default=150.0, help="seconds FLA may autotune per case and op")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))


def offsets(lengths: list, device, dtype=torch.int32) -> torch.Tensor:
    out = torch.zeros(len(lengths) + 1, dtype=dtype)
    out[1:] = torch.tensor(lengths).cumsum(0)
    return out.to(device)


def make_call(fn, args: tuple, training: bool, kwargs: dict):
    """A callable of no arguments: the forward under no_grad, or forward + backward with an
    output gradient made now (nothing random is drawn inside the timed call or its capture)."""
    if not training:
        def forward():
            with torch.no_grad():
                fn(*args, **kwargs)
        return forward
    with torch.no_grad():
        do = torch.randn_like(fn(*args, **kwargs)[0])

    def train():
        o = fn(*args, **kwargs)[0]
        torch.autograd.grad(o, args, do)
    return train


def case_calls(lengths: list, shape: tuple, device: str, impls: list, fla) -> dict:
    """(what, impl) -> callable: ours packed, ours fixed at equal tokens, FLA packed."""
    import gla_inductor

    _, _, heads, dk, dv = shape
    N, T = len(lengths), sum(lengths)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    B, L = (N, lengths[0]) if len(set(lengths)) == 1 else (1, T)  # fixed length: N x L, else one of T
    cu, cu64 = offsets(lengths, device), offsets(lengths, device, torch.int64)
    calls = {}
    for what, gate, training, extra in PARTS:
        packed = inputs.gla_inputs(1, T, heads, dk, dv, gate=gate, device=device, dtype=dtype, requires_grad=True)
        fixed = inputs.gla_inputs(B, L, heads, dk, dv, gate=gate, device=device, dtype=dtype, requires_grad=True)
        if "ours" in impls:
            calls[(what, "ours_packed")] = make_call(gla_inductor.chunk_gla, packed, training,
                                                     {"cu_seqlens": cu, **extra})
            calls[(what, "ours_fixed")] = make_call(gla_inductor.chunk_gla, fixed, training, extra)
        if fla is not None and not extra:
            op = fla.chunk_gla if gate == "vector" else fla.chunk_simple_gla
            calls[(what, "fla_packed")] = make_call(op, packed, training, {"cu_seqlens": cu64})
    return calls


def check_packed(lengths: list, shape: tuple, device: str) -> float:
    """Relative error of our packed forward against our per-sequence calls."""
    import gla_inductor

    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    q, k, v, g = inputs.gla_inputs(1, sum(lengths), *shape[2:], device=device, dtype=dtype, seed=3)
    cu = offsets(lengths, device)
    with torch.no_grad():
        o, _ = gla_inductor.chunk_gla(q, k, v, g, cu_seqlens=cu)
        bounds = cu.tolist()
        ref = torch.cat([gla_inductor.chunk_gla(q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e])[0]
                         for s, e in zip(bounds, bounds[1:])], 1)
    return harness.rel_err(o.float(), ref.float())


def run_case(name: str, lengths: list, shape: tuple, device: str, args, fla, notes: list) -> list:
    if fla is not None:
        for op, grad in (("chunk_gla", True), ("chunk_simple_gla", False)):
            ok, _, why = fla_warm.warm(op, shape, args.fla_budget, grad=grad, lengths=lengths)
            fla_warm.autotune_after(args)  # saved at once: a command stopped later keeps them
            if not ok:
                notes.append(f"{name}: {why}; FLA left out of this case")
                fla = None
                break
    calls = case_calls(lengths, shape, device, args.impls.split(","), fla)
    err = check_packed(lengths, shape, device)
    rounds = 2 if args.quick else args.rounds
    rows = {key: {"case": name, "what": key[0], "impl": key[1], "tokens": sum(lengths), "sequences": len(lengths),
                  "packed_rel_err_vs_per_sequence": err} for key in calls}
    for what in dict.fromkeys(k[0] for k in calls):
        fns = {k: f for k, f in calls.items() if k[0] == what}
        clocks = (("", "cpu"),) if device == "cpu" else (("", "events"), ("graph_", "graph"))
        for prefix, clock in clocks:
            errors = {}
            for key, t in harness.measure(fns, clock=clock, rounds=rounds, errors=errors).items():
                rows[key].update(t.fields(prefix) if t is not None else {f"{prefix}error": errors.get(key)})
        if device == "cuda":
            for key, fn in fns.items():
                rows[key]["kernel_ms"] = harness.kernel_ms(fn)
        for key in fns:
            harness.log(rows[key])
    harness.free_memory()
    return list(rows.values())


def run(args):
    device = args.device
    if device == "cuda":
        harness.require_cuda("varlen")
        fla_warm.cache_dir()  # before the first compile: shared with FLA's warm-up children
    cases = CPU["cases"] if device == "cpu" else {n: CASES[n] for n in args.cases.split(",")}
    if args.quick:
        cases = dict(list(cases.items())[:1])
    heads, dim = (CPU["H"], CPU["K"]) if device == "cpu" else (H, K)
    notes = []
    fla = None
    if device == "cuda":
        fla_warm.autotune_before(args, notes)
    if "fla" in args.impls and device == "cuda":
        fla, why = inputs.fla_ops()
        if fla is None:
            notes.append(why)
    result = report.new_result("varlen", "Packed variable-length sequences against FLA", device, H=heads, K=dim,
                               V=dim, cases={n: l for n, l in cases.items()}, fla=inputs.fla_version())
    for name, lengths in cases.items():
        print(f"[varlen] {name}: {len(lengths)} sequences, {sum(lengths)} tokens", file=sys.stderr,
              flush=True)
        result.rows += run_case(name, lengths, (1, sum(lengths), heads, dim, dim), device, args, fla, notes)
    result.notes += notes + ["ms: CUDA events (host time included; CPU clock on CPU); graph: CUDA-graph replays; "
                             "GPU kernels: the time the profiler sees kernels run per call, overlaps "
                             "counted once (FLA's packed calls "
                             "cannot be captured: they read the offsets on the host)",
                             "ours fixed: the same tokens unpacked, N x L for equal lengths, else 1 x T"]
    result.sections.append(markdown(result.rows))
    if device == "cuda":
        fla_warm.autotune_after(args)
    return result


def markdown(rows: list) -> str:
    by = {(r["case"], r["what"], r["impl"]): r for r in rows}
    out = []
    for case, what in dict.fromkeys((r["case"], r["what"]) for r in rows):
        for key in ("graph_ms", "kernel_ms", "ms"):
            ours, fixed, fla = (by.get((case, what, n), {}).get(key) for n in ("ours_packed", "ours_fixed",
                                                                                   "fla_packed"))
            if ours is None and fla is None:
                continue
            clock = {"graph_ms": "graph", "kernel_ms": "GPU kernels", "ms": "events"}[key]
            out.append({"case": case, "what": f"{what} ({clock})", "ours": ours,
                        "fixed": fixed, "fla": fla, "fla_x": report.ratio(fla, ours),
                        "packed_x": report.ratio(ours, fixed)})
    errs = [f"- {r['case']} {r['what']} {r['impl']}: {r.get('error') or r.get('graph_error')}"
            for r in rows if r.get("error") or r.get("graph_error")]
    text = report.table(out, [("case", "case", ""), ("what", "what", ""), ("ours packed ms", "ours", ".3f"),
                              ("ours fixed ms", "fixed", ".3f"), ("FLA packed ms", "fla", ".3f"),
                              ("FLA / ours", "fla_x", ""), ("packed / fixed", "packed_x", "")])
    return text + ("\n\nNot timed:\n\n" + "\n".join(errs) if errs else "")
