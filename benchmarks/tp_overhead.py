"""Tensor parallelism over heads: what a DTensor call of ``chunk_gla`` costs per rank beyond the same
call on plain tensors holding the rank's heads (target: within 1.05x).

Per world size W (spawned processes, NCCL on GPUs, gloo with ``--device cpu``): q, k, v, g
[B, T, H, K] sharded over heads (``Shard(2)``), and their local parts as plain tensors. Four
passes: eager and compiled (``torch.compile(fullgraph=True)``, default Inductor), forward (no
grad) and forward + backward (gradients set to None before each step, as ``zero_grad`` does).
A fifth pass compiles an elementwise function of the same inputs and output instead (``q * k + v *
g``): what torch charges a compiled region for taking and returning DTensors (guards, the subclass
wrappers of AOTAutograd, the gradients' accumulation), whatever the region computes. ``--layers N``
makes a step N GLA calls (each one's o the next one's v), one region as a model's layers compile.
DTensor and plain steps alternate in rounds; each rank's median, ranks aligned by a barrier before
every step. Columns: the step to the device's end (``ms``, the slowest rank's), the host's part
(until the call returns, before synchronizing: where it nears ``ms`` the step waits on the host),
the DTensor / plain ratio of every rank and the largest of them; and per step of ``--iters`` steps
run back to back (one round of each kind after a barrier, as a training loop runs its steps: the
host's extra time hides where the device's step is longer), the median round, the largest ratio.
"""

from __future__ import annotations

import statistics
import sys
import time
import types

import torch
import torch.distributed as dist
import torch.nn.functional as F

from benchmarks import harness, report

CPU_SIZE = {"T": 64, "H": 4, "K": 16}
PASSES = [("eager", "fwd"), ("eager", "fwd+bwd"), ("compiled", "fwd"), ("compiled", "fwd+bwd"),
          ("compiled elementwise", "fwd+bwd")]


def add_arguments(p) -> None:
    p.add_argument("--worlds", default="2,4", help="process counts (those above the GPU count are left out)")
    p.add_argument("--T", type=int, default=32768)
    p.add_argument("--H", type=int, default=16)
    p.add_argument("--K", type=int, default=128, help="K = V")
    p.add_argument("--iters", type=int, default=10, help="steps per round")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds of DTensor and plain steps")
    p.add_argument("--layers", type=int, default=1,
                   help="GLA calls per step, each one's o the next one's v (one compiled region): the boundary's "
                        "cost against more layers' work")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--profile", type=int, default=0, metavar="STEPS",
                   help="cProfile STEPS compiled fwd+bwd steps of each kind on rank 0 (W=2): the functions whose "
                        "time per step differs most")


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _samples(step, device, iters: int) -> tuple[list, list]:
    """(ms to the device's end, host ms) of each of iters steps."""
    total, host = [], []
    for _ in range(iters):
        dist.barrier()
        _sync(device)
        start = time.perf_counter()
        step()
        returned = time.perf_counter()
        _sync(device)
        total.append((time.perf_counter() - start) * 1e3)
        host.append((returned - start) * 1e3)
    return total, host


def _back_to_back(step, device, iters: int) -> float:
    """ms per step of iters steps run back to back after one barrier, as a training loop runs them:
    the host may run ahead of the device, so its own time hides wherever the device's is longer."""
    dist.barrier()
    _sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        step()
    _sync(device)
    return (time.perf_counter() - start) * 1e3 / iters


def compare(steps: dict, device, iters: int, rounds: int, warmup: int = 3) -> dict:
    """Medians of this rank's steps by name ('dtensor', 'plain'), measured in alternating rounds:
    each step alone (``_samples``), and per step of a back-to-back round."""
    for step in steps.values():
        for _ in range(warmup):
            step()
    samples = {name: ([], [], []) for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            total, host = _samples(step, device, iters)
            samples[name][0].extend(total)
            samples[name][1].extend(host)
            samples[name][2].append(_back_to_back(step, device, iters))
    return {f"{name}_{kind}": statistics.median(s[i]) for name, s in samples.items()
            for i, kind in enumerate(("ms", "host_ms", "steady_ms"))}


def _inputs(B, T, H, K, dtype, device):
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(B, T, H, K, generator=gen, device=device, dtype=dtype) for _ in range(3))
    g = F.logsigmoid(torch.randn(B, T, H, K, generator=gen, device=device)).to(dtype) / 16
    return [q, k, v, g]


def _step(fn, tensors: list, do, backward: bool):
    def fwd():
        with torch.no_grad():
            fn(*tensors)

    def fwd_bwd():
        for x in tensors:
            x.grad = None
        o = fn(*tensors)
        o.backward(do)

    return fwd_bwd if backward else fwd


def gla_o(q, k, v, g):
    import gla_inductor

    return gla_inductor.chunk_gla(q, k, v, g)[0]


def gla_layers(layers: int):
    """``layers`` GLA calls in one function, each one's o the next one's v: a region of several
    layers, whose boundary (the DTensor wrapping of its inputs, outputs and gradients) is paid once."""
    if layers == 1:
        return gla_o

    def stack(q, k, v, g):
        import gla_inductor

        for _ in range(layers):
            v = gla_inductor.chunk_gla(q, k, v, g)[0]
        return v

    return stack


def elementwise(q, k, v, g):
    return q * k + v * g


def _own_code(fn):
    """fn with a copy of its code object: Dynamo keeps its compiled entries on the code object, and
    one that serves DTensor and plain calls has each call check the other's guards first."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def _functions(mode: str, layers: int = 1) -> dict:
    """Each compiled function static and on its own code: as a program compiling one kind of call
    once (``dynamic=False``: Dynamo keys automatic dynamic shapes by the function's file, line and
    name, and would else mark the heads dynamic when the plain call brings H/W where the DTensor
    call brought H, which puts symbolic sizes into the DTensor wrappers' work at run time)."""
    if mode == "eager":
        return {"dtensor": gla_layers(layers), "plain": gla_layers(layers)}
    fn = elementwise if mode == "compiled elementwise" else gla_layers(layers)
    return {kind: torch.compile(_own_code(fn), fullgraph=True, dynamic=False) for kind in ("dtensor", "plain")}


def _profile(step, device, n: int) -> dict:
    """cProfile n calls of step, the device synchronized after each (no launch then waits on a full
    queue): per function, (calls, cumulative us, own us) per step."""
    import cProfile
    import pstats

    def run():
        for _ in range(n):
            step()
            _sync(device)

    prof = cProfile.Profile()
    prof.runcall(run)
    out: dict = {}
    for (file, line, fn), (_, calls, own, cum, _) in pstats.Stats(prof).stats.items():
        # Inductor's output code (modules named by a hash, which differs by kind) counted as one
        where = "<Inductor output code>" if "torchinductor" in file else file.split("site-packages/")[-1]
        before = out.get(f"{where}:{line}({fn})", (0, 0, 0))
        out[f"{where}:{line}({fn})"] = tuple(a + b for a, b in zip(before, (calls / n, cum * 1e6 / n, own * 1e6 / n)))
    return out


def profile_rows(steps: dict, device, n: int, top: int = 25) -> list:
    """Per function, each step's calls, cumulative and own us per step (``_profile``), the largest
    differences of cumulative time first: what a DTensor step adds to the plain one."""
    profiles = {name: _profile(step, device, n) for name, step in steps.items()}
    fields = ("calls", "us", "self_us")
    rows = [{"function": f, **{f"{s}_{c}": profiles[s].get(f, (0, 0, 0))[i] for s in steps
                               for i, c in enumerate(fields)}}
            for f in set().union(*profiles.values())]
    for r in rows:
        r["extra_us"], r["extra_self_us"] = r["dtensor_us"] - r["plain_us"], r["dtensor_self_us"] - r["plain_self_us"]
    return sorted(rows, key=lambda r: -abs(r["extra_us"]))[:top]


def rank_rows(rank, world, args, device) -> list:
    import gla_inductor.distributed  # noqa: F401  (the sharding rules and the eager route)
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    mesh = init_device_mesh(device.type, (world,))
    full = _inputs(1, args.T, args.H, args.K, dtype, device)
    sharded = [distribute_tensor(x, mesh, [Shard(2)]).requires_grad_() for x in full]
    local = [x.to_local().detach().clone().requires_grad_() for x in sharded]
    do_sharded = distribute_tensor(torch.randn_like(full[2]), mesh, [Shard(2)])
    do_local = do_sharded.to_local().clone()
    rows = []
    for mode, pass_ in PASSES:
        fns = _functions(mode, args.layers)
        backward = pass_ == "fwd+bwd"
        steps = {"dtensor": _step(fns["dtensor"], sharded, do_sharded, backward),
                 "plain": _step(fns["plain"], local, do_local, backward)}
        r = compare(steps, device, args.iters, args.rounds)
        r["ratio"] = r["dtensor_ms"] / r["plain_ms"]
        r["steady_ratio"] = r["dtensor_steady_ms"] / r["plain_steady_ms"]
        ratios = [None] * world
        dist.all_gather_object(ratios, r)
        rows.append({"world": world, "heads_per_rank": args.H // world, "mode": mode, "pass": pass_,
                     **{k: max(x[k] for x in ratios) for k in r}, "rank_ratios": [x["ratio"] for x in ratios]})
        if args.profile and world == 2 and (mode, pass_) == ("compiled", "fwd+bwd"):
            profiled = profile_rows(steps, device, args.profile)  # every rank: the steps hold no collective
            if rank == 0:
                rows.append({"profile": profiled})
    return rows


def run(args):
    if args.device == "cuda":
        harness.require_cuda("tp-overhead")
    if args.device == "cpu":
        args.T, args.H, args.K = CPU_SIZE["T"], CPU_SIZE["H"], CPU_SIZE["K"]
    if args.quick:
        args.iters, args.rounds = 3, 1
    worlds = [int(w) for w in args.worlds.split(",")]
    result = report.new_result("tp-overhead", "Tensor parallel over heads: DTensor call against the rank's heads",
                               args.device, T=args.T, H=args.H, K=args.K, layers=args.layers, iters=args.iters,
                               rounds=args.rounds, **harness.PROCESS_ENV)
    if args.device == "cuda":
        dropped = [w for w in worlds if w > torch.cuda.device_count()]
        worlds = [w for w in worlds if w <= torch.cuda.device_count()]
        if dropped:
            result.notes.append(f"worlds {dropped} left out: {torch.cuda.device_count()} GPU(s) visible")
    for w in worlds:
        print(f"[tp-overhead] W={w}", file=sys.stderr, flush=True)
        for row in harness.run_ranks(rank_rows, w, args, bind_device=True, one_thread=True):
            if "profile" in row:
                result.sections.append(profile_table(row["profile"], args.profile))
                continue
            harness.log(row)
            result.rows.append(row)
    result.sections.insert(0, table(result.rows))
    return result


def table(rows: list) -> str:
    head = ("Per rank, B = 1, bf16 on GPUs (fp32 on CPU), vector gate; medians, the slowest rank's ms, the "
            "largest rank ratio\n\n")
    return head + report.table(rows, [
        ("W", "world", "d"), ("heads / rank", "heads_per_rank", "d"), ("mode", "mode", "s"), ("pass", "pass", "s"),
        ("DTensor ms", "dtensor_ms", ".3f"), ("plain ms", "plain_ms", ".3f"), ("ratio", "ratio", ".3f"),
        ("per rank", lambda r: " ".join(f"{x:.3f}" for x in r["rank_ratios"]), "s"),
        ("DTensor host ms", "dtensor_host_ms", ".3f"), ("plain host ms", "plain_host_ms", ".3f"),
        ("back to back: DTensor ms", "dtensor_steady_ms", ".3f"), ("plain ms ", "plain_steady_ms", ".3f"),
        ("ratio ", "steady_ratio", ".3f")])


def profile_table(rows: list, n: int) -> str:
    head = (f"cProfile of {n} compiled fwd+bwd steps of each kind on rank 0 (W = 2; the profiler slows every call): "
            "per step, the functions whose cumulative time differs most, and the difference in their own time\n\n")
    return head + report.table(rows, [
        ("function", "function", "s"), ("DTensor calls", "dtensor_calls", ".1f"), ("plain calls", "plain_calls", ".1f"),
        ("DTensor us", "dtensor_us", ".1f"), ("plain us", "plain_us", ".1f"), ("extra us", "extra_us", ".1f"),
        ("extra self us", "extra_self_us", ".1f")])
