"""Turn `gpu_gla.py` JSON results into a markdown table (and a PNG plot if matplotlib is there).

    python benchmarks/report.py results.json [more.json ...] --out benchmarks/results/h100
"""

import argparse
import json


def load(paths):
    meta, rows = None, []
    for p in paths:
        with open(p) as f:
            data = json.load(f)
        meta = meta or data["meta"]
        rows += data["rows"]
    return meta, rows


def table(meta, rows) -> str:
    by = {(r["impl"], tuple(r["shape"])): r for r in rows if "error" not in r}
    shapes = list(dict.fromkeys(tuple(r["shape"]) for r in rows))
    pairs = [("ours_vector", "fla_chunk_gla"), ("ours_scalar", "fla_chunk_simple_gla")]
    out = [
        f"GPU {meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}, {meta['date']}, commit "
        f"{meta['commit']}; copy bandwidth {meta['copy_bandwidth_tbs']:.2f} TB/s; bf16, median of "
        "`triton.testing.do_bench`.",
        "",
        "| B, T, H, K, V | gate | ours fwd ms | FLA fwd ms | fwd speed-up | ours fwd+bwd ms | FLA fwd+bwd ms "
        "| fwd+bwd speed-up | ours % of byte floor (fwd) | ours / FLA extra MiB (fwd+bwd) | ours first call s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in shapes:
        for ours, fla in pairs:
            a, b = by.get((ours, s)), by.get((fla, s))
            if a is None:
                err = next((r["error"] for r in rows if r["impl"] == ours and tuple(r["shape"]) == s and "error" in r), "")
                if err:
                    out.append(f"| {s} | {ours.split('_')[1]} | error: {err[:60]} |||||||||")
                continue
            fwd_b = f"{b['fwd_ms']:.3f}" if b else "–"
            su = f"{b['fwd_ms'] / a['fwd_ms']:.2f}x" if b else "–"
            b_bwd = b and "fwdbwd_ms" in b  # FLA's backward may refuse (see gpu_gla.run_shape)
            fb_b = f"{b['fwdbwd_ms']:.3f}" if b_bwd else "–"
            su2 = f"{b['fwdbwd_ms'] / a['fwdbwd_ms']:.2f}x" if b_bwd else "–"
            mem = f"{a['peak_extra_mib']:.0f} / {b['peak_extra_mib']:.0f}" if b_bwd else f"{a['peak_extra_mib']:.0f} / –"
            out.append(
                f"| {', '.join(map(str, s))} | {ours.split('_')[1]} | {a['fwd_ms']:.3f} | {fwd_b} | {su} | "
                f"{a['fwdbwd_ms']:.3f} | {fb_b} | {su2} | {100 * a['floor_ms'] / a['fwd_ms']:.0f}% | {mem} | "
                f"{a['first_call_s']:.1f} |"
            )
    naive = [r for r in rows if r["impl"].startswith("naive") and "error" not in r]
    if naive:
        out += ["", "Naive parallel scalar-gate form (fp32 math) for reference:", "",
                "| B, T, H, K, V | impl | fwd ms | fwd+bwd ms |", "|---|---|---|---|"]
        for r in naive:
            out.append(f"| {', '.join(map(str, r['shape']))} | {r['impl']} | {r['fwd_ms']:.3f} | {r['fwdbwd_ms']:.3f} |")
    return "\n".join(out)


def plot(rows, path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    ok = [r for r in rows if "error" not in r]
    shapes = list(dict.fromkeys(tuple(r["shape"]) for r in ok))
    impls = list(dict.fromkeys(r["impl"] for r in ok))
    fig, axes = plt.subplots(1, 2, figsize=(14, 5))
    for ax, key in zip(axes, ("fwd_ms", "fwdbwd_ms")):
        width = 0.8 / len(impls)
        for i, impl in enumerate(impls):
            vals = [next((r.get(key, 0) for r in ok if r["impl"] == impl and tuple(r["shape"]) == s), 0) for s in shapes]
            ax.bar([x + i * width for x in range(len(shapes))], vals, width, label=impl)
        ax.set_xticks([x + 0.4 for x in range(len(shapes))])
        ax.set_xticklabels([",".join(map(str, s)) for s in shapes], rotation=30, fontsize=7)
        ax.set_ylabel(key.replace("_ms", " ms"))
        ax.set_yscale("log")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("inputs", nargs="+")
    parser.add_argument("--out", required=True, help="path prefix: writes PREFIX.md and PREFIX.png")
    args = parser.parse_args()
    meta, rows = load(args.inputs)
    text = table(meta, rows)
    with open(args.out + ".md", "w") as f:
        f.write(f"# GLA kernels vs FLA 0.6\n\n{text}\n")
    print(text)
    if plot(rows, args.out + ".png"):
        print("plot:", args.out + ".png")


if __name__ == "__main__":
    main()
