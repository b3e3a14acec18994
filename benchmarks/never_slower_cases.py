"""The programs, cases and columns of ``python -m benchmarks never-slower``, and the timing of one case.

A case is a naive program at one shape (decode step, short multi-token step, prefill, the CPU time
loop) with its inputs and a float64 reference. Its columns:

    eager        the naive program in eager PyTorch
    inductor     torch.compile(program), default Inductor
    ours         torch.compile(program, backend=gla_inductor.backend), the cost rule on (what users get)
    forced       the same with the cost rule off (the rewrite wherever the recognizer finds GLA)
    fla          FLA's op where it has one (fused_recurrent_gla / fused_recurrent_simple_gla for steps,
                 chunk_gla / chunk_simple_gla for prefill); FLA writes a fresh final state and does
                 not copy it back into the cache: the step's cheapest use of FLA
    *_ro         inductor / ours / forced compiled with mode="reduce-overhead" (CUDA graph trees),
                 the cache marked by torch._dynamo.mark_static_address as static caches do

Every column gets its own copy of the inputs (the steps update their cache in place). Its first
call compiles (ours and forced each through their own backend function, which sets the cost
rule's switch around the backend), is checked against float64, and counts the
backend's rewrites and Inductor's cudagraph skips it caused.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from benchmarks import harness, inputs
from gla_inductor.reference import naive_recurrent_gla

COMPILED = ("inductor", "ours", "forced")
COLUMNS = ("eager",) + COMPILED + ("fla",) + tuple(f"{c}_ro" for c in COMPILED)
NAIVE_BYTES_LIMIT = 40 * 2**30  # prefill: eager and Inductor only where three [B, H, T, T] fp32 matrices fit


# ---------------------------------------------------------------------------------------------
# the naive programs (the scale is K ** -0.5, written in so that Dynamo sees no float argument)
# ---------------------------------------------------------------------------------------------


def decode_vector(q, k, v, g, cache):
    """One token, vector gate: q, k, g [B, H, K], v [B, H, V], cache [B, H, K, V] updated in place."""
    S = cache * torch.exp(g)[..., None] + k[..., None] * v[..., None, :]
    o = (q[..., None] * S).sum(-2) * q.shape[-1] ** -0.5
    cache.copy_(S)
    return o


def decode_scalar(q, k, v, g, cache):
    """One token, scalar gate g [B, H]."""
    S = cache * torch.exp(g)[..., None, None] + k[..., None] * v[..., None, :]
    o = (q[..., None] * S).sum(-2) * q.shape[-1] ** -0.5
    cache.copy_(S)
    return o


def steps_vector(q, k, v, g, cache):
    """T tokens from a cache, [B, T, H, D], vector gate; the final state copied back."""
    S, out = cache, []
    for t in range(q.shape[1]):
        S = S * torch.exp(g[:, t])[..., None] + k[:, t, ..., None] * v[:, t, ..., None, :]
        out.append((q[:, t, ..., None] * S).sum(-2) * q.shape[-1] ** -0.5)
    cache.copy_(S)
    return torch.stack(out, 1)


def steps_scalar(q, k, v, g, cache):
    """T tokens from a cache, scalar gate g [B, T, H]."""
    S, out = cache, []
    for t in range(q.shape[1]):
        S = S * torch.exp(g[:, t])[..., None, None] + k[:, t, ..., None] * v[:, t, ..., None, :]
        out.append((q[:, t, ..., None] * S).sum(-2) * q.shape[-1] ** -0.5)
    cache.copy_(S)
    return torch.stack(out, 1)


def prefill_vector(q, k, v, g):
    """The parallel form with a vector gate, (q e^G)(k e^-G)^T on the causal triangle, [B, T, H, D].
    Eager and Inductor overflow e^-G at long T (timed only); the backend computes it stably."""
    q, k, v, g = (x.transpose(1, 2) for x in (q, k, v, g))
    G = g.float().cumsum(2)
    A = ((q * G.exp()) @ (k * (-G).exp()).transpose(-1, -2)).tril() * q.shape[-1] ** -0.5
    return (A.to(v.dtype) @ v).transpose(1, 2)


PROGRAMS = {("decode", "vector"): decode_vector, ("decode", "scalar"): decode_scalar,
            ("short", "vector"): steps_vector, ("short", "scalar"): steps_scalar,
            ("prefill", "vector"): prefill_vector, ("prefill", "scalar"): inputs.naive_parallel_scalar,
            ("loop", "vector"): inputs.naive_loop}


# ---------------------------------------------------------------------------------------------
# cases
# ---------------------------------------------------------------------------------------------


@dataclass
class Case:
    section: str  # "decode", "short", "prefill", "cpu"
    form: str  # the program's kind: "decode", "short", "prefill", "loop"
    gate: str
    shape: tuple  # B, T, H, K, V
    device: str
    dtype: torch.dtype
    columns: tuple = COLUMNS

    @property
    def program(self) -> Callable:
        return PROGRAMS[(self.form, self.gate)]

    @property
    def has_cache(self) -> bool:
        return self.form in ("decode", "short")

    def label(self) -> str:
        B, T, H, K, V = self.shape
        return f"{self.section} {self.gate} B{B} T{T} H{H} {K}x{V}"

    def make_inputs(self) -> tuple:
        """The program's arguments: q, k, v, g (and the fp32 cache); decode drops the T axis."""
        B, T, H, K, V = self.shape
        q, k, v, g = inputs.gla_inputs(B, T, H, K, V, gate=self.gate, device=self.device, dtype=self.dtype)
        if self.form == "decode":
            q, k, v, g = (x[:, 0].contiguous() for x in (q, k, v, g))
        if not self.has_cache:
            return q, k, v, g
        return q, k, v, g, inputs.state(B, H, K, V, device=self.device)

    def reference(self, args: tuple) -> Optional[tuple]:
        """(o, final state or None) in float64; None for prefill shapes too large to check."""
        x = [a.double() for a in args]
        if self.form == "decode":
            x = [a[:, None] for a in x[:4]] + x[4:]
        if self.gate == "scalar" and self.form != "prefill":
            x[3] = x[3][..., None].expand(*x[3].shape, self.shape[3])
        if self.has_cache:
            o, S = inputs.naive_steps(*x, self.shape[3] ** -0.5)
            return (o[:, 0] if self.form == "decode" else o), S
        if self.form == "loop":
            return inputs.naive_loop(*x), None
        if not self.naive_fits() or self.shape[1] > 4096:
            return None
        if self.form == "prefill" and self.gate == "vector":
            # the factored form's e^-G overflows (its cumsum runs in fp32): the recurrence in float64
            return naive_recurrent_gla(*x[:4], scale=self.shape[3] ** -0.5)[0], None
        return self.program(*x), None

    def floor_bytes(self) -> int:
        """The state read and written once (steps); inputs read and output written (prefill)."""
        B, T, H, K, V = self.shape
        if self.has_cache:
            return 2 * B * H * K * V * 4
        return B * T * H * (2 * K + 2 * V + (K if self.gate == "vector" else 0)) * self.dtype.itemsize

    def naive_fits(self) -> bool:
        B, T, H = self.shape[:3]
        return self.form != "prefill" or B * H * T * T * 4 * 3 <= NAIVE_BYTES_LIMIT


# ---------------------------------------------------------------------------------------------
# columns
# ---------------------------------------------------------------------------------------------


def fla_fn(case: Case, fla) -> Optional[Callable]:
    """FLA's op called on the case's arguments, or None where FLA has none for it."""
    if fla is None or case.device == "cpu" or case.form == "loop":
        return None
    if case.form == "prefill":
        op = fla.chunk_gla if case.gate == "vector" else fla.chunk_simple_gla
        return lambda q, k, v, g: op(q, k, v, g)[0]
    if case.gate == "scalar" and fla.fused_recurrent_simple_gla is None:
        return None
    scale = case.shape[3] ** -0.5
    one = case.form == "decode"

    def step(q, k, v, g, cache):
        if one:
            q, k, v, g = (x[:, None] for x in (q, k, v, g))
        if case.gate == "vector":
            return fla.fused_recurrent_gla(q, k, v, gk=g, scale=scale, initial_state=cache, output_final_state=True)
        return fla.fused_recurrent_simple_gla(q, k, v, g=g, scale=scale, initial_state=cache,
                                              output_final_state=True)

    return step


def _backend(cost_rule: bool) -> Callable:
    """gla_inductor.backend with the cost rule switched for its compiles: one function per setting,
    so that Dynamo compiles a program afresh for each (it reuses a graph compiled by the same
    backend object)."""

    def backend(gm, example_inputs, **kwargs):
        import gla_inductor

        with gla_inductor.config.patch(cost_rule=cost_rule):
            return gla_inductor.backend(gm, example_inputs, **kwargs)

    backend.__name__ = f"gla_inductor_cost_rule_{'on' if cost_rule else 'off'}"
    return backend


BACKENDS = {"ours": _backend(True), "forced": _backend(False)}


def _own_copy(fn: Callable) -> Callable:
    """fn with a code object of its own: Dynamo keeps its compiled graphs and guards per code
    object, so each compiled column looks up only its own (no other column's guards on its path)."""
    import types

    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def column_fn(name: str, case: Case, fla) -> Optional[Callable]:
    program = case.program if name in ("eager", "fla") else _own_copy(case.program)
    base = name[:-3] if name.endswith("_ro") else name
    kw = {"mode": "reduce-overhead"} if name.endswith("_ro") else {}
    if name == "eager":
        return program
    if name == "fla":
        return fla_fn(case, fla)
    if base == "inductor":
        return torch.compile(program, dynamic=False, **kw)
    if base in ("ours", "forced"):
        return torch.compile(program, backend=BACKENDS[base], dynamic=False, **kw)
    raise ValueError(f"unknown column {name!r}")


def applicable(name: str, case: Case, fla) -> Optional[str]:
    """None where the column runs for this case, else why not."""
    if name not in case.columns:
        return "not asked for"
    if (name.endswith("_ro") or name == "fla") and case.device == "cpu":
        return "CUDA only"
    if name.endswith("_ro") and not case.has_cache:
        return "reduce-overhead: for the steps from a cache"
    if name in ("eager", "inductor") and not case.naive_fits():
        return "the [B, H, T, T] matrices do not fit"
    if name == "fla" and fla_fn(case, fla) is None:
        return "FLA has no op for this case" if fla is not None else "FLA not importable"
    return None


# ---------------------------------------------------------------------------------------------
# one case: prepare every column, check it, time it
# ---------------------------------------------------------------------------------------------


@dataclass
class Prepared:
    fn: Callable  # no arguments
    info: dict = field(default_factory=dict)


def _first_call(name: str, fn: Callable, args: tuple, case: Case, ref: Optional[tuple]) -> dict:
    """Compile, check against float64, count rewrites and cudagraph skips."""
    from torch._dynamo.utils import counters

    before = (counters["gla_inductor"]["rewrites"], counters["inductor"]["cudagraph_skips"])
    cache_in = args[4].clone() if case.has_cache else None
    harness._sync(case.device)
    start = time.perf_counter()
    with torch.no_grad():
        out = fn(*args)
    harness._sync(case.device)
    info = {"first_call_s": time.perf_counter() - start}
    if name != "eager" and name != "fla":
        info["rewrites"] = counters["gla_inductor"]["rewrites"] - before[0]
    if name.endswith("_ro"):
        info["cudagraph_skips"] = counters["inductor"]["cudagraph_skips"] - before[1]
    if ref is None:
        return info
    ref_o, ref_s = ref
    o, state = (out[0], out[1]) if isinstance(out, tuple) else (out, args[4] if case.has_cache else None)
    info["rel_err"] = harness.rel_err(o.reshape(ref_o.shape), ref_o)
    if ref_s is not None and state is not None:
        info["state_rel_err"] = harness.rel_err(state, ref_s)
        if name != "fla":
            args[4].copy_(cache_in)  # the same start for the timing as for the check
    return info


def prepare(name: str, case: Case, base_args: tuple, ref: Optional[tuple], fla) -> Prepared:
    """The column's timed callable (no arguments) and what its first calls found."""
    fn = column_fn(name, case, fla)
    args = tuple(a.clone() for a in base_args)
    if name.endswith("_ro"):
        torch._dynamo.mark_static_address(args[4])
    info = _first_call(name, fn, args, case, ref)
    if name.endswith("_ro"):  # graph trees: a warm-up run, then recording, then replays
        with torch.no_grad():
            for _ in range(3):
                fn(*args)
        harness._sync(case.device)

    def call():
        with torch.no_grad():
            return fn(*args)

    return Prepared(call, info)


def run_case(case: Case, fla, rounds: int, graphs: bool) -> dict:
    """One row: every applicable column's first-call facts and ms (events, or CPU clock), and on
    CUDA the ms of its calls captured in a CUDA graph by hand (``graph_ms``)."""
    torch._dynamo.reset()
    B, T, H, K, V = case.shape
    row = {"section": case.section, "form": case.form, "gate": case.gate, "B": B, "T": T, "H": H, "K": K, "V": V,
           "device": case.device, "dtype": str(case.dtype).replace("torch.", ""), "cols": {}}
    base_args = case.make_inputs()
    ref = case.reference(base_args)
    prepared = {}
    for name in COLUMNS:
        why = applicable(name, case, fla)
        if why is not None:
            if why not in ("not asked for", "CUDA only"):
                row.setdefault("skipped", {})[name] = why
            continue
        try:
            prepared[name] = prepare(name, case, base_args, ref, fla)
            row["cols"][name] = dict(prepared[name].info)
        except Exception as e:  # one failing column must not hide the others
            row["cols"][name] = {"error": harness.error_text(e)}
        harness.log({"case": case.label(), "column": name, **row["cols"][name]})
    fns = {n: p.fn for n, p in prepared.items()}
    clock = "cpu" if case.device == "cpu" else "events"
    calls = {n: 1 for n in fns if n == "eager"} if case.device == "cpu" and case.form == "loop" else None
    for name, t in harness.measure(fns, clock=clock, rounds=rounds, calls=calls,
                                   warmup_ms=0 if clock == "cpu" else 25).items():
        row["cols"][name].update(t.fields())
    if graphs and case.device != "cpu":
        errors = {}
        manual = {n: f for n, f in fns.items() if not n.endswith("_ro")}
        for name, t in harness.measure(manual, clock="graph", rounds=rounds, errors=errors).items():
            if t is None:
                row["cols"][name]["graph_error"] = errors.get(name)
            else:
                row["cols"][name]["graph_ms"] = t.median
    del prepared, fns
    harness.free_memory()
    return row
