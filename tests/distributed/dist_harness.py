"""Run named checks in W spawned processes (gloo on CPU, NCCL on GPUs) and collect their results.

A test module lists check functions ``check(ctx) -> dict[str, float]`` (relative errors by name) and
calls ``run_checks(module_name, names, world)`` once per world size from a module fixture: one spawn
serves every check of the module, since starting W Python processes that import torch costs more
than the checks. Each rank runs the checks in order and writes its results after each one; a check
that raises is recorded with its message and ends that rank's run (its peers may then wait in a
collective until the process group's timeout, which is short).
"""

from __future__ import annotations

import datetime
import importlib
import json
import os
import socket
import tempfile
import time
import traceback
from dataclasses import dataclass
from typing import Optional

import torch
import torch.multiprocessing as mp

# NVLink multicast off in every process these tests start (the multi-GPU machines require it)
PROCESS_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}

# how long a collective waits for its peers: a rank that raised leaves them waiting. NCCL ranks may
# compile Triton kernels (seconds each) while their peers already wait in a collective.
COLLECTIVE_TIMEOUT_S = {"gloo": 60, "nccl": 300}


@dataclass
class Ctx:
    """What a check sees: its rank, the world size and device, a 1-D mesh over the world."""

    rank: int
    world: int
    device: torch.device
    _mesh: Optional[object] = None

    @property
    def mesh(self):
        if self._mesh is None:
            self._mesh = self.make_mesh((self.world,))
        return self._mesh

    def make_mesh(self, shape: tuple[int, ...], names: Optional[tuple[str, ...]] = None):
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(self.device.type, shape, mesh_dim_names=names)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, module: str, names: list[str], world: int, backend: str, port: int, outdir: str) -> None:
    os.environ.update(PROCESS_ENV)
    import torch.distributed as dist

    torch.set_num_threads(1)  # W processes share the runner's cores
    device, options = torch.device("cpu"), {}
    if backend == "nccl":
        torch.cuda.set_device(rank)  # before any CUDA work: NCCL and the kernels use the current device
        device = torch.device("cuda", rank)
        options["device_id"] = device  # the communicator bound to this rank's GPU from the start
    else:
        from torch._inductor import config as inductor_config

        # compile in the rank's own process: a pool of compile workers per rank, each importing torch,
        # costs more than it saves when W ranks share a few cores (GPU machines have cores to spare)
        inductor_config.compile_threads = 1
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S[backend]), **options)
    checks = importlib.import_module(module)
    # as in the test process (conftest's no_cost_rule): the checks are about what gets rewritten
    import gla_inductor

    gla_inductor.config.cost_rule = False
    ctx = Ctx(rank, world, device)
    results: dict[str, dict] = {}
    path = os.path.join(outdir, f"rank{rank}.json")
    try:
        for name in names:
            start = time.perf_counter()
            try:
                errors = getattr(checks, name)(ctx) or {}
                results[name] = {"errors": {k: float(v) for k, v in errors.items()}}
            except Exception as e:  # recorded for the test to report; the rank stops here
                results[name] = {"raised": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}
            results[name]["seconds"] = time.perf_counter() - start
            with open(path, "w") as f:
                json.dump(results, f)
            if "raised" in results[name]:
                break
    finally:
        dist.destroy_process_group()


def run_checks(module: str, names: list[str], world: int, backend: str = "gloo",
               timeout_s: float = 480) -> list[dict[str, dict]]:
    """Every rank's results, by check name; raises TimeoutError if the ranks do not finish in time."""
    os.environ.update(PROCESS_ENV)
    with tempfile.TemporaryDirectory() as outdir:
        context = mp.start_processes(_worker, args=(module, names, world, backend, free_port(), outdir),
                                     nprocs=world, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout_s
        failure = None
        try:
            while not context.join(timeout=max(1.0, deadline - time.monotonic())):
                if time.monotonic() > deadline:
                    failure = TimeoutError(f"{world} ranks did not finish {module}'s checks in {timeout_s} s")
                    break
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:  # outside the checks: start-up, a crash
            failure = e
        finally:
            for p in context.processes:
                if p.is_alive():
                    p.kill()
        results = []
        for rank in range(world):
            path = os.path.join(outdir, f"rank{rank}.json")
            results.append(json.load(open(path)) if os.path.exists(path) else {})
    if failure is not None and not any(results):
        raise failure
    if failure is not None:  # for the tests of the checks it kept from running
        results = [dict(r, _failure=f"{type(failure).__name__}: {failure}") for r in results]
    return results


def outcome(results: list[dict[str, dict]], name: str) -> list[dict]:
    """The check's result on every rank; fails the test if a rank did not get to run it."""
    per_rank = [r.get(name) for r in results]
    missing = [i for i, r in enumerate(per_rank) if r is None]
    if missing:
        earlier = [f"rank {i}: {n} raised {r['raised']}" for i, res in enumerate(results)
                   for n, r in res.items() if isinstance(r, dict) and "raised" in r]
        earlier += sorted({res["_failure"] for res in results if "_failure" in res})
        raise AssertionError(f"{name} did not run on ranks {missing}" + (f" (after {'; '.join(earlier)})"
                                                                        if earlier else ""))
    return per_rank


def assert_close(results: list[dict[str, dict]], name: str, rtol: float) -> None:
    """Every rank ran the check without raising and every relative error is within rtol."""
    for rank, r in enumerate(outcome(results, name)):
        assert "raised" not in r, f"rank {rank}: {r['raised']}\n{r['trace']}"
        bad = {k: v for k, v in r["errors"].items() if not v <= rtol}
        assert not bad, f"rank {rank}: relative errors above {rtol}: {bad}"


def world_id(world: int) -> str:
    """The test id of a world size: ``-k gpus4`` selects the 4-GPU variants."""
    return f"gpus{world}"


def need_gpus(n: int) -> Optional[str]:
    """Why a CUDA variant cannot run here, or None."""
    if not torch.cuda.is_available() or torch.cuda.device_count() < n:
        return f"needs {n} CUDA GPUs"
    return None
