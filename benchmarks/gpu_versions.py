"""A/B of code versions: forward and backward of the default configs, timed in CUDA graphs (GPU
time), bf16, one process per version, the versions interleaved per round to spread drift.

    PYTHONPATH=$PWD python benchmarks/gpu_versions.py --versions base=_base,new=. \
        [--cases 8,2048,16,128,128:vector,8,2048,16,128,128:scalar] [--rounds 2] [--out ab.json]

Each version is a folder holding a ``gla_inductor`` package (e.g. ``git archive HEAD gla_inductor |
tar -x -C _base``). A version's outputs are checked against the first version's.
"""

import argparse
import json
import os
import subprocess
import sys

CASES = ("8,2048,16,128,128:vector,1,8192,96,128,128:vector,8,2048,4,256,512:vector,4,2048,16,128,128:vector,"
         "8,1024,8,64,64:vector,2,16384,16,128,128:vector,8,2048,16,128,128:scalar")

# sys.path[0] of `python -c` is the working directory, ahead of PYTHONPATH: the child puts the
# version's folder (argv[3]) first itself
CHILD = r"""
import json, os, sys, torch
sys.path[:0] = [os.path.abspath(sys.argv[3]), "benchmarks"]
from triton.testing import do_bench_cudagraph
from gla_inductor.triton_chunk import chunk_bwd_triton, chunk_fwd_triton
from gpu_schedule import sweep_inputs
rows = []
for case in sys.argv[1].split(";"):
    shape, gate = case.split(":")
    B, T, H, K, V = map(int, shape.split(","))
    q, k, v, g = sweep_inputs(B, T, H, K, V, gate)
    do = torch.randn_like(v)
    fwd = lambda: chunk_fwd_triton(q, k, v, g, None, None, K ** -0.5, False, False)[0]
    bwd = lambda: chunk_bwd_triton(q, k, v, g, None, None, do, None, K ** -0.5, False)
    out = (fwd(), *bwd()[:4])
    torch.save([t.cpu() for t in out], f"{sys.argv[2]}.{len(rows)}.pt")
    rows.append(dict(case=case, package=os.path.dirname(chunk_fwd_triton.__code__.co_filename), fwd_ms=do_bench_cudagraph(fwd, rep=50), bwd_ms=do_bench_cudagraph(bwd, rep=50)))
print("ROWS " + json.dumps(rows))
"""


def run_version(folder: str, cases: list[str], tag: str) -> list[dict]:
    done = subprocess.run([sys.executable, "-c", CHILD, ";".join(cases), tag, folder], capture_output=True, text=True)
    line = next((l for l in done.stdout.splitlines() if l.startswith("ROWS ")), None)
    if line is None:
        raise RuntimeError(f"{folder}: {done.stderr[-2000:]}")
    return json.loads(line[5:])


def main():
    import torch

    from gpu_schedule import rel_err

    p = argparse.ArgumentParser()
    p.add_argument("--versions", required=True, help="name=folder,...")
    p.add_argument("--cases", default=CASES, help="B,T,H,K,V:gate, comma-separated after each gate")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out")
    args = p.parse_args()
    versions = [v.split("=") for v in args.versions.split(",")]
    parts = args.cases.split(",")
    cases, cur = [], []
    for part in parts:  # "8,2048,...,128:vector" split on commas: regroup by the ":gate" ends
        cur.append(part)
        if ":" in part:
            cases.append(",".join(cur))
            cur = []
    results = {name: [] for name, _ in versions}
    os.makedirs("/tmp/gpu_versions", exist_ok=True)
    for r in range(args.rounds):
        for name, folder in versions:
            results[name].append(run_version(folder, cases, f"/tmp/gpu_versions/{name}"))
            print(name, r, json.dumps(results[name][-1]), flush=True)
    first = versions[0][0]
    errs = {}
    for name, _ in versions[1:]:
        for i in range(len(cases)):
            a = torch.load(f"/tmp/gpu_versions/{name}.{i}.pt")
            b = torch.load(f"/tmp/gpu_versions/{first}.{i}.pt")
            errs[(name, i)] = max(rel_err(x, y) for x, y in zip(a, b))
    best = {name: [{k: min(rr[i][k] for rr in results[name]) for k in ("fwd_ms", "bwd_ms")}
                   for i in range(len(cases))] for name, _ in versions}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, cases=cases, runs=results,
                           best=best, err_vs_first={f"{n}:{cases[i]}": e for (n, i), e in errs.items()}), f,
                      indent=1)
    names = [n for n, _ in versions]
    print("| case | " + " | ".join(f"{n} fwd" for n in names) + " | " + " | ".join(f"{n} bwd" for n in names)
          + " | max rel err vs " + first + " |")
    print("|---" * (2 * len(names) + 2) + "|")
    for i, case in enumerate(cases):
        err = max((errs[(n, i)] for n in names[1:]), default=0.0)
        print(f"| {case} | " + " | ".join(f"{best[n][i]['fwd_ms']:.3f}" for n in names) + " | "
              + " | ".join(f"{best[n][i]['bwd_ms']:.3f}" for n in names) + f" | {err:.1e} |")


if __name__ == "__main__":
    main()
