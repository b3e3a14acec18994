"""Never slower: is the backend at least as fast as what a user would run without it?

Sections (--section, comma-separated; each finishes in minutes on one GPU, so runs can be split):
  decode   T = 1, B in {1, 16, 64, 256}, H = 32, K = V = 128, vector and scalar gates: bf16 q, k, v,
           fp32 state cache [B, H, K, V] updated in place by the naive step
           ``S = S * exp(g)[..., None] + k[..., None] * v[..., None, :]; o = (q[..., None] * S).sum(-2)
           * scale; cache.copy_(S)`` (CUDA)
  short    T in {2, 4, 8, 16} steps from a cache at B = 16 (H, K, V as decode), the same step in a
           loop, the final state copied back (CUDA)
  prefill  the naive parallel form at the kernel benchmark's standard shapes, vector gate
           ((q e^G)(k e^-G)^T, tril) and scalar gate (decay matrix), forward (CUDA)
  cpu      decode B=8 H=4 64x64, B=1 H=16 128x128, B=32 H=8 64x64; a 4-token step B=4 H=8 64x64;
           the naive loop B=2 T=512 H=4 64x64 (eager against compiled: default Inductor is left out,
           it would unroll 512 steps), fp32 (CPU)
Columns (benchmarks/never_slower_cases.py): naive eager, default Inductor, ours (the backend, cost
rule on: what users get), forced (cost rule off), FLA's op where it has one, and for the steps on
CUDA the three compiled ones under mode="reduce-overhead" with the cache marked static. On CUDA
each column is timed by events (host time included where the host is slower) and, except the
reduce-overhead ones, in a CUDA graph captured by hand (GPU time alone).

Ratios: ``ours / best other`` without graphs (events) and with graphs (the best of the graph
replays and reduce-overhead of each side); below 1.0 ours wins. FLA's chunked ops autotune for
minutes per shape: a child process warms them first under --fla-budget seconds per shape
(benchmarks/fla_warm.py); past it the FLA column of that shape is left out with a note, and a
rerun continues its autotuning from the on-disk cache. --budget bounds the whole run: no case
begins after it (the FLA warm-up gets at most what is left less a minute), so one section, or a
few prefill shapes (--shapes), fit in a command of ten minutes. --quick: one small shape per
section.
"""

from __future__ import annotations

import os
import sys
import time

import torch

from benchmarks import fla_warm, harness, inputs, never_slower_cases as cases, report

SECTIONS = ("decode", "short", "prefill", "cpu")
DECODE_BATCHES, DECODE_HEADS, HEAD_DIM = (1, 16, 64, 256), 32, 128
SHORT_STEPS, SHORT_BATCH = (2, 4, 8, 16), 16
CPU_CASES = [("decode", (8, 1, 4, 64, 64)), ("decode", (1, 1, 16, 128, 128)), ("decode", (32, 1, 8, 64, 64)),
             ("short", (4, 4, 8, 64, 64)), ("loop", (2, 512, 4, 64, 64))]
QUICK = {"decode": [(16, 1, 8, 64, 64)], "short": [(4, 4, 8, 64, 64)], "prefill": inputs.QUICK_SHAPES,
         "cpu": [("decode", (2, 1, 2, 16, 16)), ("short", (2, 2, 2, 16, 16)), ("loop", (1, 32, 2, 16, 16))]}


def add_arguments(p) -> None:
    p.add_argument("--section", default=",".join(SECTIONS), help="of " + ",".join(SECTIONS))
    p.add_argument("--gates", default="vector,scalar", help="decode, short and prefill gates")
    p.add_argument("--impls", default=",".join(cases.COLUMNS), help="columns, of " + ",".join(cases.COLUMNS))
    p.add_argument("--batches", help="decode batch sizes (default: 1,16,64,256)")
    p.add_argument("--steps", help="short-step T values (default: 2,4,8,16)")
    p.add_argument("--shapes", help="prefill: indices into the standard shapes " + str(inputs.KERNEL_SHAPES)
                   + " (default: all)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds")
    p.add_argument("--threads", type=int, help="torch's CPU threads (default: its own choice)")
    p.add_argument("--no-graphs", action="store_true", help="skip the hand-captured CUDA graph timings")
    fla_warm.add_autotune_arguments(p)
    p.add_argument("--fla-budget", type=float, default=150.0,
                   help="seconds FLA may autotune per prefill shape and op (in a child process)")
    p.add_argument("--budget", type=float, default=360.0,
                   help="seconds for the whole run: cases not begun by then are left out with a note, and FLA's "
                        "warm-up gets at most what is left less 60 s (a case begun may take a minute or two more)")


def section_cases(section: str, args, device: str) -> list:
    cols = tuple(args.impls.split(","))
    gates = args.gates.split(",")
    if section == "cpu":
        chosen = QUICK["cpu"] if args.quick else CPU_CASES
        return [cases.Case("cpu", form, "vector", shape, "cpu", torch.float32,
                           tuple(c for c in cols if not (form == "loop" and c == "inductor")))
                for form, shape in chosen]
    if section == "decode":
        batches = [int(b) for b in args.batches.split(",")] if args.batches else DECODE_BATCHES
        shapes = QUICK["decode"] if args.quick else [(b, 1, DECODE_HEADS, HEAD_DIM, HEAD_DIM) for b in batches]
    elif section == "short":
        steps = [int(t) for t in args.steps.split(",")] if args.steps else SHORT_STEPS
        shapes = QUICK["short"] if args.quick else [(SHORT_BATCH, t, DECODE_HEADS, HEAD_DIM, HEAD_DIM) for t in steps]
    else:
        idx = range(len(inputs.KERNEL_SHAPES)) if not args.shapes else map(int, args.shapes.split(","))
        shapes = QUICK["prefill"] if args.quick else [inputs.KERNEL_SHAPES[i] for i in idx]
    return [cases.Case(section, section, gate, shape, device, torch.bfloat16, cols)
            for shape in shapes for gate in gates]


def warm_fla(case, fla, budget_s: float, args, notes: list) -> bool:
    """FLA's prefill op autotuned in a child within the budget (its results saved at once where
    --autotune-to asks: a command stopped later keeps them); False (and a note) if not."""
    if fla is None or case.form != "prefill" or "fla" not in case.columns:
        return True
    op = "chunk_gla" if case.gate == "vector" else "chunk_simple_gla"
    ok, took, why = fla_warm.warm(op, case.shape, budget_s)
    if not ok:
        notes.append(why)
    fla_warm.autotune_after(args)
    return ok


def run_section(section: str, args, fla, notes: list, start: float) -> list:
    """The section's cases, each begun only while the run's --budget (from ``start``) lasts."""
    device = "cpu" if section == "cpu" else "cuda"
    rows = []
    todo = section_cases(section, args, device)
    for i, case in enumerate(todo):
        spent = time.perf_counter() - start
        if spent > args.budget:
            notes.append(f"{section}: the run's budget of {args.budget:.0f} s was spent after {i} of {len(todo)} "
                         "cases; left out: " + "; ".join(c.label() for c in todo[i:]))
            break
        print(f"[never-slower] {section} {i + 1}/{len(todo)} {case.label()} ({spent:.0f} s into the run)",
              file=sys.stderr, flush=True)
        # FLA's warm-up gets what the run has left, less a minute for the case's own work
        if not warm_fla(case, fla, max(10.0, min(args.fla_budget, args.budget - spent - 60)), args, notes):
            case.columns = tuple(c for c in case.columns if c != "fla")
        try:
            row = cases.run_case(case, fla, 2 if args.quick else args.rounds, graphs=not args.no_graphs)
        except Exception as e:  # noqa: BLE001 - a case that fails as a whole (out of memory) is a row too
            row = {"section": section, "gate": case.gate, "B": case.shape[0], "T": case.shape[1], "H": case.shape[2],
                   "K": case.shape[3], "V": case.shape[4], "cols": {}, "error": harness.error_text(e)}
            harness.free_memory()
        add_ratios(row, case)
        harness.log({k: v for k, v in row.items() if k != "cols"})
        rows.append(row)
    return rows


# ---------------------------------------------------------------------------------------------
# ratios
# ---------------------------------------------------------------------------------------------


def _best(cols: dict, names: tuple, keys: tuple) -> tuple:
    """(ms, label) of the fastest of the columns ``names`` over the timing ``keys``: "ms" (events or
    CPU clock), "graph_ms" (hand-captured graph), "ms_ro" (events of a reduce-overhead column, whose
    replays are graphs themselves); (None, None) where none was timed."""
    found = []
    for n in names:
        c = cols.get(n, {})
        for k in keys:
            if k == "ms_ro" and n.endswith("_ro") and c.get("ms") is not None:
                found.append((c["ms"], n))
            elif k != "ms_ro" and not n.endswith("_ro") and c.get(k) is not None:
                found.append((c[k], n if k == "ms" else f"{n} graph"))
    return min(found) if found else (None, None)


def add_ratios(row: dict, case) -> None:
    """ours / best other and forced / best other, without and with CUDA graphs; % of the byte floor."""
    cols = row["cols"]
    others = ("eager", "inductor", "fla")
    best, row["best_other"] = _best(cols, others, ("ms",))
    g_best, row["best_other_graph"] = _best(cols, others + ("inductor_ro",), ("graph_ms", "ms_ro"))
    for mine in ("ours", "forced"):
        ms, _ = _best(cols, (mine,), ("ms",))
        g_ms, _ = _best(cols, (mine, f"{mine}_ro"), ("graph_ms", "ms_ro"))
        row[f"{mine}_x"] = ms / best if ms and best else None
        row[f"{mine}_graph_x"] = g_ms / g_best if g_ms and g_best else None
        row[f"{mine}_graph_ms"] = g_ms
    if case.device != "cpu" and row.get("ours_graph_ms") and BANDWIDTH[0]:
        row["ours_graph_floor_pct"] = 100 * harness.floor_ms(case.floor_bytes(), BANDWIDTH[0]) / row["ours_graph_ms"]
    ours = cols.get("ours", {})
    row["ours_rewrote"] = None if "rewrites" not in ours else ours["rewrites"] > 0


BANDWIDTH = [None]  # copy bandwidth of this run's GPU, measured once


# ---------------------------------------------------------------------------------------------
# the run and its report
# ---------------------------------------------------------------------------------------------


def run(args):
    sections = [s for s in args.section.split(",") if s]
    bad = [s for s in sections if s not in SECTIONS]
    if bad:
        raise SystemExit(f"--section: unknown {bad}; choose from {', '.join(SECTIONS)}")
    unknown = set(args.impls.split(",")) - set(cases.COLUMNS)
    if unknown:
        raise SystemExit(f"--impls: unknown {sorted(unknown)}; choose from {', '.join(cases.COLUMNS)}")
    notes = []
    gpu = [s for s in sections if s != "cpu"]
    if gpu and not torch.cuda.is_available():
        notes.append(f"no CUDA device: sections {', '.join(gpu)} left out")
        sections = [s for s in sections if s == "cpu"]
    if not sections:
        harness.require_cuda("never-slower")
    device = "cuda" if any(s != "cpu" for s in sections) else "cpu"
    if args.threads:  # before the stamp, which records the thread count
        torch.set_num_threads(args.threads)
    fla = None
    if device == "cuda":
        fla_warm.cache_dir()  # before the first compile: this process and FLA's warm-up children share it
        fla_warm.autotune_before(args, notes)
        fla, why = inputs.fla_ops()
        if fla is None:
            notes.append(why)
        BANDWIDTH[0] = harness.copy_bandwidth(1 << 30)
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    name = "never-slower" if sections == list(SECTIONS) else "never-slower-" + "-".join(sections)
    if args.shapes and "prefill" in sections:  # runs split over shapes get files of their own
        name += "-shapes" + args.shapes.replace(",", "")
    result = report.new_result(name, "Never slower: ours against eager, default Inductor and FLA", device,
                               sections=",".join(sections), copy_bandwidth_tbs=BANDWIDTH[0] and
                               round(BANDWIDTH[0] / 1e12, 3), triton_cache=os.environ.get("TRITON_CACHE_DIR"), fla=inputs.fla_version())
    rows, start = [], time.perf_counter()
    for section in sections:
        rows += run_section(section, args, fla, notes, start)
    if device == "cuda":
        fla_warm.autotune_after(args)
    result.rows = rows
    result.notes += notes + [
        "ratio = ours / best other (below 1.0: ours faster); 'graphs': the best of hand-captured CUDA graph "
        "replays and mode='reduce-overhead' on each side",
        "ours: the backend with its cost rule on (it may leave a step to Inductor: 'rewrote' says whether it "
        "did); forced: the cost rule off",
        "FLA's step ops return a fresh final state (no copy back into the cache)"]
    result.sections += markdown(rows)
    result.plot = lambda path: plot(path, rows)
    return result


def _label(r: dict) -> str:
    return f"{r['section']} {r['gate'][0]} B{r['B']} T{r['T']} H{r['H']} {r['K']}x{r['V']}"


def markdown(rows: list) -> list:
    x = lambda key: (lambda r: report.ratio(r.get(key), 1.0))  # noqa: E731
    ratios = report.table(rows, [
        ("case", _label, ""), ("rewrote", "ours_rewrote", ""), ("ours / best", x("ours_x"), ""),
        ("best other", "best_other", ""), ("ours / best, graphs", x("ours_graph_x"), ""),
        ("best other, graphs", "best_other_graph", ""), ("forced / best", x("forced_x"), ""),
        ("forced / best, graphs", x("forced_graph_x"), ""), ("ours graph % of floor", "ours_graph_floor_pct", ".0f"),
        ("error", lambda r: (r.get("error") or "")[:80] or None, "")])
    names = list(dict.fromkeys(n for r in rows for n in r["cols"]))
    cell = lambda n: (lambda r: _cell(r["cols"].get(n)))  # noqa: E731
    times = report.table(rows, [("case", _label, "")] + [(n, cell(n), "") for n in names])
    problems = [f"- {_label(r)} {n}: {c.get('error') or c.get('graph_error') or ''}"
                f"{' cudagraph skips: %d' % c['cudagraph_skips'] if c.get('cudagraph_skips') else ''}"
                for r in rows for n, c in r["cols"].items()
                if c.get("error") or c.get("graph_error") or c.get("cudagraph_skips")]
    errs = [(r, n, c) for r in rows for n, c in r["cols"].items() if (c.get("rel_err") or 0) > 2e-2]
    out = ["Ratios\n\n" + ratios,
           "ms per call: events (or CPU clock) / hand-captured CUDA graph; [rel. err of o vs float64]\n\n" + times]
    if problems:
        out.append("Errors and cudagraph skips\n\n" + "\n".join(problems))
    if errs:
        out.append("Relative errors above 2e-2 (eager and Inductor overflow e^-G in the factored vector form at long "
                   "T)\n\n" + "\n".join(f"- {_label(r)} {n}: {c['rel_err']:.1e}" for r, n, c in errs))
    return out


def _cell(c) -> str:
    if not c:
        return "—"
    if "ms" not in c:
        return "error"
    text = f"{c['ms']:.4f}"
    if c.get("graph_ms") is not None:
        text += f" / {c['graph_ms']:.4f}"
    if c.get("rel_err") is not None:
        text += f" [{c['rel_err']:.0e}]"
    return text


def plot(path: str, rows: list) -> bool:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r.get("ours_x") or r.get("ours_graph_x")]
    if not rows:
        return False
    fig, ax = plt.subplots(figsize=(max(8, 0.45 * len(rows)), 5))
    xs = range(len(rows))
    for off, key, label in ((-0.2, "ours_x", "no graphs"), (0.2, "ours_graph_x", "graphs")):
        ax.bar([i + off for i in xs], [r.get(key) or 0 for r in rows], 0.4, label=label)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_yscale("log")
    ax.set_ylabel("ours / best other (below 1: ours faster)")
    ax.set_xticks(list(xs))
    ax.set_xticklabels([_label(r) for r in rows], rotation=60, ha="right", fontsize=7)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
