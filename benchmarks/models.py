"""transformers' Mamba2 on its PyTorch path (no mamba_ssm / causal_conv1d), eager against default
Inductor against the backend (CUDA; ``--quick`` runs tiny fp32 shapes, on CPU where there is no GPU).

Phases (--phases; each protected: a failure or an exhausted budget is recorded, the next phase runs):
  mixer          one ``Mamba2Mixer`` at 1.3B-like sizes (B=4, T=4096, hidden 2048, 64 heads of 64, state
                 128, 1 group, chunk 256), bf16, prefill forward without cache under no_grad. Target: the
                 backend >= 5x faster than default Inductor, with exactly 1 rewrite. Errors of every variant
                 against the layer run eagerly in fp32; also the scan op alone (``gla_inductor.chunk_gla`` on
                 the shapes and fp32 dtypes the rewrite gives it), the scan's share of the layer.
  mixer_grouped  the same with 8 groups (B and C shared by groups of 8 heads).
  prefill        ``Mamba2ForCausalLM`` (4 layers, hidden 768, 24 heads of 64, state 128, random weights),
                 B=4, T=1024, ``use_cache=True``; errors of logits and final SSM states against fp32.
  decode         the same model, one-token decode at B=64 from a cache an eager prompt filled; also timed
                 in a CUDA graph; errors against eager in the same dtype from identical caches.
Compiled variants use ``dynamic=False`` (the chunked form is certified at static sizes); the backend's
compile time includes that float64 certificate. Compile time: first call minus a warm call. Eager
runs that do not fit (transformers <= 5.17 materializes [b, c, l, s, h, n] tensors) run in batch
slices, and the row says so. Budgets: GLA_BENCH_PHASE_S (420 s) per phase, GLA_BENCH_TOTAL_S (560 s).
"""

from __future__ import annotations

import contextlib
import copy
import os
import sys
import time
import traceback
from dataclasses import asdict, dataclass, replace

import torch

from benchmarks import harness, models_report, report
from benchmarks.models_phase import (Phase, PhaseTimeout, alarm, compile_stats, errors, fit_slices, sliced,
                                     worst_errors)

PHASES = ("mixer", "mixer_grouped", "prefill", "decode")


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
    prefill_B: int = 4
    prefill_T: int = 1024
    decode_B: int = 64
    prompt_T: int = 32


QUICK_MIXER = MixerShape(B=2, T=80, hidden=64, heads=8, head_dim=16, state=16, chunk=32)  # a padded last chunk
QUICK_MODEL = ModelShape(layers=2, hidden=64, heads=8, head_dim=16, state=16, chunk=32, vocab=128, prefill_B=2,
                         prefill_T=40, decode_B=4, prompt_T=8)


def add_arguments(p) -> None:
    p.add_argument("--phases", default=",".join(PHASES), help="of " + ",".join(PHASES))
    p.add_argument("--no-inductor", action="store_true", help="skip the default-Inductor column")
    p.add_argument("--no-graphs", action="store_true", help="no CUDA-graph timings of decode")
    for name in ("mixer-B", "mixer-T", "layers", "prefill-B", "prefill-T", "decode-B"):
        p.add_argument(f"--{name}", type=int)


class Setup:
    def __init__(self, args):
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.dtype = torch.float32 if args.quick else torch.bfloat16
        self.mixer = copy.copy(QUICK_MIXER) if args.quick else MixerShape()
        self.model = copy.copy(QUICK_MODEL) if args.quick else ModelShape()
        self.mixer.B, self.mixer.T = args.mixer_B or self.mixer.B, args.mixer_T or self.mixer.T
        for attr in ("layers", "prefill_B", "prefill_T", "decode_B"):
            setattr(self.model, attr, getattr(args, attr) or getattr(self.model, attr))
        self.grouped = replace(self.mixer, groups=4 if args.quick else 8)
        # default Inductor's CPU C++ compiles are slow on small machines: not in a CPU smoke run
        self.inductor = not args.no_inductor and self.device == "cuda"
        self.graphs = not args.no_graphs and self.device == "cuda"
        self.clock = "events" if self.device == "cuda" else "cpu"
        self.rounds = 2 if args.quick else 5


def mamba2_config(s, layers: int, vocab: int = 32):
    from transformers import Mamba2Config

    if s.hidden * 2 != s.heads * s.head_dim:
        raise ValueError(f"Mamba2 needs hidden * expand == heads * head_dim, got {s}")
    return Mamba2Config(vocab_size=vocab, hidden_size=s.hidden, num_hidden_layers=layers, num_heads=s.heads,
                        head_dim=s.head_dim, expand=2, state_size=s.state, n_groups=s.groups, chunk_size=s.chunk,
                        conv_kernel=s.conv)


def run_mixer(ph: Phase, s: MixerShape) -> None:
    from transformers.models.mamba2.modeling_mamba2 import Mamba2Mixer

    dev, dt = ph.setup.device, ph.setup.dtype
    ph.info.update(shape=asdict(s), expected_rewrites=1)
    torch.manual_seed(0)
    ref_mixer = Mamba2Mixer(mamba2_config(s, layers=1), layer_idx=0).to(dev).eval()  # fp32
    mixer = copy.deepcopy(ref_mixer).to(dt)
    x = torch.randn(s.B, s.T, s.hidden, device=dev).to(dt)
    ref = {}
    with torch.no_grad():
        def eager():
            slices, out = fit_slices(mixer, x)
            r = ph.timed("eager", lambda: sliced(mixer, x, slices), batch_slices=slices,
                         peak_mib=harness.peak_extra_mib(lambda: sliced(mixer, x, slices)))
            ref["eager"] = (r, out)

        def reference():
            slices, ref["out"] = fit_slices(ref_mixer, x.float())
            ph.info["reference"] = "eager fp32 layer" + ("" if slices == 1 else f" in {slices} batch slices")

        ph.protect("eager", eager)
        ph.protect("fp32 reference", reference)
        if "out" in ref and "eager" in ref:
            ref["eager"][0].update(errors(ref["eager"][1], ref["out"]))
        ref_mixer = None  # its memory, before the compiled variants
        harness.free_memory()

        def measure(variant, fn, note):
            r, out = ph.compiled_row(variant, lambda: fn(x), note)
            if "out" in ref:
                r.update(errors(out, ref["out"]))
            return r

        ph.each_compiled(mixer, measure)
        ph.protect("scan op alone", lambda: scan_op_alone(ph, s))


def scan_op_alone(ph: Phase, s: MixerShape) -> dict:
    """chunk_gla on the shapes the rewrite gives it: q = C, k = B (heads materialized here), v = x*dt,
    scalar log gate dt*A, scale 1, all fp32 (the scan upcasts)."""
    import gla_inductor

    dev = ph.setup.device
    B, T, H, K, V = s.B, s.T, s.heads, s.state, s.head_dim
    q, k = (torch.randn(B, T, H, K, device=dev) * K**-0.5 for _ in range(2))
    v = torch.randn(B, T, H, V, device=dev) * 0.05
    g = -torch.rand(B, T, H, device=dev) * 0.5
    with torch.no_grad():
        return ph.timed("scan op alone", lambda: gla_inductor.chunk_gla(q, k, v, g, scale=1.0),
                        shape=[B, T, H, K, V], min_bytes_mb=harness.tensor_bytes(q, k, v, v, g) / 1e6)


def build_model(m: ModelShape, dev: str):
    from transformers import Mamba2ForCausalLM

    torch.manual_seed(0)
    return Mamba2ForCausalLM(mamba2_config(m, layers=m.layers, vocab=m.vocab)).to(dev).eval()


def ssm_states(cache, layers: int) -> list:
    return [cache.layers[i].recurrent_states[0] for i in range(layers)]


def model_shape(m: ModelShape, **first) -> dict:
    return {**first, **{k: v for k, v in asdict(m).items() if not k.startswith(("prefill", "decode", "prompt"))}}


def run_prefill(ph: Phase, m: ModelShape) -> None:
    dev, dt = ph.setup.device, ph.setup.dtype
    ph.info.update(shape=model_shape(m, B=m.prefill_B, T=m.prefill_T), expected_rewrites=m.layers)
    ref_model = build_model(m, dev)
    model = copy.deepcopy(ref_model).to(dt)
    ids = torch.randint(0, m.vocab, (m.prefill_B, m.prefill_T), device=dev)
    ref = {}

    def logits(mod):
        return lambda xs: mod(xs, use_cache=True).logits

    def states(mod):
        return ssm_states(mod(ids, use_cache=True).cache_params, m.layers)

    with torch.no_grad():
        def reference():
            slices, ref["logits"] = fit_slices(logits(ref_model), ids)
            if slices == 1:
                ref["states"] = [st.clone() for st in states(ref_model)]
            ph.info["reference"] = "eager fp32 model" + ("" if slices == 1 else f" in {slices} batch slices")

        def eager():
            slices, out = fit_slices(logits(model), ids)
            r = ph.timed("eager", lambda: sliced(logits(model), ids, slices), batch_slices=slices,
                         peak_mib=harness.peak_extra_mib(lambda: sliced(logits(model), ids, slices)))
            if "logits" in ref:
                r.update(errors(out, ref["logits"]))
            if slices == 1 and "states" in ref:
                r.update(worst_errors(states(model), ref["states"], "state_"))

        ph.protect("fp32 reference", reference)
        ref_model = None
        harness.free_memory()
        ph.protect("eager", eager)

        def measure(variant, fn, note):
            r, out = ph.compiled_row(variant, lambda: fn(ids, use_cache=True), note)
            if "logits" in ref:
                r.update(errors(out.logits, ref["logits"]))
            if "states" in ref:
                r.update(worst_errors(ssm_states(out.cache_params, m.layers), ref["states"], "state_"))
            return r

        ph.each_compiled(model, measure)


@contextlib.contextmanager
def chunk_size(model, n: int):
    """Every mixer's chunk size n for a while (the scan computes the same function at any chunk size):
    the eager prompt that fills a decode cache then pads no short prompt to a 256-long chunk."""
    mixers = [layer.mixer for layer in model.backbone.layers]
    old = [mx.chunk_size for mx in mixers]
    for mx in mixers:
        mx.chunk_size = n
    try:
        yield
    finally:
        for mx, c in zip(mixers, old):
            mx.chunk_size = c


def run_decode(ph: Phase, m: ModelShape) -> None:
    dev, dt = ph.setup.device, ph.setup.dtype
    ph.info.update(shape=model_shape(m, B=m.decode_B, T=1, prompt_T=m.prompt_T), expected_rewrites=m.layers)
    model = build_model(m, dev).to(dt)
    prompt = torch.randint(0, m.vocab, (m.decode_B, m.prompt_T), device=dev)
    tok = torch.randint(0, m.vocab, (m.decode_B, 1), device=dev)
    with torch.no_grad():
        with chunk_size(model, min(m.chunk, 16)):
            cache0 = model(prompt, use_cache=True).cache_params
        ref_cache = copy.deepcopy(cache0)
        ref_logits = model(tok, cache_params=ref_cache, use_cache=True).logits
        ref_states = [st.clone() for st in ssm_states(ref_cache, m.layers)]
        ph.info["reference"] = f"eager {str(dt).replace('torch.', '')} decode step from the same cache"

        def step(fn, cache):
            return lambda: fn(tok, cache_params=cache, use_cache=True).logits

        def graph_ms(fn):
            return harness.graph_ms(fn, rounds=ph.setup.rounds) if ph.setup.graphs else None

        def eager():
            cache = copy.deepcopy(cache0)
            ph.timed("eager", step(model, cache), graph_ms=graph_ms(step(model, cache)))

        ph.protect("eager", eager)

        def measure(variant, fn, note):
            cache = copy.deepcopy(cache0)

            def check(out):  # the first step from the prompt's cache, before later steps move it
                return {**errors(out, ref_logits), **worst_errors(ssm_states(cache, m.layers), ref_states, "state_")}

            r, _ = ph.compiled_row(variant, step(fn, cache), note, check)
            r["graph_ms"] = graph_ms(step(fn, cache))
            return r

        ph.each_compiled(model, measure)


RUNNERS = {"mixer": lambda ph, s: run_mixer(ph, s.mixer), "mixer_grouped": lambda ph, s: run_mixer(ph, s.grouped),
           "prefill": lambda ph, s: run_prefill(ph, s.model), "decode": lambda ph, s: run_decode(ph, s.model)}


def run_phase(name: str, setup: Setup, recorder: list, budget: float) -> tuple:
    """(phase record, rows, tracebacks)."""
    ph, t0, record = Phase(name, setup, recorder), time.perf_counter(), {"status": "running"}
    tracebacks = []
    try:
        with alarm(budget):
            RUNNERS[name](ph, setup)
        record["status"] = "partial" if ph.failures else "ok"
    except PhaseTimeout as e:
        record.update(status="timeout", reason=f"{e} while running {ph.current or '(between variants)'}")
        if ph.current:  # what the interrupted variant got done: the backend's rewrites, say
            ph.row(ph.current, error=f"interrupted: {e}", **compile_stats(), rewrite_log=list(recorder))
    except Exception as e:
        record.update(status="error", reason=harness.error_text(e))
        tracebacks.append(f"[{name}]\n{traceback.format_exc()}")
    tracebacks += ph.failures
    record.update(ph.info, **models_report.summary(ph.rows, ph.info.get("expected_rewrites", 1)),
                  seconds=time.perf_counter() - t0)
    torch._dynamo.reset()
    harness.free_memory()
    return record, ph.rows, tracebacks


def run(args):
    if not args.quick:
        harness.require_cuda("models")
    phases = [p for p in args.phases.split(",") if p]
    unknown = [p for p in phases if p not in PHASES]
    if unknown:
        raise SystemExit(f"unknown phases {unknown}; choose from {PHASES}")
    import gla_inductor  # noqa: F401 - registers the ops

    from benchmarks import internals

    setup = Setup(args)
    phase_budget = float(os.environ.get("GLA_BENCH_PHASE_S", 420))
    total_budget = float(os.environ.get("GLA_BENCH_TOTAL_S", 560 if setup.device == "cuda" else 1800))
    result = report.new_result("models", "Mamba2 (transformers torch path) compiled with gla_inductor",
                               setup.device, **models_report.meta(setup.dtype), phases={})
    recorder = models_report.Recorder()
    start, tracebacks = time.perf_counter(), []
    with internals.backend_listener(recorder):
        for name in phases:
            left = total_budget - (time.perf_counter() - start)
            if left < 30:
                result.meta["phases"][name] = {"status": "skipped", "reason": f"only {left:.0f} s of the budget left"}
                continue
            print(f"== {name} (budget {min(phase_budget, left - 10):.0f} s)", file=sys.stderr, flush=True)
            record, rows, tbs = run_phase(name, setup, recorder, min(phase_budget, left - 10))
            result.meta["phases"][name] = record
            result.rows += rows
            tracebacks += tbs
            result.sections = models_report.sections(result.meta, result.rows)
            if args.out:  # after every phase: a run killed later keeps the phases done
                result.write(args.out, args.stem)
    result.sections = models_report.sections(result.meta, result.rows)
    if tracebacks:
        result.sections.append("## Tracebacks\n\n```\n" + "\n\n".join(tracebacks)[-20000:] + "\n```")
    return result
