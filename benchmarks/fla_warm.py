"""FLA's autotuning, bounded: warm one FLA op at one shape in a child process with a time limit.

FLA's chunked ops autotune their Triton kernels on first call (minutes per shape on a fresh
machine, most of it compiling configs). A benchmark that calls FLA in its own process cannot stop
that. Here a child process makes the first call instead, under a time limit, with Triton's cache
directory shared: every config it compiled, and each kernel's autotune result (FLA passes
``cache_results``), stays on disk, so the benchmark's own first call afterwards only loads them, and
a child killed at its limit leaves what it finished for the next try (a rerun continues).

    python -m benchmarks.fla_warm chunk_gla 8,2048,16,128,128 [--grad]

``cache_dir()`` is the shared directory: $TRITON_CACHE_DIR where set, else ``.cache/triton``
in benchmarks/ (ignored by git; on a lent machine kept between calls of one session, and it can be
carried to the next machine). Autotune results alone are small: ``--autotune-to DIR`` of the
benchmarks that warm FLA saves them, and ``--autotune-from`` (default ``benchmarks/fla_autotune/``,
which travels with the working tree when it is not ignored) loads them on a fresh machine, where FLA
then compiles only each kernel's chosen config.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
SAVED = ROOT / "benchmarks" / "fla_autotune"  # autotune results carried with the working tree
OPS = ("chunk_gla", "chunk_simple_gla", "fused_recurrent_gla", "fused_recurrent_simple_gla")


def cache_dir() -> str:
    """Triton's cache directory, set in this process's environment (before its first compile) so
    that this process and its children share it."""
    path = os.environ.setdefault("TRITON_CACHE_DIR", str(ROOT / "benchmarks" / ".cache" / "triton"))
    os.makedirs(path, exist_ok=True)
    return path


def save_autotune(dst: str) -> int:
    """Copy every autotune result in the cache (``<key>/<kernel>.autotune.json``: small files) to
    ``dst``; returns how many. With them in a fresh machine's cache (``load_autotune``), FLA compiles
    only each kernel's chosen config instead of all of them."""
    src = Path(cache_dir())
    n = 0
    for f in src.glob("*/*.autotune.json"):
        target = Path(dst) / f.parent.name / f.name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(f, target)
        n += 1
    return n


def load_autotune(src: str) -> int:
    """Copy autotune results saved by ``save_autotune`` into the cache; returns how many. Triton
    keys them by its version, the kernel's source, the device and the tuning key: a result from other
    software or another GPU is never found, so a stale directory costs nothing."""
    n = 0
    for f in Path(src).glob("*/*.autotune.json"):
        target = Path(cache_dir()) / f.parent.name / f.name
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(f, target)
            n += 1
    return n


def add_autotune_arguments(p) -> None:
    """--autotune-from / --autotune-to, for the benchmarks that call FLA's chunked ops."""
    p.add_argument("--autotune-from", default=str(SAVED), metavar="DIR",
                   help="FLA autotune results to load into Triton's cache first (default: %(default)s, if there)")
    p.add_argument("--autotune-to", metavar="DIR",
                   help="save the autotune results in the cache here at the end (e.g. $OUT/fla_autotune; "
                        "copy them into benchmarks/fla_autotune/ so that the next machine has them)")


def autotune_before(args, notes: list) -> None:
    if args.autotune_from and Path(args.autotune_from).is_dir():
        notes.append(f"{load_autotune(args.autotune_from)} FLA autotune results loaded from {args.autotune_from}")


def autotune_after(args) -> None:
    if args.autotune_to:
        print(f"[fla-warm] {save_autotune(args.autotune_to)} autotune results saved to {args.autotune_to}",
              file=sys.stderr, flush=True)


def warm(op: str, shape: tuple, budget_s: float, grad: bool = False, lengths: Optional[list] = None) -> tuple:
    """(True, seconds, "") when the child finished the op's first call at ``shape`` within
    ``budget_s``; (False, seconds, why) otherwise. ``lengths``: packed sequences (cu_seqlens) of
    these lengths, B = 1 and T their sum. Progress goes to stderr as it happens."""
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    cache_dir()
    cmd = [sys.executable, "-m", "benchmarks.fla_warm", op, ",".join(map(str, shape))] + (["--grad"] if grad else [])
    if lengths:
        cmd += ["--lengths", ",".join(map(str, lengths))]
    print(f"[fla-warm] {op} {shape}{' +grad' if grad else ''}: autotuning in a child, limit {budget_s:.0f} s",
          file=sys.stderr, flush=True)
    start = time.perf_counter()
    try:
        done = subprocess.run(cmd, cwd=ROOT, env=os.environ.copy(), timeout=budget_s, capture_output=True, text=True)
    except subprocess.TimeoutExpired:
        took = time.perf_counter() - start
        why = (f"FLA {op} autotuning at {shape} passed its {budget_s:.0f} s limit (what it compiled is kept in "
               f"{cache_dir()}: a rerun continues)")
        print(f"[fla-warm] {why}", file=sys.stderr, flush=True)
        return False, took, why
    took = time.perf_counter() - start
    if done.returncode != 0:
        why = f"FLA {op} at {shape} failed: {(done.stderr or done.stdout).strip().splitlines()[-1:]}"
        print(f"[fla-warm] {why}", file=sys.stderr, flush=True)
        return False, took, why
    print(f"[fla-warm] {op} {shape}: done in {took:.1f} s", file=sys.stderr, flush=True)
    return True, took, ""


def call(op: str, shape: tuple, grad: bool, lengths: Optional[list] = None) -> None:
    """The first call of ``op`` at ``shape`` with the benchmarks' inputs and arguments (what autotunes)."""
    import torch

    from benchmarks import inputs

    B, T, H, K, V = shape
    gate = "scalar" if "simple" in op else "vector"
    q, k, v, g = inputs.gla_inputs(B, T, H, K, V, gate=gate, requires_grad=grad)
    fla = fla_module(op)
    if lengths:  # packed, as the varlen benchmark calls it
        o, _ = fla(q, k, v, g, cu_seqlens=cu_seqlens(lengths, q.device))
    elif op.startswith("chunk"):  # as the benchmarks call it: no initial state (prefill)
        o, _ = fla(q, k, v, g)
    else:  # decoding: from a state, to a new one
        kwargs = {"gk": g} if op == "fused_recurrent_gla" else {"g": g}
        o, _ = fla(q, k, v, initial_state=inputs.state(B, H, K, V), output_final_state=True, **kwargs)
    if grad:
        o.backward(torch.randn_like(o))
    torch.cuda.synchronize()


def cu_seqlens(lengths: list, device):
    """int64 offsets [0, l0, l0 + l1, ...] of packed sequences (FLA's dtype)."""
    import torch

    out = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    out[1:] = torch.tensor(lengths).cumsum(0)
    return out.to(device)


def fla_module(op: str):
    if op in ("chunk_gla", "fused_recurrent_gla"):
        import fla.ops.gla as mod
    else:
        import fla.ops.simple_gla as mod
    return getattr(mod, op)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.fla_warm", description=__doc__.splitlines()[0])
    p.add_argument("op", choices=OPS)
    p.add_argument("shape", help="B,T,H,K,V")
    p.add_argument("--grad", action="store_true", help="the backward too")
    p.add_argument("--lengths", help="packed sequence lengths l0,l1,... (shape's T is their sum)")
    args = p.parse_args(argv)
    cache_dir()
    lengths = [int(x) for x in args.lengths.split(",")] if args.lengths else None
    call(args.op, tuple(int(x) for x in args.shape.split(",")), args.grad, lengths)
    return 0


if __name__ == "__main__":
    sys.exit(main())
