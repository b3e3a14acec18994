"""GPU benchmark of transformers' Mamba2 on its PyTorch path (no mamba_ssm / causal_conv1d), compiled with
our backend: issue 5, item 5 and its target.

    python benchmarks/gpu_mamba2.py [--out DIR] [--phases mixer,mixer_grouped,prefill,decode]
    python benchmarks/gpu_mamba2.py --check        # CPU, fp32, tiny shapes: every phase end to end

On the GPU machine, a phase group per command (a command gets 10 minutes; ours' compile time includes the
backend's float64 certificate of the scan, run on the CPU at 2 batches and 2 heads where the scan treats them
all alike, a few seconds at the mixer's sizes; see recognize/shrink.py):
    OUT=$OUT PHASES=mixer bash benchmarks/gpu_mamba2.sh
    OUT=$OUT PHASES=prefill,decode NAME=mamba2_model bash benchmarks/gpu_mamba2.sh
    OUT=$OUT PHASES=mixer_grouped NAME=mamba2_grouped bash benchmarks/gpu_mamba2.sh

Phases (each protected: a failure or an exhausted time budget is recorded and the next phase runs):
  mixer          one ``Mamba2Mixer`` at 1.3B-like sizes (B=4, T=4096, hidden 2048, 64 heads of 64, state 128,
                 n_groups 1, chunk 256), bf16, prefill forward without cache under ``torch.no_grad``:
                 eager; ``torch.compile`` (default Inductor); ``torch.compile(backend=gla_inductor.backend)``.
                 Target: ours >= 5x faster than default Inductor, with exactly 1 rewrite.
                 Errors of every variant against the same layer run eagerly in fp32 (same weights, same input).
                 Also the scan op alone (``gla_inductor.chunk_gla`` on the shapes and fp32 dtypes the rewrite
                 passes it), to show which share of the layer the scan is.
  mixer_grouped  the same with n_groups 8 (B/C shared by groups of 8 heads).
  prefill        ``Mamba2ForCausalLM`` (4 layers, hidden 768, 24 heads of 64, state 128, random weights), bf16,
                 prefill B=4, T=1024 with ``use_cache=True`` (as generation's first step): eager, ours, Inductor.
                 Errors of the logits and of the final SSM states against the fp32 model.
  decode         the same model, one-token decode with a cache at B=64 (cache filled by an eager prompt):
                 eager, ours, Inductor; also timed from a CUDA graph where capture works. Errors of the logits
                 and of the updated states against eager in the same dtype, from identical caches.

Compiled variants use ``dynamic=False`` (the chunked form is certified at static sizes). Timing: median of
``triton.testing.do_bench`` (CUDA events, warm-up excluded); compile time is the wall time of the first call
minus a warm call. When eager runs out of memory at full batch (transformers <= 5.17 spells the scan as
broadcast-multiply-sums that materialize [b, c, l, s, h, n] tensors), it runs in batch slices, one after the
other, and the row says so.

Budgets: GLA_BENCH_PHASE_S (default 420 s) per phase, GLA_BENCH_TOTAL_S (default 560 s) for the run; a phase
past its budget is interrupted (its rows so far are kept), a phase that cannot start in time is skipped.
Results are written after every phase to DIR/NAME.json and DIR/NAME.md (DIR: --out, else $OUT, else
benchmarks/results; NAME: --name, default mamba2), tracebacks to DIR/NAME_tracebacks.txt; a short table is
printed last.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import gc
import importlib.util
import inspect
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # the package is not installed on the GPU machine
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402

FAST_PATHS = ("mamba_ssm", "causal_conv1d", "kernels")  # what transformers' Mamba2 would run instead
ALL_PHASES = ("mixer", "mixer_grouped", "prefill", "decode")
TARGET = 5.0  # ours vs default Inductor, mixer phases
SPELLING = "?"  # how the installed transformers spells the SSD scan (set in main)


# ---------------------------------------------------------------------------------------------------------------
# shapes
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class MixerShape:
    B: int = 4
    T: int = 4096
    hidden: int = 2048
    heads: int = 64
    head_dim: int = 64
    state: int = 128
    groups: int = 1
    chunk: int = 256
    conv: int = 4


@dataclass
class ModelShape:
    layers: int = 4
    hidden: int = 768
    heads: int = 24
    head_dim: int = 64
    state: int = 128
    groups: int = 1
    chunk: int = 256
    conv: int = 4
    vocab: int = 8192
    prefill_B: int = 4  # 8 doubles the backend's CPU certificate (minutes with transformers <= 5.17)
    prefill_T: int = 1024
    decode_B: int = 64
    prompt_T: int = 32


@dataclass
class Setup:
    device: str
    dtype: torch.dtype
    mixer: MixerShape
    grouped: MixerShape
    model: ModelShape
    inductor: bool = True  # run the default-Inductor column
    graphs: bool = True  # CUDA-graph timings for decode
    check: bool = False
    extra: dict = field(default_factory=dict)


def gpu_setup() -> Setup:
    m = MixerShape()
    return Setup("cuda", torch.bfloat16, m, replace(m, groups=8), ModelShape())


def check_setup(inductor: bool) -> Setup:
    # T not a multiple of the chunk: the padded last chunk; grouped: 2 heads per group
    m = MixerShape(B=2, T=80, hidden=64, heads=8, head_dim=16, state=16, groups=1, chunk=32)
    model = ModelShape(layers=2, hidden=64, heads=8, head_dim=16, state=16, chunk=32, vocab=128,
                       prefill_B=2, prefill_T=40, decode_B=4, prompt_T=8)
    return Setup("cpu", torch.float32, m, replace(m, groups=4), model, inductor=inductor, graphs=False, check=True)


def mamba2_config(s, layers: int, vocab: int = 32):
    from transformers import Mamba2Config

    assert s.hidden * 2 == s.heads * s.head_dim, "Mamba2 needs hidden * expand == heads * head_dim"
    return Mamba2Config(vocab_size=vocab, hidden_size=s.hidden, num_hidden_layers=layers, num_heads=s.heads,
                        head_dim=s.head_dim, expand=2, state_size=s.state, n_groups=s.groups, chunk_size=s.chunk,
                        conv_kernel=s.conv)


# ---------------------------------------------------------------------------------------------------------------
# measurement helpers
# ---------------------------------------------------------------------------------------------------------------


class PhaseTimeout(BaseException):
    """Raised by the alarm; a BaseException so that no `except Exception` on the way swallows it (the backend
    and the certificate both catch Exception and would carry on)."""


@contextlib.contextmanager
def alarm(seconds: float | None):
    if not seconds or not hasattr(signal, "SIGALRM"):
        yield
        return

    def ring(signum, frame):
        raise PhaseTimeout(f"phase budget of {seconds:.0f} s exhausted")

    old = signal.signal(signal.SIGALRM, ring)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 1.0))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def sync(device: str):
    if device == "cuda":
        torch.cuda.synchronize()


def bench(fn, device: str, warmup: int = 25, rep: int = 100) -> tuple[float, float, float]:
    """(median, 20th, 80th percentile) ms. CUDA: triton's do_bench (events); CPU: a few timed calls."""
    if device == "cuda":
        from triton.testing import do_bench

        med, lo, hi = do_bench(fn, warmup=warmup, rep=rep, quantiles=[0.5, 0.2, 0.8])
        return med, lo, hi
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return times[1], times[0], times[2]


def bench_graph(fn) -> float:
    """Median ms of fn replayed from a CUDA graph, NaN where capture fails."""
    from triton.testing import do_bench_cudagraph

    try:
        return do_bench_cudagraph(fn, rep=100, return_mode="median")
    except Exception as e:  # a host sync or something else capture refuses
        with contextlib.suppress(Exception):
            torch.cuda.synchronize()
        print(f"  (CUDA graph capture failed: {type(e).__name__}: {str(e)[:160]})", flush=True)
        return float("nan")


def is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e).lower() \
        or "can't allocate memory" in str(e).lower()


def free(device: str):
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def errors(out: torch.Tensor, ref: torch.Tensor) -> dict:
    """max |out - ref|, that over max |ref|, and ||out - ref|| / ||ref||."""
    d = out.detach().double() - ref.detach().double()
    r = ref.detach().double()
    if d.numel() == 0:
        return {"max_abs_err": 0.0, "max_rel_err": 0.0, "norm_rel_err": 0.0}
    scale = r.abs().max().clamp_min(1e-30)
    return {"max_abs_err": d.abs().max().item(), "max_rel_err": (d.abs().max() / scale).item(),
            "norm_rel_err": (d.norm() / r.norm().clamp_min(1e-30)).item(),
            "nonfinite": int((~torch.isfinite(out)).sum().item())}


def worst(errs: list[dict]) -> dict:
    if not errs:
        return {}
    return {k: max(e.get(k, 0) for e in errs) for k in errs[0]}


def prefixed(prefix: str, d: dict) -> dict:
    return {f"{prefix}{k}": v for k, v in d.items()}


class Recorder:
    """What the backend did with each graph: matches, near misses, seconds spent in the rewrite."""

    def __init__(self):
        self.graphs: list[dict] = []

    def __call__(self, gm, result):
        self.graphs.append({"matches": [f"{m.form}/{m.gate}/{m.layout} {m.shapes}" for m in result.matches],
                            "near_misses": [f"{n.form}: {n.reason}"[:200] for n in result.near_misses],
                            "rewrite_s": round(result.seconds, 2)})
        print(f"  gla_inductor: graph {len(self.graphs)}: {len(result.matches)} rewrite(s) in {result.seconds:.1f} s"
              f"{'; left alone: ' + str(self.graphs[-1]['near_misses'][:3]) if result.near_misses else ''}",
              flush=True)


RECORDER = Recorder()


def make_compiled(variant: str, module):
    import gla_inductor

    torch._dynamo.reset()
    counters.clear()
    RECORDER.graphs.clear()
    if variant == "ours":
        return torch.compile(module, backend=gla_inductor.backend, dynamic=False)
    return torch.compile(module, dynamic=False)


# Default Inductor on torch 2.11 fails to compile the scan's cumsum over a chunk (a SplitScan
# codegen error: "list indices must be integers or slices, not NoneType"; split_reductions=False
# does not help, scans always split). The baseline is then Inductor with scans left unsplit
# (one program per scanned row), said in the row's note.
@contextlib.contextmanager
def unsplit_scans():
    from torch._inductor import ir

    real = ir.Scan.__dict__["num_splits"]
    ir.Scan.num_splits = classmethod(lambda cls, **kw: (ir.ReductionHint.DEFAULT, 1))
    try:
        yield
    finally:
        ir.Scan.num_splits = real


def protect_compiled(ph, variant: str, compiled) -> None:
    """Run a compiled variant; Inductor once more with unsplit scans if it failed (the row says so)."""
    if ph.protect(variant, compiled) is None and variant == "inductor":
        torch._dynamo.reset()
        free(ph.device)
        with unsplit_scans():
            ph.protect(variant, lambda: compiled(variant, True))


NO_SPLIT_NOTE = "scans unsplit: default Inductor failed to compile (SplitScan codegen error)"


def compile_stats() -> dict:
    g = counters["gla_inductor"]
    return {"rewrites": g["rewrites"], "rewrite_failures": g["failures"], "near_misses": g["near_misses"],
            "graphs": counters["stats"]["unique_graphs"],
            "graph_breaks": sum(counters["graph_break"].values())}


def timed_first_calls(fn, device: str):
    """(output of the first call, first-call s, warm-call s)."""
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    fn()
    sync(device)
    return out, first, time.perf_counter() - t0


def sliced(call, x: torch.Tensor, slices: int):
    """call over the batch in `slices` pieces, one after the other (eager at sizes that do not fit at once)."""
    if slices == 1:
        return call(x)
    return torch.cat([call(xs) for xs in x.chunk(slices)], 0)


def fit_slices(call, x: torch.Tensor, device: str):
    """(slices, output): the fewest batch slices that run without running out of memory."""
    n = 1
    while True:
        try:
            return n, sliced(call, x, n)
        except Exception as e:
            if not is_oom(e) or n >= x.shape[0]:
                raise
            print(f"  out of memory at {x.shape[0] // n} per call; slicing the batch further", flush=True)
            free(device)
            n *= 2


def peak_mib(fn, device: str) -> float | None:
    if device != "cuda":
        return None
    free(device)
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


# ---------------------------------------------------------------------------------------------------------------
# phases
# ---------------------------------------------------------------------------------------------------------------


class Phase:
    def __init__(self, name: str, setup: Setup, log):
        self.name, self.setup, self.log = name, setup, log
        self.rows: list[dict] = []
        self.info: dict = {}
        self.failures: list[str] = []  # tracebacks of variants that failed
        self.current: str | None = None  # the variant running now (named in the row a timeout leaves)

    @property
    def device(self):
        return self.setup.device

    def row(self, variant: str, **fields) -> dict:
        r = {"phase": self.name, "variant": variant, **fields}
        self.rows.append(r)
        self.log(r)
        return r

    def protect(self, variant: str, fn, **fields):
        """Run one variant; an exception becomes an error row (PhaseTimeout passes through)."""
        outer, self.current = self.current, variant
        try:
            result = fn()
            self.current = outer
            return result
        except Exception as e:
            self.current = outer
            tb = traceback.format_exc()
            self.failures.append(f"[{self.name} / {variant}]\n{tb}")
            print(f"  {variant} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
            self.row(variant, error=f"{type(e).__name__}: {str(e)[:400]}", **fields)
            free(self.device)
            return None


def run_mixer(ph: Phase, s: MixerShape):
    from transformers.models.mamba2.modeling_mamba2 import Mamba2Mixer

    dev, dt = ph.device, ph.setup.dtype
    shape = asdict(s)
    ph.info.update(shape=shape, dtype=str(dt).replace("torch.", ""))
    torch.manual_seed(0)
    ref_mixer = Mamba2Mixer(mamba2_config(s, layers=1), layer_idx=0).to(dev).eval()  # fp32
    mixer = copy.deepcopy(ref_mixer).to(dt)
    x = torch.randn(s.B, s.T, s.hidden, device=dev).to(dt)
    ref = {}
    outs = {}

    def layer(m):
        return lambda xs: m(xs)

    with torch.no_grad():
        # eager, in the benchmark dtype, then fp32 (the reference for every variant's error)
        def eager():
            slices, out = fit_slices(layer(mixer), x, dev)
            ms = bench(lambda: sliced(layer(mixer), x, slices), dev)
            outs["eager"] = out
            return ph.row("eager", ms=ms[0], ms_p20=ms[1], ms_p80=ms[2], batch_slices=slices,
                          peak_mib=ph.protect("eager peak", lambda: peak_mib(lambda: sliced(layer(mixer), x, slices), dev)))

        def reference():
            slices, out = fit_slices(layer(ref_mixer), x.float(), dev)
            ref["out"] = out
            return slices

        eager_row = ph.protect("eager", eager)
        slices = ph.protect("fp32 reference", reference)
        if "out" in ref:
            ph.info["reference"] = f"eager fp32 layer{'' if slices == 1 else f' in {slices} batch slices'}"
            if eager_row is not None and "eager" in outs:
                eager_row.update(errors(outs["eager"], ref["out"]))
                ph.log({"phase": ph.name, "variant": "eager", **errors(outs["eager"], ref["out"])})
        ref_mixer = None  # free its memory before the compiled variants
        free(dev)

        variants = ["ours"] + (["inductor"] if ph.setup.inductor else [])
        for variant in variants:
            def compiled(variant=variant, unsplit=False):
                fn = make_compiled(variant, mixer)
                out, first, warm = timed_first_calls(lambda: fn(x), dev)
                stats = compile_stats()
                ms = bench(lambda: fn(x), dev)
                recompiled = compile_stats()["graphs"] - stats["graphs"]
                r = ph.row(variant, ms=ms[0], ms_p20=ms[1], ms_p80=ms[2], compile_s=first - warm, first_call_s=first,
                           recompiles_while_timed=recompiled, **stats,
                           rewrite_log=list(RECORDER.graphs) if variant == "ours" else None,
                           peak_mib=peak_mib(lambda: fn(x), dev), note=NO_SPLIT_NOTE if unsplit else None)
                if "out" in ref:
                    r.update(errors(out, ref["out"]))
                    ph.log({"phase": ph.name, "variant": variant, **errors(out, ref["out"])})
                return r

            protect_compiled(ph, variant, compiled)
            torch._dynamo.reset()
            free(dev)

        ph.protect("scan op alone", lambda: scan_op_alone(ph, s))
    ph.info.update(summary(ph))


def scan_op_alone(ph: Phase, s: MixerShape):
    """gla_inductor.chunk_gla on the shapes the rewrite gives it: q = C, k = B (heads materialized here), v = x*dt,
    scalar log gate dt*A, scale 1, all fp32 (the scan upcasts); eager dispatch to the Triton kernel on CUDA."""
    import gla_inductor

    dev = ph.device
    B, T, H, K, V = s.B, s.T, s.heads, s.state, s.head_dim
    q, k = (torch.randn(B, T, H, K, device=dev) * K**-0.5 for _ in range(2))
    v = torch.randn(B, T, H, V, device=dev) * 0.05
    g = -torch.rand(B, T, H, device=dev) * 0.5
    fn = lambda: gla_inductor.chunk_gla(q, k, v, g, scale=1.0, output_final_state=False)  # noqa: E731
    with torch.no_grad():
        fn()
        ms = bench(fn, dev)
    nbytes = (q.numel() + k.numel() + 2 * v.numel() + g.numel()) * 4
    return ph.row("scan op alone", ms=ms[0], ms_p20=ms[1], ms_p80=ms[2], shape=[B, T, H, K, V], dtype="float32",
                  min_bytes_mb=nbytes / 1e6)


def build_model(m: ModelShape, dev: str):
    from transformers import Mamba2ForCausalLM

    torch.manual_seed(0)
    return Mamba2ForCausalLM(mamba2_config(m, layers=m.layers, vocab=m.vocab)).to(dev).eval()


def ssm_states(cache, layers: int) -> list:
    return [cache.layers[i].recurrent_states[0] for i in range(layers)]


def run_prefill(ph: Phase, m: ModelShape):
    dev, dt = ph.device, ph.setup.dtype
    ph.info.update(shape={"B": m.prefill_B, "T": m.prefill_T, **{k: v for k, v in asdict(m).items()
                                                                   if not k.startswith(("prefill", "decode", "prompt"))}},
                   dtype=str(dt).replace("torch.", ""))
    ref_model = build_model(m, dev)
    model = copy.deepcopy(ref_model).to(dt)
    ids = torch.randint(0, m.vocab, (m.prefill_B, m.prefill_T), device=dev)
    ref = {}

    def logits_of(mod):
        return lambda xs: mod(xs, use_cache=True).logits

    def full(mod):
        return lambda: mod(ids, use_cache=True)

    with torch.no_grad():
        def reference():
            slices, out = fit_slices(logits_of(ref_model), ids, dev)
            ref["logits"] = out
            if slices == 1:
                ref["states"] = [st.clone() for st in ssm_states(full(ref_model)().cache_params, m.layers)]
            return slices

        def eager():
            slices, out = fit_slices(logits_of(model), ids, dev)
            ms = bench(lambda: sliced(logits_of(model), ids, slices), dev)
            r = ph.row("eager", ms=ms[0], ms_p20=ms[1], ms_p80=ms[2], batch_slices=slices,
                       peak_mib=ph.protect("eager peak", lambda: peak_mib(lambda: sliced(logits_of(model), ids, slices), dev)))
            if "logits" in ref:
                r.update(errors(out, ref["logits"]))
            if slices == 1 and "states" in ref:
                st = ssm_states(full(model)().cache_params, m.layers)
                r.update(prefixed("state_", worst([errors(a, b) for a, b in zip(st, ref["states"])])))
            ph.log({k: v for k, v in r.items() if "err" in k or k == "variant"})
            return r

        slices = ph.protect("fp32 reference", reference)
        ph.info["reference"] = "none (failed)" if slices is None else \
            f"eager fp32 model{'' if slices == 1 else f' in {slices} batch slices'}"
        ref_model = None
        free(dev)
        ph.protect("eager", eager)
        free(dev)

        for variant in ["ours"] + (["inductor"] if ph.setup.inductor else []):
            def compiled(variant=variant, unsplit=False):
                fn = make_compiled(variant, model)
                out, first, warm = timed_first_calls(full(fn), dev)
                stats = compile_stats()
                ms = bench(lambda: fn(ids, use_cache=True).logits, dev)
                recompiled = compile_stats()["graphs"] - stats["graphs"]
                r = ph.row(variant, ms=ms[0], ms_p20=ms[1], ms_p80=ms[2], compile_s=first - warm, first_call_s=first,
                           recompiles_while_timed=recompiled, **stats,
                           rewrite_log=list(RECORDER.graphs) if variant == "ours" else None,
                           peak_mib=peak_mib(lambda: fn(ids, use_cache=True).logits, dev),
                           note=NO_SPLIT_NOTE if unsplit else None)
                if "logits" in ref:
                    r.update(errors(out.logits, ref["logits"]))
                if "states" in ref:
                    st = ssm_states(out.cache_params, m.layers)
                    r.update(prefixed("state_", worst([errors(a, b) for a, b in zip(st, ref["states"])])))
                ph.log({k: v for k, v in r.items() if "err" in k or k == "variant"})
                return r

            protect_compiled(ph, variant, compiled)
            torch._dynamo.reset()
            free(dev)
    ph.info.update(summary(ph, expected_rewrites=m.layers))


@contextlib.contextmanager
def chunk_size(model, n: int):
    """Every mixer's chunk size set to n for a while (the scan computes the same function at any chunk size):
    the eager prompt that fills a decode cache then does not pad a few tokens to a 256-long chunk."""
    mixers = [layer.mixer for layer in model.backbone.layers]
    old = [mx.chunk_size for mx in mixers]
    for mx in mixers:
        mx.chunk_size = n
    try:
        yield
    finally:
        for mx, c in zip(mixers, old):
            mx.chunk_size = c


def run_decode(ph: Phase, m: ModelShape):
    dev, dt = ph.device, ph.setup.dtype
    ph.info.update(shape={"B": m.decode_B, "T": 1, "prompt_T": m.prompt_T,
                          **{k: v for k, v in asdict(m).items() if not k.startswith(("prefill", "decode", "prompt"))}},
                   dtype=str(dt).replace("torch.", ""))
    model = build_model(m, dev).to(dt)
    prompt = torch.randint(0, m.vocab, (m.decode_B, m.prompt_T), device=dev)
    tok = torch.randint(0, m.vocab, (m.decode_B, 1), device=dev)

    with torch.no_grad():
        with chunk_size(model, min(m.chunk, 16)):
            cache0 = model(prompt, use_cache=True).cache_params
        ref_cache = copy.deepcopy(cache0)
        ref_logits = model(tok, cache_params=ref_cache, use_cache=True).logits
        ref_states = [st.clone() for st in ssm_states(ref_cache, m.layers)]
        ph.info["reference"] = f"eager {ph.info['dtype']} decode step from the same cache"

        def step(fn, cache):
            return lambda: fn(tok, cache_params=cache, use_cache=True).logits

        def eager():
            cache = copy.deepcopy(cache0)
            ms = bench(step(model, cache), dev)
            graph_ms = bench_graph(step(model, cache)) if ph.setup.graphs else None
            return ph.row("eager", ms=ms[0], ms_p20=ms[1], ms_p80=ms[2], graph_ms=graph_ms)

        ph.protect("eager", eager)
        for variant in ["ours"] + (["inductor"] if ph.setup.inductor else []):
            def compiled(variant=variant):
                fn = make_compiled(variant, model)
                cache = copy.deepcopy(cache0)
                sync(dev)
                t0 = time.perf_counter()
                out = step(fn, cache)()
                sync(dev)
                first = time.perf_counter() - t0
                errs = errors(out, ref_logits)
                st_errs = worst([errors(a, b) for a, b in zip(ssm_states(cache, m.layers), ref_states)])
                _, warm = timed_first_calls(step(fn, cache), dev)[1:]
                stats = compile_stats()
                ms = bench(step(fn, cache), dev)
                recompiled = compile_stats()["graphs"] - stats["graphs"]
                r = ph.row(variant, ms=ms[0], ms_p20=ms[1], ms_p80=ms[2], compile_s=first - warm, first_call_s=first,
                           recompiles_while_timed=recompiled, **stats, **errs, **prefixed("state_", st_errs),
                           rewrite_log=list(RECORDER.graphs) if variant == "ours" else None)
                if ph.setup.graphs:
                    r["graph_ms"] = bench_graph(step(fn, cache))
                    ph.log({"phase": ph.name, "variant": variant, "graph_ms": r["graph_ms"]})
                return r

            ph.protect(variant, compiled)
            torch._dynamo.reset()
            free(dev)
    ph.info.update(summary(ph, expected_rewrites=m.layers))


def summary(ph: Phase, expected_rewrites: int = 1) -> dict:
    by = {r["variant"]: r for r in ph.rows if "ms" in r}
    out = {}
    tried = [r for r in ph.rows if r["variant"] == "ours" and "rewrites" in r]  # a timed-out compile counts too
    if tried:
        out["rewrites"] = tried[-1]["rewrites"]
        out["rewrites_ok"] = tried[-1]["rewrites"] == expected_rewrites
    ours = by.get("ours")
    if ours:
        for other in ("inductor", "eager"):
            if other in by:
                out[f"ours_vs_{other}"] = by[other]["ms"] / ours["ms"]
                if by[other].get("graph_ms") and ours.get("graph_ms") and ours["graph_ms"] == ours["graph_ms"]:
                    out[f"ours_vs_{other}_graph"] = by[other]["graph_ms"] / ours["graph_ms"]
    out["expected_rewrites"] = expected_rewrites
    return out


# ---------------------------------------------------------------------------------------------------------------
# the run
# ---------------------------------------------------------------------------------------------------------------


def meta_data(setup: Setup) -> dict:
    import transformers

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    from transformers.models.mamba2 import modeling_mamba2

    scan_src = inspect.getsource(modeling_mamba2.mamba2_chunk_scan) if hasattr(modeling_mamba2, "mamba2_chunk_scan") \
        else inspect.getsource(modeling_mamba2.Mamba2Mixer)
    spelling = "einsum" if 'einsum("bclhn,bcshn->bclsh"' in scan_src else "broadcast-multiply-sum"

    def git(*a):
        try:
            return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
        except Exception:
            return ""

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    if commit != "unknown" and git("status", "--porcelain", "--untracked-files=no"):
        commit += "+dirty"
    return {
        "device": torch.cuda.get_device_name() if setup.device == "cuda" else f"cpu ({os.cpu_count()} cores)",
        "torch": torch.__version__, "triton": triton_version, "transformers": transformers.__version__,
        "python": sys.version.split()[0], "scan_spelling": spelling,
        "fast_paths_present": [m for m in FAST_PATHS if importlib.util.find_spec(m) is not None],
        "date": datetime.datetime.now().isoformat(timespec="seconds"), "commit": commit,
        "dtype": str(setup.dtype).replace("torch.", ""), "check": setup.check, "threads": torch.get_num_threads(),
    }


def fmt(x, spec=".3f"):
    if x is None or (isinstance(x, float) and x != x):
        return "—"
    return format(x, spec)


def markdown(meta: dict, phases: dict, rows: list[dict]) -> str:
    lines = [f"# Mamba2 (transformers torch path) compiled with gla_inductor ({'--check, CPU' if meta['check'] else 'GPU'})",
             "",
             f"{meta['device']}, torch {meta['torch']}, triton {meta['triton']}, transformers {meta['transformers']} "
             f"(scan spelled as {meta['scan_spelling']}), {meta['dtype']}, {meta['date']}, commit {meta['commit']}",
             ""]
    if meta["fast_paths_present"]:
        lines += [f"**Warning**: {meta['fast_paths_present']} importable: transformers may not take its torch path.", ""]
    lines += [summary_table(phases, rows), "", "## Variants", "",
              "| phase | variant | ms (p20–p80) | graph ms | compile s | rewrites | graphs | breaks | peak MiB "
              "| max abs err | max rel err | norm rel err | state rel err | note |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['phase']} | {r['variant']} | error: {r['error'][:160]} | | | | | | | | | | | |")
            continue
        note = []
        if r.get("batch_slices", 1) > 1:
            note.append(f"eager in {r['batch_slices']} batch slices (OOM at full batch)")
        if r.get("recompiles_while_timed"):
            note.append(f"{r['recompiles_while_timed']} recompiles while timed")
        if r.get("rewrite_failures"):
            note.append(f"{r['rewrite_failures']} rewrite failures")
        if r.get("nonfinite"):
            note.append(f"{r['nonfinite']} non-finite outputs")
        if r.get("note"):
            note.append(r["note"])
        if r["variant"] == "scan op alone":
            note.append(f"chunk_gla {r['shape']} fp32, min bytes {r['min_bytes_mb']:.0f} MB")
        lines.append(
            f"| {r['phase']} | {r['variant']} | {fmt(r.get('ms'))} ({fmt(r.get('ms_p20'))}–{fmt(r.get('ms_p80'))}) "
            f"| {fmt(r.get('graph_ms'))} | {fmt(r.get('compile_s'), '.1f')} | {fmt(r.get('rewrites'), 'd')} "
            f"| {fmt(r.get('graphs'), 'd')} | {fmt(r.get('graph_breaks'), 'd')} | {fmt(r.get('peak_mib'), '.0f')} "
            f"| {fmt(r.get('max_abs_err'), '.2e')} | {fmt(r.get('max_rel_err'), '.2e')} | {fmt(r.get('norm_rel_err'), '.2e')} "
            f"| {fmt(r.get('state_max_rel_err'), '.2e')} | {'; '.join(note)} |")
    lines += ["", "## Phases", ""]
    for name, p in phases.items():
        lines.append(f"- **{name}**: {p['status']} in {p['seconds']:.0f} s; shape {p.get('shape')}; "
                     f"reference: {p.get('reference', '—')}" + (f"; {p['reason']}" if p.get("reason") else "")
                     + (f"; **{p['warning']}**" if p.get("warning") else ""))
    rewrite_logs = [(r["phase"], g) for r in rows if r.get("rewrite_log") for g in r["rewrite_log"]]
    if rewrite_logs:
        lines += ["", "## What the backend did (ours)", ""]
        for phase, g in rewrite_logs:
            lines.append(f"- {phase}: {len(g['matches'])} rewrite(s) in {g['rewrite_s']} s {g['matches'][:2]}; "
                         f"left alone: {g['near_misses'][:3]}")
    return "\n".join(lines)


def summary_table(phases: dict, rows: list[dict]) -> str:
    lines = ["| phase | shape | eager ms | inductor ms | ours ms | ours vs inductor | ours vs eager "
             "| compile s (ind. / ours) | rewrites | ours err vs ref (max abs / max rel) | status |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, p in phases.items():
        by = {r["variant"]: r for r in rows if r["phase"] == name}

        def ms(v):
            r = by.get(v)
            if r is None:
                return "—"
            if "error" in r:
                return "error"
            s = fmt(r.get("ms"))
            if r.get("graph_ms") is not None and r["graph_ms"] == r["graph_ms"]:
                s += f" (graph {fmt(r['graph_ms'])})"
            if r.get("batch_slices", 1) > 1:
                s += f" ({r['batch_slices']} slices)"
            return s

        shape = p.get("shape") or {}
        short = ", ".join(f"{k}={v}" for k, v in shape.items() if k in ("B", "T", "heads", "head_dim", "state",
                                                                         "groups", "layers", "hidden"))
        ours = by.get("ours", {})
        rw = p.get("rewrites")
        rw_s = "—" if rw is None else f"{rw}/{p.get('expected_rewrites')}" + ("" if p.get("rewrites_ok") else " ✗")
        ratio = lambda k: fmt(p.get(k), ".2f") + ("" if p.get(k) is None else "×")  # noqa: E731
        vs_ind = ratio("ours_vs_inductor")
        if name.startswith("mixer") and p.get("ours_vs_inductor") is not None:
            vs_ind += " ✓" if p["ours_vs_inductor"] >= TARGET else f" (target {TARGET:.0f}×)"
        vs_eager = ratio("ours_vs_eager")
        if p.get("ours_vs_eager_graph") is not None:
            vs_eager += f" (graph {p['ours_vs_eager_graph']:.2f}×)"
        lines.append(
            f"| {name} | {short} | {ms('eager')} | {ms('inductor')} | {ms('ours')} | {vs_ind} | {vs_eager} "
            f"| {fmt(by.get('inductor', {}).get('compile_s'), '.0f')} / {fmt(ours.get('compile_s'), '.0f')} | {rw_s} "
            f"| {fmt(ours.get('max_abs_err'), '.1e')} / {fmt(ours.get('max_rel_err'), '.1e')} | {p['status']} |")
    return "\n".join(lines)


def check_failures(phases: dict, rows: list[dict]) -> list[str]:
    """--check: what must hold at tiny fp32 shapes."""
    bad = []
    for name, p in phases.items():
        if p["status"] != "ok":
            bad.append(f"{name}: {p['status']} {p.get('reason', '')}")
        if not p.get("rewrites_ok"):
            bad.append(f"{name}: {p.get('rewrites')} rewrites, expected {p.get('expected_rewrites')}")
    for r in rows:
        if "error" in r:
            bad.append(f"{r['phase']} / {r['variant']}: {r['error'][:200]}")
        for key in ("max_rel_err", "state_max_rel_err"):
            if r.get(key) is not None and not r[key] <= 1e-4:
                bad.append(f"{r['phase']} / {r['variant']}: {key} {r[key]:.1e}")
    return bad


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "benchmarks" / "results"),
                   help="output folder (default $OUT, else benchmarks/results)")
    p.add_argument("--name", default="mamba2", help="file name stem of the outputs")
    p.add_argument("--phases", default=",".join(ALL_PHASES), help=f"comma-separated, of {','.join(ALL_PHASES)}")
    p.add_argument("--check", action="store_true", help="CPU, fp32, tiny shapes")
    p.add_argument("--no-inductor", action="store_true", help="skip the default-Inductor column")
    p.add_argument("--check-inductor", action="store_true",
                   help="with --check, run the default-Inductor column too (CPU C++ compiles: slow on small machines)")
    p.add_argument("--no-graphs", action="store_true", help="no CUDA-graph timings for decode")
    p.add_argument("--mixer-B", type=int)
    p.add_argument("--mixer-T", type=int)
    p.add_argument("--model-layers", type=int)
    p.add_argument("--prefill-B", type=int)
    p.add_argument("--prefill-T", type=int)
    p.add_argument("--decode-B", type=int)
    args = p.parse_args()

    if args.check:
        setup = check_setup(inductor=args.check_inductor)
    else:
        if not torch.cuda.is_available():
            sys.exit("no CUDA device: run with --check for the CPU smoke test")
        setup = gpu_setup()
        setup.inductor = not args.no_inductor
        setup.graphs = not args.no_graphs
    for shape in (setup.mixer, setup.grouped):
        if args.mixer_B:
            shape.B = args.mixer_B
        if args.mixer_T:
            shape.T = args.mixer_T
    for attr, key in (("layers", "model_layers"), ("prefill_B", "prefill_B"), ("prefill_T", "prefill_T"),
                      ("decode_B", "decode_B")):
        if getattr(args, key):
            setattr(setup.model, attr, getattr(args, key))
    phases_wanted = [x.strip() for x in args.phases.split(",") if x.strip()]
    unknown = [x for x in phases_wanted if x not in ALL_PHASES]
    if unknown:
        sys.exit(f"unknown phases {unknown}; choose from {ALL_PHASES}")

    import gla_inductor  # noqa: F401  (registers the ops)
    from gla_inductor.backend import _listeners

    _listeners.append(RECORDER)
    os.makedirs(args.out, exist_ok=True)
    out_json = os.path.join(args.out, f"{args.name}.json")
    out_md = os.path.join(args.out, f"{args.name}.md")
    out_tb = os.path.join(args.out, f"{args.name}_tracebacks.txt")
    phase_budget = float(os.environ.get("GLA_BENCH_PHASE_S", 600 if args.check else 420))
    total_budget = float(os.environ.get("GLA_BENCH_TOTAL_S", 1800 if args.check else 560))
    start = time.perf_counter()

    meta = meta_data(setup)
    global SPELLING
    SPELLING = meta["scan_spelling"]
    meta.update(phase_budget_s=phase_budget, total_budget_s=total_budget, phases=phases_wanted)
    print(json.dumps(meta), flush=True)
    if meta["fast_paths_present"]:
        print(f"WARNING: {meta['fast_paths_present']} importable; transformers may take a fast path", flush=True)

    rows: list[dict] = []
    phases: dict = {}
    tracebacks: list[str] = []

    def log(row):
        print(json.dumps(row, default=str), flush=True)

    def write():
        with open(out_json, "w") as f:
            json.dump({"meta": meta, "phases": phases, "rows": rows}, f, indent=1, default=str)
        with open(out_md, "w") as f:
            f.write(markdown(meta, phases, rows) + "\n")
        if tracebacks:
            with open(out_tb, "w") as f:
                f.write("\n\n".join(tracebacks))

    runners = {
        "mixer": lambda ph: run_mixer(ph, setup.mixer),
        "mixer_grouped": lambda ph: run_mixer(ph, setup.grouped),
        "prefill": lambda ph: run_prefill(ph, setup.model),
        "decode": lambda ph: run_decode(ph, setup.model),
    }
    for name in phases_wanted:
        left = total_budget - (time.perf_counter() - start)
        ph = Phase(name, setup, log)
        t0 = time.perf_counter()
        record = {"status": "running"}
        phases[name] = record
        if left < 30:
            record.update(status="skipped", reason=f"only {left:.0f} s of the run's budget left", seconds=0.0)
            print(f"== {name}: skipped ({record['reason']})", flush=True)
            write()
            continue
        budget = min(phase_budget, left - 10)
        print(f"== {name} (budget {budget:.0f} s)", flush=True)
        try:
            with alarm(budget):
                runners[name](ph)
            record["status"] = "ok" if not ph.failures else "partial"
        except PhaseTimeout as e:
            record.update(status="timeout", reason=f"{e} while running {ph.current or '(between variants)'}")
            if ph.current:  # what the interrupted variant got done: the backend's rewrites, say
                ph.row(ph.current, error=f"interrupted: {e}", **compile_stats(), rewrite_log=list(RECORDER.graphs))
            tracebacks.append(f"[{name}] {e}\n{traceback.format_exc()}")
            print(f"  {name}: {e}", flush=True)
        except Exception as e:
            record.update(status="error", reason=f"{type(e).__name__}: {str(e)[:300]}")
            tracebacks.append(f"[{name}]\n{traceback.format_exc()}")
            print(f"  {name} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
        finally:
            tracebacks.extend(ph.failures)
            if ph.failures and record["status"] == "ok":
                record["status"] = "partial"
            if not ph.info.get("expected_rewrites"):  # interrupted before its summary
                with contextlib.suppress(Exception):
                    ph.info.update(summary(ph, expected_rewrites=setup.model.layers if name in ("prefill", "decode") else 1))
            record.update(ph.info, seconds=time.perf_counter() - t0)
            rows.extend(ph.rows)
            torch._dynamo.reset()
            free(setup.device)
            write()

    print()
    print(f"Mamba2, {meta['device']}, torch {meta['torch']}, triton {meta['triton']}, transformers "
          f"{meta['transformers']} ({meta['scan_spelling']}), {meta['dtype']}, commit {meta['commit']}")
    print(summary_table(phases, rows))
    for name, p in phases.items():
        if name.startswith("mixer") and p.get("ours_vs_inductor") is not None:
            print(f"target {name}: ours {p['ours_vs_inductor']:.2f}x default Inductor "
                  f"({'met' if p['ours_vs_inductor'] >= TARGET else 'NOT met'}, >= {TARGET:.0f}x), "
                  f"rewrites {p.get('rewrites')} ({'ok' if p.get('rewrites_ok') else 'expected 1'})")
    for name, p in phases.items():
        if p.get("warning"):
            print(f"warning {name}: {p['warning']}")
        if p.get("reason"):
            print(f"{name}: {p['status']}: {p['reason']}")
    print(f"results: {out_json}, {out_md}" + (f", {out_tb}" if tracebacks else ""))
    if args.check:
        bad = check_failures(phases, rows)
        print("check:", "PASS" if not bad else "FAIL\n  " + "\n  ".join(bad))
        sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
