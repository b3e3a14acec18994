"""GPU check of non-finite values through the default forward (bf16, --gate vector or scalar): a NaN and an
infinity in v, each in one (batch, head), against the fp32 time loop on those heads. o and the
final state must be non-finite exactly where the loop's are (NaN exactly where its are, for the
NaN), and close elsewhere; a clean head must stay finite. Each shape is run three times (a race
would show as runs that differ).

    PYTHONPATH=$PWD python benchmarks/gpu_nonfinite_check.py [--shapes 8,256,16,256,256;8,256,16,128,128]

At K = 256 the default carry tiles are 128 values with 8 warps, where an earlier in-loop check raced.
"""

import argparse

import torch


def check(got: torch.Tensor, want: torch.Tensor, nan_only: bool) -> str:
    bad_got, bad_want = ~torch.isfinite(got), ~torch.isfinite(want)
    if not bad_want.any():
        return "loop finite?"
    if not torch.equal(bad_got, bad_want):
        return f"non-finite at {int((bad_got != bad_want).sum())} other places"
    if nan_only and not torch.equal(got.isnan(), want.isnan()):
        return "NaN elsewhere"
    ok = ~bad_want
    err = ((got[ok].float() - want[ok]).norm() / want[ok].norm()).item()
    return f"ok {err:.1e}" if err < 2e-2 else f"error {err:.1e}"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="8,256,16,256,256;8,256,16,128,128;2,2048,2,128,128;8,256,8,64,64")
    p.add_argument("--gate", default="vector", choices=["vector", "scalar"])
    args = p.parse_args()
    from gpu_schedule import sweep_inputs

    from gla_inductor.reference import naive_recurrent_gla
    from gla_inductor.triton_chunk import chunk_fwd_triton, default_config

    print("| B, T, H, K, V | carry BV:warps, segments | run | NaN head o | NaN head ht | inf head o | inf head ht "
          "| clean head |")
    print("|---|---|---|---|---|---|---|---|")
    for shape in args.shapes.split(";"):
        B, T, H, K, V = map(int, shape.split(","))
        q, k, v, g = sweep_inputs(B, T, H, K, V, args.gate)
        cfg = default_config(B, T, H, K, V, q.dtype, args.gate == "vector", q.device)
        poison = {(0, 1): (T * 2 // 5, 7, float("nan")), (B - 1, 0): (T * 3 // 4, V - 3, float("inf"))}
        for (b, h), (t, c, value) in poison.items():
            v[b, t, h, c] = value
        for run in range(3):
            o, ht = chunk_fwd_triton(q, k, v, g, None, None, K ** -0.5, True, False)
            cells = []
            for (b, h), (t, c, value) in poison.items():
                sl = [x[b:b + 1, :, h:h + 1].float() for x in (q, k, v, g)]
                o_ref, ht_ref = naive_recurrent_gla(*sl, scale=K ** -0.5, output_final_state=True)
                nan_only = value != value
                cells += [check(o[b:b + 1, :, h:h + 1], o_ref, nan_only), check(ht[b:b + 1, h:h + 1], ht_ref, nan_only)]
            clean = torch.isfinite(o[0, :, 0]).all().item() and torch.isfinite(ht[0, 0]).all().item()
            cells.append("finite" if clean else "NOT FINITE")
            tiles = f"{cfg.carry.block_v}:{cfg.carry.num_warps}, {cfg.segments}" if cfg.local else "fused scan"
            print(f"| {shape} | {tiles} | {run} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
