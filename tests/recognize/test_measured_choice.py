"""The cost rule measured: under max-autotune (or ``config.cost_measure = "always"``) a short step
is decided by timing both choices, the user's nodes and the rewrite, each compiled by Inductor;
a decision is kept per key, and a candidate that cannot be timed goes back to the model."""

import pytest
import spellings as sp
import torch
from torch._dynamo.utils import counters

import gla_inductor
from gla_inductor.recognize import measure

pytestmark = pytest.mark.usefixtures("cost_rule", "fresh_compiler")

MODE = "max-autotune-no-cudagraphs"


@pytest.fixture(autouse=True)
def no_decisions():
    measure.DECISIONS.clear()
    yield
    measure.DECISIONS.clear()


def _decode(q, k, v, g, cache):
    S = cache * g.exp()[..., None] + k[..., None] * v[..., None, :]
    cache.copy_(S)
    return (q[..., None] * S).sum(-2)


def _inputs(B=4, H=8, K=32, V=32):
    gen = torch.Generator().manual_seed(B)
    q, k, g = (torch.randn(B, H, K, generator=gen) for _ in range(3))
    v, cache = torch.randn(B, H, V, generator=gen), torch.randn(B, H, K, V, generator=gen)
    return q, k, v, torch.nn.functional.logsigmoid(g), cache


def _timer(monkeypatch, ours_ms, inductor_ms) -> list:
    """measure's timer replaced: both sides take the given times; returns its calls."""
    calls = []

    def fake(ours, theirs, inputs, device, graphs):
        calls.append([tuple(x.shape) for x in inputs])
        return ours_ms, inductor_ms

    monkeypatch.setattr(measure, "_time_both", fake)
    return calls


def _check_compiled(args, **compile_kwargs):
    """The decode step compiled (its cache updated in place) equals eager; no grad."""
    *xs, cache = args
    want_cache, got_cache = cache.clone(), cache.clone()
    with torch.no_grad():
        want = _decode(*xs, want_cache)
        got = torch.compile(_decode, backend=gla_inductor.backend, **compile_kwargs)(*xs, got_cache)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_cache, want_cache, rtol=1e-5, atol=1e-5)


def _explain(args):
    """explain under max-autotune (explain compiles with no mode: Inductor's own switch says it)."""
    with torch.no_grad(), torch._inductor.config.patch(max_autotune=True):
        return gla_inductor.explain(_decode, *args[:-1], args[-1].clone())


@pytest.mark.parametrize("ours_ms, inductor_ms", [(2.0, 1.0), (1.0, 2.0)])
def test_the_faster_side_is_chosen(monkeypatch, ours_ms, inductor_ms):
    calls = _timer(monkeypatch, ours_ms, inductor_ms)
    args = _inputs()
    _check_compiled(args, mode=MODE)
    rewritten = ours_ms < inductor_ms
    assert len(calls) == 1 and counters["gla_inductor"]["rewrites"] == rewritten
    report = _explain(args)
    text = f"measured under max-autotune, T = 1, B·H = 32, K = 32, V = 32 on cpu: {ours_ms:.4f} ms rewritten vs " \
           f"{inductor_ms:.4f} ms"
    if rewritten:
        assert [m.note for m in report.matches] == [f"rewritten: {text}"]
        assert f"#0 rewritten: {text}" in " ".join(str(report).split())  # (wrapped to the report's width)
    else:
        assert report.matches == [] and [n.reason for n in report.near_misses] == [f"left to Inductor: {text}"]


def test_without_max_autotune_the_model_decides(monkeypatch):
    calls = _timer(monkeypatch, 1.0, 2.0)  # (the measurement would rewrite it; the CPU model does not)
    args = _inputs()
    _check_compiled(args)
    _check_compiled(args, options={"max_autotune": False})
    assert calls == [] and counters["gla_inductor"]["rewrites"] == 0
    with gla_inductor.config.patch(cost_measure="never"), torch._inductor.config.patch(max_autotune=True):
        _check_compiled(args, mode=MODE)
    assert calls == [] and counters["gla_inductor"]["rewrites"] == 0


def test_options_and_the_config_switch_measure(monkeypatch):
    calls = _timer(monkeypatch, 1.0, 2.0)
    _check_compiled(_inputs(), options={"max_autotune": True})
    with gla_inductor.config.patch(cost_measure="always"):
        _check_compiled(_inputs(B=2))
    assert len(calls) == 2 and counters["gla_inductor"]["rewrites"] == 2


def test_decisions_are_kept_per_key(monkeypatch):
    calls = _timer(monkeypatch, 1.0, 2.0)
    for _ in range(2):  # a recompile of the same shapes
        torch._dynamo.reset()
        _check_compiled(_inputs(), mode=MODE)
    assert len(calls) == 1 and counters["gla_inductor"]["measured"] == 1
    _check_compiled(_inputs(B=8), mode=MODE)  # other shapes: measured again
    assert len(calls) == 2 and counters["gla_inductor"]["rewrites"] == 3


@pytest.mark.parametrize("where", ["_compile", "_time_both"])
def test_a_failed_measurement_falls_back_to_the_model(monkeypatch, where):
    def fail(*args, **kwargs):
        raise RuntimeError("out of memory (raised by the test)")

    monkeypatch.setattr(measure, where, fail)
    args = _inputs()
    _check_compiled(args, mode=MODE)
    assert counters["gla_inductor"]["measure_failures"] == 1 and counters["gla_inductor"]["rewrites"] == 0
    (reason,) = [n.reason for n in _explain(args).near_misses]  # the CPU model's decision, with its estimate
    assert reason.startswith("left to Inductor: T = 1, B·H = 32, K = 32, V = 32 on cpu, estimated")


def test_a_real_measurement_on_cpu():
    args = _inputs()
    _check_compiled(args, mode=MODE)
    assert counters["gla_inductor"]["measured"] == 1 and counters["gla_inductor"]["measure_failures"] == 0
    (t,) = measure.DECISIONS.values()
    assert 0 < t.ours_ms < float("inf") and 0 < t.inductor_ms < float("inf")
    report = _explain(args)  # (explain's compile has other options: measured again)
    told = [m.note for m in report.matches] + [n.reason for n in report.near_misses]
    assert len(told) == 1 and "measured under max-autotune, T = 1, B·H = 32, K = 32, V = 32 on cpu: " in told[0]
    print(told[0])


@pytest.mark.parametrize("spelling", [d for d in sp.DECODES if d.rewrites], ids=lambda d: d.name)
def test_both_measured_sides_compute_the_same(monkeypatch, spelling):
    """What is timed is the same computation on either side: the user's nodes (with the cache's
    write-back the fused op makes itself, and the broadcasts of a decay over the state computed,
    not read) and the rewrite agree on the random inputs the timing uses."""
    monkeypatch.setattr(sp, "T", 4)  # (the short loop from a cache: a short step)
    seen = []

    def check(original, rewritten, values, patches):
        inputs = [measure._random(v) for v in values]
        want, got = (m(*[x.clone() if isinstance(x, torch.Tensor) else x for x in inputs])
                     for m in (original, rewritten))
        assert len(want) == len(got) > 0
        for w, g in zip(want, got):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
        seen.append(spelling.name)
        return measure.Measurement(1.0, 2.0)

    monkeypatch.setattr(measure, "_measure", check)
    args = [a.detach() for a in spelling.make()]
    with torch.no_grad(), gla_inductor.config.patch(cost_measure="always"):
        torch.compile(spelling.fn, backend=gla_inductor.backend)(*args)
    assert seen == [spelling.name] and counters["gla_inductor"]["rewrites"] == 1
