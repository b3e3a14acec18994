"""Spelling fuzzer: naive GLA programs and near misses from tests/fuzz_programs.py, compiled
with the backend and compared with eager.

For every program: the compiled outputs (o, and the final state where returned), the gradients
of every input (training programs) and any input the program writes in place (a decode cache)
match a float64 run of the same program; no other input is changed; a GLA program is rewritten exactly
as often as expected, a near miss never; the rewrite pass raises nothing.

Most programs go through ``rewrite_only``, a backend that applies ``gla_inductor.backend``'s
rewrite and then runs the graph as it is: the rewrite is what is fuzzed, and Inductor's
codegen (seconds per program on a 2-core runner) would cap CI at a few dozen programs. A
smaller set runs through the real backend. ``--slow`` runs the long fuzz. A failing program
is shrunk by hypothesis and printed as source; ``test_known_bug`` keeps the minimal repros of
the recognizer issues found so far.
"""

from __future__ import annotations

import collections
import time

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, seed, settings
from torch._dynamo.utils import counters
from torch.overrides import TorchFunctionMode

import gla_inductor
from fuzz_programs import Program, categories
from gla_inductor.backend import rewrite
from helpers import outputs, rel_err_floor

pytestmark = pytest.mark.usefixtures("one_thread")

# max |compiled - float64| / max |float64| per output and gradient. fp32 programs run T <= 8
# steps: their own rounding is ~1e-6 (3e-6 the largest seen in 5000 programs); bf16 programs
# compute in fp32 after casting, and round outputs and gradients to bf16 once, 2**-9 relative.
FP32_TOL = 1e-4
BF16_TOL = 1e-2

CI_PROGRAMS = 390  # at least 300 (asserted); ~320 over the older categories, the rest over fuzz_new_forms.py
SLOW_PROGRAMS = 5200
# Inductor's codegen takes ~7 s a program here: a dozen, over the main categories
INDUCTOR_CATEGORIES = {"loop": 4, "parallel": 4, "decode": 2, "loop/delta": 1, "parallel/strict": 1,
                       "buffer-mask": 1, "decay-factor": 1}
SEED = 20240611


def rewrite_only(gm: torch.fx.GraphModule, example_inputs: list):
    """The backend's graph rewrite without Inductor: the rewritten graph runs eagerly."""
    _results.append(rewrite(gm, example_inputs))
    return gm.forward


# what the last rewrite_only call found, for failure messages
_results: list = []


class Float64Mode(TorchFunctionMode):
    """Run a program in float64 throughout, its fp32 casts and fp32 allocations included, so
    that the reference is the same source at double precision (not a mix that errors or rounds)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.float:
            return args[0].double()
        if kwargs.get("dtype") == torch.float32:
            kwargs["dtype"] = torch.float64
        args = tuple(torch.float64 if a is torch.float32 else a for a in args)
        return func(*args, **kwargs)

    def __enter__(self):
        self._default = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)
        return super().__enter__()

    def __exit__(self, *exc):
        torch.set_default_dtype(self._default)
        return super().__exit__(*exc)


def _run(fn, args: list, prog: Program):
    """Outputs, gradients of every input under random upstream gradients (training programs),
    and the inputs as the program left them (a decode step may write its cache in place)."""
    args = [a.detach().clone() for a in args]
    if not prog.train:
        with torch.no_grad():
            return [o.detach() for o in outputs(fn(*args))], [], args
    leaves = [a.requires_grad_() for a in args]
    outs = outputs(fn(*leaves))
    gen = torch.Generator().manual_seed(prog.seed)
    # weights exact in bf16: rounding them to a bf16 output's dtype in the backward would perturb
    # every upstream gradient, and sums like dg_gamma can cancel down to that noise
    weights = [torch.randn(o.shape, generator=gen, dtype=torch.float64).bfloat16().double() for o in outs]
    loss = sum((o.double() * w).sum() for o, w in zip(outs, weights))
    grads = torch.autograd.grad(loss, leaves, allow_unused=True, materialize_grads=True)
    return [o.detach() for o in outs], list(grads), [x.detach() for x in leaves]


def _reference(prog: Program, fn, args: list):
    """The same program in float64, its casts and allocations included (bf16 inputs are exact in
    float64, and bf16 programs cast to fp32 before any arithmetic)."""
    with Float64Mode():
        return _run(fn, [a.double() for a in args], prog)


def check_program(prog: Program, backend) -> tuple[int, float]:
    """Assert the properties of one program; return the number of rewrites and the largest
    relative error seen (of outputs, gradients and in-place writes)."""
    torch._dynamo.reset()
    counters.clear()
    fn = prog.function()
    args = prog.inputs()
    ref_outs, ref_grads, ref_args = _reference(prog, fn, args)
    _results.clear()
    outs, grads, final_args = _run(torch.compile(fn, backend=backend, fullgraph=True), args, prog)
    rewrites = counters["gla_inductor"]["rewrites"]
    reasons = sorted({nm.reason for r in _results for nm in r.near_misses})
    where = f"\n{prog}\nrewrites: {rewrites}; left alone: {reasons}"
    assert counters["gla_inductor"]["failures"] == 0, "the rewrite raised" + where
    tol = BF16_TOL if prog.dtype == torch.bfloat16 else FP32_TOL
    assert len(outs) == len(ref_outs), where
    errs = [0.0]
    # A gradient that cancels to zero in exact arithmetic is rounding noise in both runs (the
    # decay exp(G_1 - g_1 - G_0) = 1 of an exclusive read at T = 2 does not depend on g): a
    # gradient's error is relative to at least 1e-3 of the largest gradient, an absolute 1e-7
    # of it at FP32_TOL, far below any wrong rewrite. Outputs are compared relative to themselves.
    grad_floor = 1e-3 * max((r.abs().max().item() for r in ref_grads if r.numel()), default=0.0)

    def check(what, got, ref, floor=0.0):
        assert got.shape == ref.shape, f"{what} has shape {tuple(got.shape)}, eager {tuple(ref.shape)}" + where
        errs.append(rel_err_floor(got, ref, floor))
        assert errs[-1] <= tol, f"{what}: relative error {errs[-1]:.2e} > {tol:.0e}" + where

    for n, (o, r) in enumerate(zip(outs, ref_outs)):
        check(f"output {n}", o, r)
    for (name, _, _), g, r in zip(prog.args, grads, ref_grads):
        check(f"d{name}", g, r, grad_floor)
    for (name, _, _), a, final, ref in zip(prog.args, args, final_args, ref_args):
        if name == prog.mutates:
            check(f"{name} written in place", final, ref)
        else:
            assert torch.equal(final, a), f"the compiled program changed its input {name}" + where
    if prog.expected is not None:
        assert rewrites == prog.expected, f"expected {prog.expected} rewrite(s)" + where
    for m in (m for r in _results for m in r.matches):  # rewrite_only runs: what each rewrite folded in
        got = {k: m.options.get(k) for k in prog.expected_options}
        assert got == prog.expected_options, f"rewrite options {got}, expected {prog.expected_options}" + where
    return rewrites, max(errs)


class Stats:
    """Counts per kind and per category (form/gate or form/mutation)."""

    def __init__(self):
        self.kinds = collections.Counter()
        self.rewritten = collections.Counter()
        self.names = collections.Counter()
        self.max_err = {torch.float32: 0.0, torch.bfloat16: 0.0}
        self.seconds = 0.0

    def add(self, prog: Program, outcome: tuple[int, float]) -> None:
        rewrites, err = outcome
        self.kinds[prog.kind] += 1
        self.names[prog.name] += 1
        self.max_err[prog.dtype] = max(self.max_err[prog.dtype], err)
        if rewrites:
            self.rewritten[prog.kind] += 1

    @property
    def total(self) -> int:
        return sum(self.kinds.values())

    def report(self, title: str) -> str:
        kinds = ", ".join(f"{k} {n} ({self.rewritten[k]} rewritten)" for k, n in sorted(self.kinds.items()))
        names = ", ".join(f"{k} {n}" for k, n in sorted(self.names.items()))
        errs = f"largest relative error fp32 {self.max_err[torch.float32]:.1e}, bf16 {self.max_err[torch.bfloat16]:.1e}"
        return f"{title}: {self.total} programs in {self.seconds:.0f} s; {kinds}; {errs}\n  per category: {names}"


def run_fuzz(n: int, backend, seed_value: int) -> Stats:
    """About n programs over every category of fuzz_programs.categories(), by weight."""
    stats = Stats()
    cats = categories()
    total = sum(weight for _, weight, _ in cats)
    start = time.perf_counter()
    for i, (_, weight, strategy) in enumerate(cats):
        _fuzz(strategy, max(1, round(n * weight / total)), backend, seed_value + i, stats)
    stats.seconds = time.perf_counter() - start
    return stats


def _fuzz(strategy, n: int, backend, seed_value: int, stats: Stats) -> None:
    # shrinking recompiles the program many times: affordable without Inductor only
    phases = (Phase.generate, Phase.shrink) if backend is rewrite_only else (Phase.generate,)

    @settings(max_examples=n, database=None, deadline=None, suppress_health_check=list(HealthCheck), phases=phases)
    @seed(seed_value)
    @given(prog=strategy)
    def fuzz(prog: Program) -> None:
        stats.add(prog, check_program(prog, backend))

    fuzz()


def _check_stats(stats: Stats, at_least: int) -> None:
    assert stats.total >= at_least, stats.report("too few programs")
    for kind in ("gla", "near", "decode", "equivalent"):  # gap and known may run out one day
        assert stats.kinds[kind] > 0, f"no {kind} programs were generated"
    assert stats.rewritten["near"] == 0
    assert stats.rewritten["gla"] == stats.kinds["gla"]


def test_fuzz_rewrite(report_summary):
    stats = run_fuzz(CI_PROGRAMS, rewrite_only, SEED)
    report_summary(stats.report("fuzz (rewrite only)"))
    _check_stats(stats, 300)


def test_fuzz_inductor(report_summary):
    """Fewer programs through the real backend: the rewritten graphs must survive Inductor too."""
    stats = Stats()
    start = time.perf_counter()
    for i, (name, _, strategy) in enumerate(categories()):
        if name in INDUCTOR_CATEGORIES:
            _fuzz(strategy, INDUCTOR_CATEGORIES[name], gla_inductor.backend, SEED + 1000 + i, stats)
    stats.seconds = time.perf_counter() - start
    report_summary(stats.report("fuzz (Inductor)"))
    assert stats.total >= sum(INDUCTOR_CATEGORIES.values()) - 1
    assert stats.rewritten["near"] == 0
    assert stats.rewritten["gla"] == stats.kinds["gla"]


@pytest.mark.slow
def test_fuzz_rewrite_long(report_summary):
    stats = run_fuzz(SLOW_PROGRAMS, rewrite_only, SEED + 2)
    report_summary(stats.report("fuzz (long, rewrite only)"))
    _check_stats(stats, 5000)


# ----------------------------------------------------------------------------------------------
# minimal repros of recognizer bugs the fuzzer found, kept as regression tests now that they are
# fixed. A bug found next goes here as a strict xfail, with a "bug: ..." gap in fuzz_programs.py
# that excludes it from the rewrites the fuzzer requires, until it is fixed.
# ----------------------------------------------------------------------------------------------


def constant_gate_one_batch(q, k, v, g_gamma):
    """B = 1, H = 2: the one batch axis was read as the batch, so the replacement's per-head
    gate did not fit ("The expanded size of the tensor (1) must match the existing size (2)")."""
    T = q.shape[2]
    i = torch.arange(T)
    D = torch.exp((i[:, None] - i[None, :]) * g_gamma[:, None, None]).masked_fill(~(i[:, None] >= i[None, :]), 0)
    return ((q @ k.transpose(-1, -2)) * D) @ v


def vector_factored_mT(q, k, v, g):
    """.mT (Dynamo: getattr(x, "mT")) was opaque: "the decay exponent is not of the form G_i - G_j"."""
    G = g.cumsum(-2)
    return ((q * G.exp()) @ (k * (-G).exp()).mT).tril() @ v


def rwkv6_bonus_from_cache(q, k, v, g, h0):
    """RWKV-6 style: read S_{t-1} + 0.5 k_t^T v_t, then update. The decode form rewrote the
    first read q_0 (h0 + 0.5 k_0^T v_0) as a one-token step (right, but a near miss); now a
    cache updated twice is no decode step."""
    S = h0
    outs = []
    for t in range(q.shape[2]):
        kv = k[:, :, t, :, None] * v[:, :, t, None, :]
        outs.append((q[:, :, t, :, None] * (S + 0.5 * kv)).sum(-2))
        S = S * g[:, :, t].exp()[..., None] + kv
    return torch.stack(outs, dim=2)


def _known_bug_inputs(name):
    gen = torch.Generator().manual_seed(0)
    B, H, T, K, V = 1, 2, 5, 3, 4
    q, k = torch.randn(B, H, T, K, generator=gen), torch.randn(B, H, T, K, generator=gen)
    v = torch.randn(B, H, T, V, generator=gen)
    gate = (H,) if name == "constant_gate_one_batch" else (B, H, T, K)
    g = torch.nn.functional.logsigmoid(torch.randn(gate, generator=gen))
    if name == "rwkv6_bonus_from_cache":
        return q, k, v, g, torch.randn(B, H, K, V, generator=gen)
    return q, k, v, g


@pytest.mark.parametrize("fn,rewrites", [
    (constant_gate_one_batch, 1),
    (vector_factored_mT, 1),
    (rwkv6_bonus_from_cache, 0),
], ids=lambda x: getattr(x, "__name__", str(x)))
def test_known_bug(fn, rewrites):
    torch._dynamo.reset()
    counters.clear()
    args = _known_bug_inputs(fn.__name__)
    out = torch.compile(fn, backend=rewrite_only, fullgraph=True)(*args)
    assert rel_err_floor(out, fn(*[a.double() for a in args])) <= FP32_TOL
    assert counters["gla_inductor"]["rewrites"] == rewrites


# ----------------------------------------------------------------------------------------------
# recognizer gaps the fuzzer found in fuzz_new_forms.py (GLA programs left alone, kind "gap"
# there), each kept here as a regression test once the recognizer rewrites it.
# ----------------------------------------------------------------------------------------------


def _gap_program(family: str, choices: dict, dims: dict, train: bool = True) -> Program:
    """A program of fuzz_new_forms.py's renderers at fixed choices, required to be rewritten once."""
    import fuzz_new_forms as nf

    d = {"B": 2, "H": 2, "T": 4, "K": 3, "V": 4, **dims}
    B, H, T, K, V = (d[x] for x in "BHTKV")
    if family == "normalized":
        c = {"mutation": None, "layout": "BHTD", "mask": "inf_exp", "rows": "sqrt_sum", "scale": "none",
             "variant": "before", "detach": True, "cast": False, "sum": "keepdim", "clamp": "clamp_min_kw",
             "sqrt": False, "reverse": False, "base": 5, **choices}
        args, source = [(x, (B, H, T, V if x == "v" else K), "randn") for x in "qkv"], nf.render_normalized(c)
    elif family == "decode":
        c = {"mutation": None, "variant": "constant", "divisor": "none", "v_first": False, "read": "sum",
             "update": "S * a + kv", **choices}
        args = [("q", (B, H, 1, K), "randn"), ("k", (B, H, 1, K), "randn"), ("v", (B, H, V), "randn"),
                ("prev", (B, H, V, K) if c["v_first"] else (B, H, K, V), "state")] + ([("x", (B, H), "randn")] if c["variant"] == "sigmoid" else [])
        source = nf.render_decode(c, d, [a[0] for a in args])
    elif family == "factor-loop":
        c = {"variant": "loop_sigmoid", "divisor": "none", "v_first": False, "update": "S * a + kv", **choices}
        args = [("q", (B, T, H, K), "randn"), ("k", (B, T, H, K), "randn"), ("v", (B, T, H, V), "randn"),
                ("x", (B, T, H), "randn")]
        source = nf.render_factor_loop(c, [a[0] for a in args])
    else:
        c = {"mutation": None, "variant": "cumsum", "source": "input", "shift": "pad", "pow": "op", "C": 2,
             "base": 2, **choices}
        args = [(x, (B, H, T, V if x == "v" else K), "randn") for x in "qkv"]
        args += [("gamma", (H,), "unit")] if c["source"] == "input" else []
        source = nf.render_power_chunks(c, d, [a[0] for a in args])
    return Program(kind="gla", name=f"gap/{family}", source=source, args=args, dtype=torch.float32, seed=0,
                   gate_dist="decay", choices=c, dims=d, expected=1, train=train)


# the next gap found goes here as a strict xfail (raises=AssertionError), beside a kind "gap" in
# fuzz_new_forms.py, until the recognizer rewrites it


@pytest.mark.parametrize("family,choices,dims", [
    ("normalized", {}, {"K": 1}),  # scores contracted over nothing but a size-1 axis
    ("normalized", {"variant": "after", "mask": "power"}, {"B": 1, "H": 1, "K": 1, "V": 1}),
    ("power-chunks", {}, {"T": 2, "K": 2, "V": 2}),  # one chunk, B = H = K = V = T: the output tried as the gate
    ("power-chunks", {"variant": "loop"}, {"T": 2, "K": 2, "V": 2}),
    ("power-chunks", {}, {"V": 1}),  # no value axis: q is the input with the query position
    ("power-chunks", {"variant": "loop", "source": "buffer"}, {"K": 1}),
    ("power-chunks", {"shift": "cat"}, {"B": 1, "H": 1, "K": 1, "V": 1}),
], ids=["normalized-K1", "normalized-all-1", "power-one-chunk-all-2", "power-loop-one-chunk-all-2", "power-V1",
        "power-loop-buffer-K1", "power-cat-all-1"])
def test_former_new_form_gap(family, choices, dims):
    """Gaps closed since: rewritten once, exact against float64 in value and gradients."""
    check_program(_gap_program(family, choices, dims), rewrite_only)


@pytest.mark.parametrize("family,choices,dims", [
    ("power-chunks", {"variant": "loop"}, {"B": 1}),  # the one batch axis read as the heads
    ("power-chunks", {"source": "buffer"}, {"B": 1}),
    ("power-chunks", {"variant": "loop"}, {"T": 2}),  # a loop of one chunk
    ("power-chunks", {"shift": "cat"}, {"K": 4}),  # K = V: a zeros_like's input is no final state
    ("power-chunks", {"shift": "cat", "source": "buffer", "C": 3}, {"T": 9, "K": 8, "V": 2}),  # V = H
], ids=["power-loop-B1", "power-buffer-B1", "power-loop-one-chunk", "power-cat-K-eq-V", "power-cat-V-eq-H"])
def test_former_chunk_gap(family, choices, dims):
    """Gaps closed since: rewritten once, exact against float64 in value and gradients."""
    check_program(_gap_program(family, choices, dims), rewrite_only)


# former gaps, now rewritten: a decode step's outer product divided by a tensor built from
# constants (steps._inverse), and the corners at K or V of 1 where a decay, k_t or v_t is
# indexed like the state (steps._decay_term, steps._state_factors)
@pytest.mark.parametrize("family,choices,dims", [
    ("decode", {"divisor": "const_head"}, {}),
    ("decode", {"variant": "sigmoid", "divisor": "key", "update": "kv + S * a"}, {"K": 1}),
    ("decode", {"variant": "sigmoid", "divisor": "key", "update": "kv + S * a"}, {"V": 1}),
    ("decode", {"variant": "sigmoid", "read": "einsum", "update": "kv + S * a"}, {"K": 1, "V": 7}),
    ("decode", {"variant": "sigmoid", "update": "kv + S * a", "v_first": True}, {"V": 1}),
    ("decode", {"variant": "sigmoid", "update": "kv + S * a"}, {"B": 1, "H": 1, "K": 1, "V": 1}),
    ("factor-loop", {}, {"K": 1, "V": 1}),
    ("factor-loop", {"update": "kv + S * a", "v_first": True}, {"B": 1, "H": 1, "K": 1, "V": 1}),
], ids=["decode-constant-divisor", "decode-key-divisor-K1", "decode-key-divisor-V1", "decode-sigmoid-K1",
        "decode-v-first-V1", "decode-all-1", "factor-loop-K1-V1", "factor-loop-all-1"])
def test_former_step_gap(family, choices, dims):
    check_program(_gap_program(family, choices, dims), rewrite_only)


@pytest.mark.parametrize("divisor", ["torch.full((H, 1, 1), 2.0)", "torch.tensor([0.5, 3.0]).view(H, 1, 1)",
                                     "torch.ones(H, 1, 1) * 3"])
def test_constant_divisor_forms(divisor):
    """Other divisors built from constants fold into the decode step the same way."""
    prog = _gap_program("decode", {"divisor": "const_head"}, {})
    line = next(x for x in prog.source.splitlines() if x.strip().startswith("y = "))
    prog.source = prog.source.replace(line, line.split("y = ")[0] + "y = " + divisor)
    assert divisor in prog.source
    check_program(prog, rewrite_only)
