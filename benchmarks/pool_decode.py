"""Decoding into a serving engine's state pool (CUDA; --device cpu runs tiny shapes on CPU).

A pool [P, H, K, V] of recurrent states, P = 1024, H = 32, K = V = 128, and B sequences decoding one
step (or T short steps) each: sequence b reads and writes slot idx[b] in place, idx distinct random
slots (a fraction --pad of them -1: padded entries). bf16 q, k, v and vector gate (logsigmoid / 16,
as FLA's GLA layer), fp32 pool unless named otherwise. Rows:

  ours_pool_kv      fused_recurrent_gla(..., initial_state=pool, ssm_state_indices=idx, inplace_final_state=True)
  ours_pool_vk      the same on a V-first pool [P, H, V, K] (vLLM's and SGLang's layout), state_v_first=True
  ours_pool_kv_bf16 a bf16 pool (ours_pool_vk_bf16: V-first)
  ours_batch        the fused_recurrent op on a contiguous [B, H, K, V] state: the same work without a pool
  fla_pool          FLA's fused_recurrent_gla with ssm_state_indices, where its signature has them
  fla_gather        otherwise FLA the way a caller must use it: gather the slots, call with
                    output_final_state, scatter the final states back (index_copy_)

Each row is checked first against a float64 step on the touched slots (relative error of o and of
the updated slots) and for untouched slots left bit-equal; then timed by the shared harness: CUDA
events (host time included) and CUDA-graph replays (GPU time alone). The floor is a device-to-device
copy of the state bytes the call must move (B * H * K * V * bytes per element, read once and written
once), timed in a CUDA graph in the same process: ``pct_floor`` = floor time / graph time. Target:
>= 90 % at B >= 64.

--tiles "BV/warps/stages/B[e],...": also each pool (and the batch state) through the kernel's launcher
with those tiles (``RecurrentConfig``; B: 0 whole tiles, N key blocks (K-first states only), vN value
blocks (V-first only); e: the early store), rows named "<impl> <tiles>": the sweep behind
``default_recurrent_config``.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F

from benchmarks import harness, inputs, report

P, H, K, V = 1024, 32, 128, 128
CPU_SHAPE = (16, 2, 32, 32)  # P, H, K, V of the CPU run


def add_arguments(p) -> None:
    p.add_argument("--batches", default="16,64,256", help="sequences decoding per call (B)")
    p.add_argument("--steps", default="1", help="tokens per sequence per call (T)")
    p.add_argument("--pad", default=0.0, type=float, help="fraction of padded entries (index -1)")
    p.add_argument("--impls", default="ours,fla")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--tiles", default="", help="also these kernel tiles: 'BV/warps/stages/B[e],...' (see above)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                   help="cpu: P, H, K, V = %s, B in 4, 8, CPU clock (checks the benchmark)" % (CPU_SHAPE,))


def copy_ms(nbytes: int, device: str, rounds: int) -> float:
    """ms of a copy of nbytes (read once, written once): in a CUDA graph on CUDA."""
    x = torch.empty(nbytes, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    clock = "cpu" if device == "cpu" else "graph"
    return harness.time_one(lambda: y.copy_(x), clock=clock, rounds=rounds).median


# ----------------------------------------------------------------------------------------------
# inputs and the float64 check
# ----------------------------------------------------------------------------------------------


def make_inputs(B, T, shape, device, pad: float, seed=0):
    P_, H_, K_, V_ = shape
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*s, dtype=torch.bfloat16):
        return torch.randn(*s, generator=gen, device=device).to(dtype)

    q, k, v = randn(B, T, H_, K_), randn(B, T, H_, K_), randn(B, T, H_, V_)
    g = (F.logsigmoid(randn(B, T, H_, K_, dtype=torch.float32)) / 16).to(torch.bfloat16)
    idx = torch.randperm(P_, generator=gen, device=device)[:B].to(torch.int32)
    n_pad = int(round(pad * B))
    if n_pad:
        idx[torch.randperm(B, generator=gen, device=device)[:n_pad]] = -1
    return q, k, v, g, idx


def reference(q, k, v, g, h0, scale):
    """(o, final states) of a float64 time loop from h0 [B, H, K, V]."""
    S = h0.double()
    o = []
    for t in range(q.shape[1]):
        S = S * g[:, t].double().exp()[..., None] + k[:, t].double()[..., None] * v[:, t].double()[..., None, :]
        o.append((q[:, t].double()[..., None] * S).sum(-2) * scale)
    return torch.stack(o, 1), S


def check(impl, q, k, v, g, idx, scale) -> dict:
    """Run impl once on a copy of its pool: errors of o and of the touched slots against float64,
    and whether untouched slots and padded outputs are exact."""
    pool_kv = impl.kv(impl.pool)
    before = pool_kv.clone()
    valid = idx >= 0
    slots = idx[valid].long()
    h0 = torch.zeros(q.shape[0], *before.shape[1:], dtype=torch.float64, device=q.device)
    h0[valid] = before[slots].double()
    ref_o, ref_s = reference(q, k, v, g, h0, scale)
    o = impl.fn(q, k, v, g, idx, scale)
    touched = torch.zeros(before.shape[0], dtype=torch.bool, device=q.device)
    touched[slots] = True
    out = {
        "err_o": harness.rel_err(o[valid], ref_o[valid]) if valid.any() else 0.0,
        "err_state": harness.rel_err(pool_kv[slots], ref_s[valid]) if valid.any() else 0.0,
        "untouched_exact": bool(torch.equal(pool_kv[~touched], before[~touched])),
        "padded_zero": bool((o[~valid] == 0).all()),
    }
    pool_kv.copy_(before)
    return out


# ----------------------------------------------------------------------------------------------
# implementations: .fn(q, k, v, g, idx, scale) -> o, updating .pool in place
# ----------------------------------------------------------------------------------------------


class Impl:
    def __init__(self, name, pool, fn, v_first=False, state_bytes_per_elem=4, pooled=True):
        self.name, self.pool, self.fn, self.v_first = name, pool, fn, v_first
        self.elem = state_bytes_per_elem
        self.pooled = pooled

    def kv(self, x):
        return x.transpose(-1, -2) if self.v_first else x


def ours(shape, B, device):
    import gla_inductor

    P_, H_, K_, V_ = shape
    impls = []
    for name, dtype, v_first in (("ours_pool_kv", torch.float32, False), ("ours_pool_vk", torch.float32, True),
                                 ("ours_pool_kv_bf16", torch.bfloat16, False),
                                 ("ours_pool_vk_bf16", torch.bfloat16, True)):
        pool = torch.randn(P_, H_, V_, K_, device=device) if v_first else torch.randn(P_, H_, K_, V_, device=device)
        pool = pool.to(dtype)

        def fn(q, k, v, g, idx, scale, pool=pool, v_first=v_first):
            return gla_inductor.fused_recurrent_gla(q, k, v, g, scale=scale, initial_state=pool,
                                                    ssm_state_indices=idx, inplace_final_state=True,
                                                    state_v_first=v_first)[0]

        impls.append(Impl(name, pool, fn, v_first, torch.finfo(dtype).bits // 8))
    state = torch.randn(B, H_, K_, V_, device=device)

    def batch(q, k, v, g, idx, scale):
        return torch.ops.gla_inductor.fused_recurrent(q, k, v, g, None, state, scale, False)

    impls.append(Impl("ours_batch", state, batch, pooled=False))
    return impls


def parse_tiles(text: str) -> list:
    """'BV/warps/stages/B[e],...' -> [(text, RecurrentConfig)]; B: key_block, or value_block as 'vN'."""
    from benchmarks.internals import RecurrentConfig

    out = []
    for spec in filter(None, (x.strip() for x in text.split(","))):
        early = spec.endswith("e")
        try:
            bv, warps, stages, blocks = spec.rstrip("e").split("/")
            by_value = blocks.startswith("v")
            bv, warps, stages, blocks = int(bv), int(warps), int(stages), int(blocks.lstrip("v"))
        except ValueError:
            raise ValueError(f"--tiles {spec!r}: expected BV/warps/stages/B[e], B a key block or vN") from None
        out.append((spec, RecurrentConfig(block_v=bv, num_warps=warps, num_stages=stages, early_state=early,
                                          key_block=0 if by_value else blocks,
                                          value_block=blocks if by_value else 0)))
    return out


def tiled(impls: list, tiles: list) -> list:
    """Each of ``impls`` (ours) through the kernel's launcher at each of ``tiles``."""
    from benchmarks.internals import recurrent_kernel

    out = []
    for impl in impls:
        for spec, cfg in tiles:
            if (cfg.key_block and impl.v_first) or (cfg.value_block and not impl.v_first):
                continue  # key blocks for states whose values are contiguous, value blocks for V-first
            def fn(q, k, v, g, idx, scale, state=impl.kv(impl.pool), cfg=cfg, pooled=impl.pooled):
                return recurrent_kernel(q, k, v, g, state_in=state, state_out=state, scale=scale, config=cfg,
                                        state_indices=idx if pooled else None)

            out.append(Impl(f"{impl.name} {spec}", impl.pool, fn, impl.v_first, impl.elem, impl.pooled))
    return out


def fla(shape, device):
    try:
        from fla.ops.gla import fused_recurrent_gla
    except Exception:  # noqa: BLE001 - FLA is optional: run() notes its absence
        return []
    P_, H_, K_, V_ = shape
    pool = torch.randn(P_, H_, K_, V_, device=device)
    # fused_recurrent_gla takes **kwargs and ignores unknown ones: only a named parameter counts
    if "ssm_state_indices" in inspect.signature(fused_recurrent_gla).parameters:
        def fn(q, k, v, g, idx, scale):
            return fused_recurrent_gla(q, k, v, gk=g, scale=scale, initial_state=pool, ssm_state_indices=idx,
                                       inplace_final_state=True)[0]

        return [Impl("fla_pool", pool, fn)]

    def gather(q, k, v, g, idx, scale):
        slots = idx.long()
        o, ht = fused_recurrent_gla(q, k, v, gk=g, scale=scale, initial_state=pool.index_select(0, slots),
                                    output_final_state=True)
        pool.index_copy_(0, slots, ht)
        return o

    return [Impl("fla_gather", pool, gather)]


# ----------------------------------------------------------------------------------------------
# the run
# ----------------------------------------------------------------------------------------------


def measure_impl(impl, q, k, v, g, idx, scale, device: str, rounds: int) -> dict:
    if impl.pooled:
        row = check(impl, q, k, v, g, idx, scale)
    else:
        ref_o, ref_s = reference(q, k, v, g, impl.pool, scale)
        start = impl.pool.clone()
        row = {"err_o": harness.rel_err(impl.fn(q, k, v, g, idx, scale), ref_o),
               "err_state": harness.rel_err(impl.pool, ref_s)}
        impl.pool.copy_(start)

    def call():
        with torch.no_grad():
            impl.fn(q, k, v, g, idx, scale)

    clock = "cpu" if device == "cpu" else "events"
    row.update(harness.time_one(call, clock=clock, rounds=rounds).fields())
    if device != "cpu":
        errors = {}
        t = harness.measure({"fn": call}, clock="graph", rounds=rounds, errors=errors)["fn"]
        row.update(t.fields("graph_") if t is not None else {"graph_error": errors.get("fn")})
    return row


def run(args):
    device = args.device
    if device == "cuda":
        harness.require_cuda("pool-decode")
    shape = CPU_SHAPE if device == "cpu" else (P, H, K, V)
    batches = [4, 8] if device == "cpu" else [int(b) for b in args.batches.split(",")]
    steps = [int(t) for t in args.steps.split(",")]
    if args.quick:
        batches, steps = batches[:1], steps[:1]
    rounds = 2 if args.quick else args.rounds
    result = report.new_result("pool-decode", "Decoding into a state pool, in place", device, P=shape[0],
                               H=shape[1], K=shape[2], V=shape[3], pad=args.pad, fla=inputs.fla_version())
    if "fla" in args.impls and inputs.fla_ops()[0] is None:
        result.notes.append(inputs.fla_ops()[1])
    for T in steps:
        for B in batches:
            result.rows += run_batch(B, T, shape, device, args, rounds)
    result.notes.append("ms: CUDA events, host time included (CPU clock on CPU); graph: CUDA-graph replays; "
                        "% floor: a graph-timed copy of the touched state bytes over the graph time")
    result.sections.append(markdown(result.rows))
    return result


def run_batch(B: int, T: int, shape: tuple, device: str, args, rounds: int) -> list:
    q, k, v, g, idx = make_inputs(B, T, shape, device, args.pad)
    scale = shape[2] ** -0.5
    impls = ours(shape, B, device) if "ours" in args.impls else []
    impls += tiled(impls, parse_tiles(args.tiles))
    if "fla" in args.impls and not args.pad:  # FLA's gather cannot skip padded entries
        impls += fla(shape, device)
    rows = []
    for impl in impls:
        state_bytes = B * shape[1] * shape[2] * shape[3] * impl.elem
        floor = copy_ms(state_bytes, device, rounds)
        row = {"impl": impl.name, "B": B, "T": T, "P": shape[0], "H": shape[1], "K": shape[2], "V": shape[3],
               "pad": args.pad, "state_mb": state_bytes / 1e6, "floor_ms": floor}
        try:
            row.update(measure_impl(impl, q, k, v, g, idx, scale, device, rounds))
            timed = row.get("graph_ms") or row["ms"]
            row["graph_gbs"] = 2 * state_bytes / (timed * 1e-3) / 1e9
            row["pct_floor"] = 100 * floor / timed
        except Exception as e:  # one failing impl must not hide the others
            row["error"] = harness.error_text(e)
        harness.log(row)
        rows.append(row)
    del impls
    harness.free_memory()
    return rows


def markdown(rows: list) -> str:
    return report.table(rows, [
        ("impl", "impl", ""), ("B", "B", "d"), ("T", "T", "d"), ("pad", "pad", ".2f"), ("state MB", "state_mb", ".1f"),
        ("graph ms", "graph_ms", ".4f"), ("ms", "ms", ".4f"), ("floor ms", "floor_ms", ".4f"),
        ("% floor", "pct_floor", ".1f"), ("err o", "err_o", ".1e"), ("err state", "err_state", ".1e"),
        ("untouched exact", "untouched_exact", ""), ("pads zero", "padded_zero", ""),
        ("error", lambda r: (r.get("error") or r.get("graph_error") or "")[:80] or None, "")])
