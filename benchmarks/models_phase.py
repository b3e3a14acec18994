"""The models benchmark's phases: a variant per protected call, errors against a reference, budgets."""

from __future__ import annotations

import contextlib
import signal
import traceback

import torch
from torch._dynamo.utils import counters

from benchmarks import harness

NO_SPLIT_NOTE = "scans unsplit: default Inductor failed to compile (SplitScan codegen error)"


class PhaseTimeout(BaseException):
    """A BaseException, so that no `except Exception` on the way (the backend's, the certificate's)
    swallows it."""


@contextlib.contextmanager
def alarm(seconds: float):
    def ring(signum, frame):
        raise PhaseTimeout(f"phase budget of {seconds:.0f} s exhausted")

    old = signal.signal(signal.SIGALRM, ring)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 1.0))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def errors(out: torch.Tensor, ref: torch.Tensor, prefix: str = "") -> dict:
    """max |out - ref|, that over max |ref|, ||out - ref|| / ||ref||, non-finite outputs."""
    d, r = out.detach().double() - ref.detach().double(), ref.detach().double()
    if d.numel() == 0:
        return {}
    e = {"max_abs_err": d.abs().max().item(), "max_rel_err": (d.abs().max() / r.abs().max().clamp_min(1e-30)).item(),
         "norm_rel_err": (d.norm() / r.norm().clamp_min(1e-30)).item(), "nonfinite": int((~out.isfinite()).sum())}
    return {prefix + k: v for k, v in e.items()}


def worst_errors(outs: list, refs: list, prefix: str) -> dict:
    each = [errors(a, b, prefix) for a, b in zip(outs, refs)]
    return {k: max(e[k] for e in each) for k in each[0]} if each else {}


# Default Inductor on torch 2.11 fails to compile the scan's cumsum over a chunk (a SplitScan codegen
# error; split_reductions=False does not help). The baseline is then Inductor with scans unsplit.
@contextlib.contextmanager
def unsplit_scans():
    from torch._inductor import ir

    real = ir.Scan.__dict__["num_splits"]
    ir.Scan.num_splits = classmethod(lambda cls, **kw: (ir.ReductionHint.DEFAULT, 1))
    try:
        yield
    finally:
        ir.Scan.num_splits = real


def compile_stats() -> dict:
    g = counters["gla_inductor"]
    return {"rewrites": g["rewrites"], "rewrite_failures": g["failures"], "near_misses": g["near_misses"],
            "graphs": counters["stats"]["unique_graphs"], "graph_breaks": sum(counters["graph_break"].values())}


def sliced(call, x, slices: int):
    return call(x) if slices == 1 else torch.cat([call(xs) for xs in x.chunk(slices)], 0)


def fit_slices(call, x):
    """(slices, output): the fewest batch slices that run without running out of memory."""
    n = 1
    while True:
        try:
            return n, sliced(call, x, n)
        except Exception as e:
            if not harness.is_oom(e) or n >= x.shape[0]:
                raise
            harness.free_memory()
            n *= 2


class Phase:
    """One phase's rows, with each variant protected: an exception becomes an error row."""

    def __init__(self, name: str, setup, recorder: list):
        # setup: models.Setup (device, dtype, clock, rounds, which variants run)
        self.name, self.setup, self.recorder = name, setup, recorder
        self.rows, self.info, self.failures, self.current = [], {}, [], None

    def row(self, variant: str, **fields) -> dict:
        r = {"phase": self.name, "variant": variant, **fields}
        self.rows.append(r)
        harness.log({k: v for k, v in r.items() if k != "rewrite_log"})
        return r

    def timed(self, variant: str, fn, **fields) -> dict:
        t = harness.time_one(fn, clock=self.setup.clock, rounds=self.setup.rounds)
        return self.row(variant, **t.fields(), **fields)

    def protect(self, variant: str, fn):
        outer, self.current = self.current, variant
        try:
            return fn()
        except Exception as e:
            self.failures.append(f"[{self.name} / {variant}]\n{traceback.format_exc()}")
            self.row(variant, error=harness.error_text(e, 400))
            harness.free_memory()
            return None
        finally:
            self.current = outer

    def compiled(self, variant: str, module):
        import gla_inductor

        torch._dynamo.reset()
        counters.clear()
        self.recorder.clear()
        backend = gla_inductor.backend if variant == "ours" else "inductor"
        return torch.compile(module, backend=backend, dynamic=False)

    def each_compiled(self, module, measure) -> None:
        """measure(variant, compiled module, note) for ours and default Inductor; Inductor once more
        with unsplit scans where it failed."""
        for variant in ["ours"] + (["inductor"] if self.setup.inductor else []):
            done = self.protect(variant, lambda: measure(variant, self.compiled(variant, module), None))
            if done is None and variant == "inductor":
                with unsplit_scans():
                    self.protect(variant, lambda: measure(variant, self.compiled(variant, module), NO_SPLIT_NOTE))
            torch._dynamo.reset()
            harness.free_memory()

    def compiled_row(self, variant, fn, note, check=None) -> tuple:
        """Compile (first call), then time: (the row with compile and rewrite statistics, the first
        call's output); ``check(output) -> dict`` adds fields right after the first call."""
        fields = {}
        out, first, warm = harness.first_and_warm(fn, self.setup.device,
                                                  lambda o: fields.update(check(o) if check else {}))
        stats = compile_stats()
        r = self.timed(variant, fn, compile_s=first - warm, first_call_s=first, **stats, note=note,
                       rewrite_log=list(self.recorder) if variant == "ours" else None, **fields)
        r["recompiles_while_timed"] = compile_stats()["graphs"] - stats["graphs"]
        r["peak_mib"] = harness.peak_extra_mib(fn)
        return r, out
