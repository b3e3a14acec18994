"""Timing and memory measurement shared by every benchmark.

Three clocks, one shape of result (``Timing``: milliseconds per call, grouped by round):
  * ``events``: CUDA events around each call, the L2 cache flushed before each, as
    ``triton.testing.do_bench`` does. Where the host is slower than the GPU, the host's launch
    overhead is part of the time.
  * ``graph``: the calls captured in a CUDA graph, replays timed by events: the GPU time alone.
  * ``cpu``: ``time.perf_counter`` around each call.

Several functions passed together are timed in interleaved rounds (each round times every
function, in an order that rotates), so that a machine whose speed drifts (shared CPUs, clocks,
neighbours) moves all of them alike; a ratio is then best taken per round (``round_ratio``).
"""

from __future__ import annotations

import datetime
import gc
import os
import socket
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

L2_FLUSH_BYTES = 256 * 2**20  # more than any GPU's L2 (triton.testing's choice)


@dataclass
class Timing:
    """Milliseconds per call; ``rounds[i]`` holds the samples of round i."""

    rounds: list = field(default_factory=list)

    @property
    def samples(self) -> list:
        return [x for r in self.rounds for x in r]

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def min(self) -> float:
        return min(self.samples)

    def quantile(self, q: float) -> float:
        xs = sorted(self.samples)
        return xs[min(len(xs) - 1, int(q * len(xs)))]

    def round_medians(self) -> list:
        return [statistics.median(r) for r in self.rounds]

    def fields(self, prefix: str = "") -> dict:
        """Row fields: median, 20th and 80th percentile, minimum."""
        return {f"{prefix}ms": self.median, f"{prefix}ms_p20": self.quantile(0.2),
                f"{prefix}ms_p80": self.quantile(0.8), f"{prefix}ms_min": self.min}


def round_ratio(num: Timing, den: Timing) -> float:
    """Median over rounds of num / den (each round's median): the speed-up with the drift of the
    machine between rounds divided out."""
    return statistics.median(a / b for a, b in zip(num.round_medians(), den.round_medians()))


# ---------------------------------------------------------------------------------------------
# clocks
# ---------------------------------------------------------------------------------------------


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _estimate_ms(fn: Callable, device: str, calls: int = 3) -> float:
    _sync(device)
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    _sync(device)
    return max((time.perf_counter() - start) / calls * 1e3, 1e-3)


class _EventClock:
    """CUDA events around each call, the L2 flushed before each."""

    def __init__(self, flush_l2: bool = True):
        self.flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.int8, device="cuda") if flush_l2 else None

    def prepare(self, fn: Callable, calls: int):
        return fn

    def run(self, fn: Callable, calls: int) -> list:
        pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(calls)]
        for start, end in pairs:
            if self.flush is not None:
                self.flush.zero_()
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        return [s.elapsed_time(e) for s, e in pairs]


class _GraphClock:
    """``calls`` calls captured in one CUDA graph; each replay timed, divided by ``calls``."""

    def __init__(self, replays: int = 3):
        self.replays = replays

    def prepare(self, fn: Callable, calls: int):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up on a side stream, as capture requires
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
        torch.cuda.synchronize()
        return graph

    def run(self, graph, calls: int) -> list:
        out = []
        for _ in range(self.replays):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            torch.cuda.synchronize()
            out.append(start.elapsed_time(end) / calls)
        return out


class _CpuClock:
    def prepare(self, fn: Callable, calls: int):
        return fn

    def run(self, fn: Callable, calls: int) -> list:
        out = []
        for _ in range(calls):
            start = time.perf_counter()
            fn()
            out.append((time.perf_counter() - start) * 1e3)
        return out


def measure(fns: dict, *, clock: str = "events", rounds: int = 5, round_ms: float = 20.0, warmup_ms: float = 25.0,
            calls: Optional[dict] = None, flush_l2: bool = True, errors: Optional[dict] = None) -> dict:
    """Time each function of ``fns`` (name -> callable of no arguments) in ``rounds`` interleaved
    rounds; returns name -> Timing, or name -> None for a function whose CUDA graph capture failed
    (why goes into ``errors`` where given).

    clock: "events", "graph" or "cpu" (see the module docstring). Each round gives a function about
    ``round_ms`` of calls, or ``calls[name]`` calls where given (the CPU benchmark weights a slow eager
    call against several fast compiled ones so that both see the same load)."""
    device = "cpu" if clock == "cpu" else "cuda"
    clk = {"events": lambda: _EventClock(flush_l2), "graph": _GraphClock, "cpu": _CpuClock}[clock]()
    plans = {}
    for name, fn in fns.items():
        fn()  # a first call may compile or autotune: not part of the estimate
        est = _estimate_ms(fn, device)
        for _ in range(int(warmup_ms / est)):
            fn()
        n = (calls or {}).get(name) or max(1, min(1000, int(round_ms / est)))
        if clock == "graph":
            n = max(1, n // 3)  # each round replays the graph three times
        try:
            plans[name] = (clk.prepare(fn, n), n)
        except Exception as e:  # noqa: BLE001 - a host sync or an allocation that capture refuses
            if errors is not None:
                errors[name] = error_text(e)
            _sync(device)
    _sync(device)
    out = {name: (Timing() if name in plans else None) for name in fns}
    order = list(plans)
    for r in range(rounds if order else 0):
        shift = r % len(order)
        for name in order[shift:] + order[:shift]:
            prepared, n = plans[name]
            out[name].rounds.append(clk.run(prepared, n))
    return out


def time_one(fn: Callable, **kw) -> Optional[Timing]:
    return measure({"fn": fn}, **kw)["fn"]


def graph_ms(fn: Callable, **kw) -> Optional[float]:
    """Median ms per call replayed from a CUDA graph, or None where fn cannot be captured."""
    t = time_one(fn, clock="graph", **kw)
    return None if t is None else t.median


def kernel_ms(fn: Callable, calls: int = 20) -> float:
    """GPU time per call as the time the CUDA kernels (and copies) run under the profiler: the
    union of their intervals, so that kernels overlapping on two streams count once; host time and
    the gaps a host synchronization leaves are not counted. For calls that cannot be captured in a
    CUDA graph (FLA's packed sequences read their offsets on the host), so that both sides of a
    comparison are GPU time alone."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    spans = [(e.time_range.start, e.time_range.end) for e in prof.events()
             if e.device_type == torch.autograd.DeviceType.CUDA]
    return busy_us(spans) / 1000 / calls


def busy_us(spans: list[tuple[float, float]]) -> float:
    """The length of the union of the (start, end) intervals."""
    total, reached = 0.0, float("-inf")
    for start, end in sorted(spans):
        total += max(0.0, end - max(start, reached))
        reached = max(reached, end)
    return total


def first_and_warm(fn: Callable, device: str, between: Optional[Callable] = None):
    """(output of the first call, its seconds, the seconds of a second call): the difference is the
    compile time of a function compiled on first call. ``between(output)`` runs between the calls
    (to read state that the second call changes)."""
    _sync(device)
    start = time.perf_counter()
    out = fn()
    _sync(device)
    first = time.perf_counter() - start
    if between is not None:
        between(out)
    start = time.perf_counter()
    fn()
    _sync(device)
    return out, first, time.perf_counter() - start


# ---------------------------------------------------------------------------------------------
# bandwidth, byte floors, memory
# ---------------------------------------------------------------------------------------------


def copy_bandwidth(nbytes: int = 1 << 30, device: str = "cuda") -> float:
    """Bytes read + written per second by a copy of an nbytes buffer (device to device, or within
    host memory on CPU)."""
    x = torch.empty(nbytes, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    ms = time_one(lambda: y.copy_(x), clock="cpu" if device == "cpu" else "events", rounds=3).median
    return 2 * nbytes / (ms * 1e-3)


def tensor_bytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def floor_ms(nbytes: int, bandwidth: float) -> float:
    """The least time moving nbytes can take at the measured copy bandwidth."""
    return nbytes / bandwidth * 1e3


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def peak_extra_mib(fn: Callable) -> Optional[float]:
    """CUDA memory allocated by one call above what was allocated before it, in MiB."""
    if not torch.cuda.is_available():
        return None
    torch.cuda.synchronize()
    free_memory()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def is_oom(e: BaseException) -> bool:
    text = str(e).lower()
    return isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in text or "can't allocate memory" in text


# ---------------------------------------------------------------------------------------------
# small helpers every benchmark needs
# ---------------------------------------------------------------------------------------------


def require_cuda(what: str) -> None:
    """Exit with a clear message where no CUDA device is present."""
    if not torch.cuda.is_available():
        sys.exit(f"`python -m benchmarks {what}` needs CUDA: no CUDA device is visible to torch "
                 f"{torch.__version__} on this machine (torch.cuda.is_available() is False).")


def error_text(e: BaseException, n: int = 300) -> str:
    return f"{type(e).__name__}: {str(e)[:n]}"


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| in float64."""
    want = want.detach().double()
    return ((got.detach().double() - want).norm() / want.norm().clamp_min(1e-30)).item()


def log(row: dict) -> None:
    """Progress: each row as it is measured, on stderr (the report goes to stdout)."""
    import json

    print(json.dumps(row, default=str), file=sys.stderr, flush=True)


def parse_shapes(text: str) -> list:
    """'8,2048,16,128,128;1,8192,96,128,128' -> [(8, 2048, 16, 128, 128), (1, 8192, 96, 128, 128)]."""
    return [tuple(int(x) for x in s.split(",")) for s in text.split(";") if s.strip()]


# ---------------------------------------------------------------------------------------------
# several processes (the distributed benchmarks)
# ---------------------------------------------------------------------------------------------

# NVLink multicast off in every process on the lent multi-GPU machines
PROCESS_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}


def run_ranks(rank_fn: Callable, world: int, args, *, bind_device: bool = False, one_thread: bool = False):
    """What rank 0's ``rank_fn(rank, world, args, device)`` returns, run in ``world`` spawned
    processes joined by a process group (NCCL on CUDA, gloo on the CPU). ``bind_device``: the
    group is created for the rank's GPU (``device_id``); ``one_thread``: one torch thread per
    rank on the CPU. ``rank_fn`` must be a module-level function (spawn pickles it by name)."""
    os.environ.update(PROCESS_ENV)  # inherited by the spawned processes, which set it again themselves
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_rank_worker, args=(world, port, rank_fn, args, queue, bind_device, one_thread), nprocs=world)
    return queue.get()


def _rank_worker(rank, world, port, rank_fn, args, queue, bind_device, one_thread):
    os.environ.update(PROCESS_ENV)
    device = torch.device(args.device, rank) if args.device == "cuda" else torch.device("cpu")
    options = {}
    if device.type == "cuda":
        torch.cuda.set_device(device)
        if bind_device:
            options["device_id"] = device
    elif one_thread:
        torch.set_num_threads(1)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300), **options)
    try:
        result = rank_fn(rank, world, args, device)
        if rank == 0:
            queue.put(result)
    finally:
        dist.destroy_process_group()
