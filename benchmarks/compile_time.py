"""Cold compile time of the GLA block of ``benchmarks.block``, ours against FLA's (CUDA).

Every run is a fresh process (``python -m benchmarks block --compile-only``) with an empty Inductor
cache and a Triton cache that holds only FLA's kernels and their autotuning results: FLA's run-time
autotuning takes minutes and is not compile time (a first process fills that cache). Inductor
compiles its Triton kernels into TRITON_CACHE_DIR, so nothing compiled in an earlier run is
reused. The block waits for Inductor's compile workers before compiling; the "workers-starting"
runs do not, as a script run once on a fresh machine would not.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks import harness, inputs, report
from benchmarks.block import QUICK_SHAPE, SHAPE

# (run name, variants in order, extra options of the block benchmark)
RUNS = [
    ("fla-first", "fla,ours,ours-unfused", []),
    ("ours-first", "ours,ours-unfused,fla", []),
    ("ours-alone", "ours", []),
    ("fla-alone", "fla", []),
    ("ours-alone-workers-starting", "ours", ["--no-worker-wait"]),
    ("fla-alone-workers-starting", "fla", ["--no-worker-wait"]),
]


def add_arguments(p) -> None:
    p.add_argument("--runs", help="comma-separated run names (default: all): " + ",".join(r[0] for r in RUNS))
    p.add_argument("--timeout", type=int, default=300, help="seconds per run")


def _env(**changes) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1", **changes)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(report.ROOT), env.get("PYTHONPATH")]))
    return env


def _subprocess(cmd: list, env: dict, log: Path, timeout: int) -> int:
    with open(log, "w") as f:
        try:
            return subprocess.run(cmd, cwd=report.ROOT, env=env, stdout=f, stderr=subprocess.STDOUT,
                                  timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            return 124


def run(args):
    harness.require_cuda("compile-time")
    shape = QUICK_SHAPE if args.quick else SHAPE
    fla_ok = inputs.fla_ops()[0] is not None
    wanted = args.runs.split(",") if args.runs else ["ours-alone"] if args.quick else [r[0] for r in RUNS]
    runs = [r for r in RUNS if r[0] in wanted and (fla_ok or r[1] != "fla")]
    result = report.new_result("compile-time", "Compile time of the GLA block, cold", "cuda", shape=list(shape))
    if not fla_ok:
        result.notes.append(inputs.fla_ops()[1] + " (runs of FLA alone are left out)")
    work = Path(tempfile.mkdtemp(prefix="gla-compile-time-"))
    logs = Path(args.out) / "compile-time-logs" if args.out else work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    fla_cache = work / "fla-triton"
    fla_cache.mkdir()
    shape_arg = ",".join(map(str, shape))
    if fla_ok:
        rc = _subprocess([sys.executable, "-c", f"from benchmarks.block import warm_fla; warm_fla(({shape_arg}))"],
                         _env(FLA_CACHE_RESULTS="1", TRITON_CACHE_DIR=str(fla_cache)), logs / "fla-warm.log",
                         args.timeout)
        result.notes.append(f"FLA warm-up process: rc {rc}")
    for name, variants, extra in runs:
        cache = work / name
        shutil.copytree(fla_cache, cache / "triton")
        cmd = [sys.executable, "-m", "benchmarks", "block", "--compile-only", "--variants", variants,
               "--shape", shape_arg, "--out", str(work / "json"), "--name", f"compile-{name}", *extra]
        env = _env(TORCHINDUCTOR_CACHE_DIR=str(cache / "inductor"), TRITON_CACHE_DIR=str(cache / "triton"))
        rc = _subprocess(cmd, env, logs / f"compile-{name}.log", args.timeout)
        shutil.rmtree(cache, ignore_errors=True)
        found = work / "json" / f"compile-{name}.json"
        rows = json.loads(found.read_text())["rows"] if found.exists() else [{"variant": variants, "error": f"rc {rc}"}]
        for r in rows:
            row = {"run": name, "rc": rc, **r}
            harness.log(row)
            result.rows.append(row)
    result.notes.append(f"logs of every process: {logs}")
    result.sections.append(report.table(result.rows, [
        ("run", "run", ""), ("variant", "variant", ""), ("compile s", "compile_s", ".2f"),
        ("rewrites", "rewrites", "d"), ("fused gates", "fused_gates", "d"),
        ("error", lambda r: (r.get("error") or "")[:100] or None, "")]))
    return result
