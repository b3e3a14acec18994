"""The models benchmark's meta data, per-phase summary and markdown."""

from __future__ import annotations

import importlib.util
import inspect

from benchmarks.report import fmt, table

FAST_PATHS = ("mamba_ssm", "causal_conv1d", "kernels")  # what transformers' Mamba2 would run instead
TARGET = 5.0  # ours against default Inductor, mixer phases


class Recorder(list):
    """What the backend did with each graph (a backend listener): matches, near misses, seconds."""

    def __call__(self, gm, result):
        self.append({"matches": [f"{m.form}/{m.gate}/{m.layout} {m.shapes}" for m in result.matches],
                     "near_misses": [f"{n.form}: {n.reason}"[:200] for n in result.near_misses],
                     "rewrite_s": round(result.seconds, 2)})


def meta(dtype) -> dict:
    import transformers
    from transformers.models.mamba2 import modeling_mamba2

    scan = getattr(modeling_mamba2, "mamba2_chunk_scan", modeling_mamba2.Mamba2Mixer)
    spelling = "einsum" if 'einsum("bclhn,bcshn->bclsh"' in inspect.getsource(scan) else "broadcast-multiply-sum"
    return {"transformers": transformers.__version__, "scan_spelling": spelling, "dtype": str(dtype).split(".")[-1],
            "fast_paths_present": [m for m in FAST_PATHS if importlib.util.find_spec(m) is not None]}


def summary(rows: list, expected_rewrites: int) -> dict:
    """Rewrites found against expected, and ours' speed-ups over the other variants."""
    by = {r["variant"]: r for r in rows if "ms" in r}
    out = {"expected_rewrites": expected_rewrites}
    tried = [r for r in rows if r["variant"] == "ours" and "rewrites" in r]  # a timed-out compile counts too
    if tried:
        out["rewrites"] = tried[-1]["rewrites"]
        out["rewrites_ok"] = tried[-1]["rewrites"] == expected_rewrites
    ours = by.get("ours")
    for other in ("inductor", "eager"):
        if ours and other in by:
            out[f"ours_vs_{other}"] = by[other]["ms"] / ours["ms"]
            if by[other].get("graph_ms") and ours.get("graph_ms"):
                out[f"ours_vs_{other}_graph"] = by[other]["graph_ms"] / ours["graph_ms"]
    return out


def _ms_cell(r) -> str:
    if r is None:
        return "—"
    if "error" in r:
        return "error"
    s = fmt(r.get("ms"))
    if r.get("graph_ms"):
        s += f" (graph {fmt(r['graph_ms'])})"
    if r.get("batch_slices", 1) > 1:
        s += f" ({r['batch_slices']} slices)"
    return s


def summary_table(phases: dict, rows: list) -> str:
    out = []
    for name, p in phases.items():
        by = {r["variant"]: r for r in rows if r["phase"] == name}
        ours = by.get("ours", {})
        shape = ", ".join(f"{k}={v}" for k, v in (p.get("shape") or {}).items()
                          if k in ("B", "T", "heads", "head_dim", "state", "groups", "layers", "hidden"))
        vs_ind = fmt(p.get("ours_vs_inductor"), ".2f") + ("×" if p.get("ours_vs_inductor") else "")
        if name.startswith("mixer") and p.get("ours_vs_inductor"):
            vs_ind += " ✓" if p["ours_vs_inductor"] >= TARGET else f" (target {TARGET:.0f}×)"
        vs_eager = fmt(p.get("ours_vs_eager"), ".2f") + ("×" if p.get("ours_vs_eager") else "")
        if p.get("ours_vs_eager_graph"):
            vs_eager += f" (graph {p['ours_vs_eager_graph']:.2f}×)"
        rw = "—" if p.get("rewrites") is None else f"{p['rewrites']}/{p['expected_rewrites']}" + \
            ("" if p.get("rewrites_ok") else " ✗")
        out.append({"phase": name, "shape": shape, "eager": _ms_cell(by.get("eager")),
                    "inductor": _ms_cell(by.get("inductor")), "ours": _ms_cell(by.get("ours")), "vs_ind": vs_ind,
                    "vs_eager": vs_eager, "compile": f"{fmt(by.get('inductor', {}).get('compile_s'), '.0f')} / "
                                                     f"{fmt(ours.get('compile_s'), '.0f')}",
                    "rw": rw, "err": f"{fmt(ours.get('max_abs_err'), '.1e')} / {fmt(ours.get('max_rel_err'), '.1e')}",
                    "status": p["status"]})
    return table(out, [("phase", "phase", ""), ("shape", "shape", ""), ("eager ms", "eager", ""),
                       ("inductor ms", "inductor", ""), ("ours ms", "ours", ""), ("ours vs inductor", "vs_ind", ""),
                       ("ours vs eager", "vs_eager", ""), ("compile s (ind. / ours)", "compile", ""),
                       ("rewrites", "rw", ""), ("ours err vs ref (max abs / max rel)", "err", ""),
                       ("status", "status", "")])


def _note(r: dict) -> str:
    note = []
    if r.get("batch_slices", 1) > 1:
        note.append(f"eager in {r['batch_slices']} batch slices (OOM at full batch)")
    for key, what in (("recompiles_while_timed", "recompiles while timed"), ("rewrite_failures", "rewrite failures"),
                      ("nonfinite", "non-finite outputs")):
        if r.get(key):
            note.append(f"{r[key]} {what}")
    if r.get("note"):
        note.append(r["note"])
    if r["variant"] == "scan op alone":
        note.append(f"chunk_gla {r['shape']} fp32, min bytes {r['min_bytes_mb']:.0f} MB")
    if "error" in r:
        note.append("error: " + r["error"][:160])
    return "; ".join(note)


def sections(meta: dict, rows: list) -> list:
    out = []
    if meta.get("fast_paths_present"):
        out.append(f"**Warning**: {meta['fast_paths_present']} importable: transformers may not take its torch path.")
    out += [summary_table(meta["phases"], rows), "## Variants", table(rows, [
        ("phase", "phase", ""), ("variant", "variant", ""), ("ms", "ms", ".3f"),
        ("p20–p80", lambda r: f"{fmt(r.get('ms_p20'))}–{fmt(r.get('ms_p80'))}" if "ms" in r else None, ""),
        ("graph ms", "graph_ms", ".3f"), ("compile s", "compile_s", ".1f"), ("rewrites", "rewrites", "d"),
        ("graphs", "graphs", "d"), ("breaks", "graph_breaks", "d"), ("peak MiB", "peak_mib", ".0f"),
        ("max abs err", "max_abs_err", ".2e"), ("max rel err", "max_rel_err", ".2e"),
        ("norm rel err", "norm_rel_err", ".2e"), ("state rel err", "state_max_rel_err", ".2e"),
        ("note", lambda r: _note(r) or None, "")])]
    lines = [f"- **{name}**: {p['status']} in {p.get('seconds', 0):.0f} s; shape {p.get('shape')}; reference: "
             f"{p.get('reference', '—')}" + (f"; {p['reason']}" if p.get("reason") else "")
             for name, p in meta["phases"].items()]
    out += ["## Phases", "\n".join(lines)]
    logs = [f"- {r['phase']}: {len(g['matches'])} rewrite(s) in {g['rewrite_s']} s {g['matches'][:2]}; left alone: "
            f"{g['near_misses'][:3]}" for r in rows if r.get("rewrite_log") for g in r["rewrite_log"]]
    if logs:
        out += ["## What the backend did (ours)", "\n".join(logs)]
    return out
