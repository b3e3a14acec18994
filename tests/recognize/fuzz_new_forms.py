"""Programs of the newer recognized spellings for the spelling fuzzer (tests/recognize/test_fuzz.py),
rendered from drawn choices like fuzz_programs.py's, with their look-alikes:

  normalized     parallel retention divided by a function of its scores' own row sums
                 (A = q k^T * M, M = gamma ** (i - j) on the triangle, each row optionally
                 divided by the root of its sum; (A / n(A.sum(-1))) @ v or (A @ v) / n(A.sum(-1)),
                 n a chain of detach / float / abs / clamp / sqrt). Near: n of |A|'s row sums, of
                 the row maxima. Equivalent: the mask's columns scaled (GLA of other keys; left
                 alone by the recognizer, a rewrite would not be wrong).
  decay-factor   decode steps S = S * a + k v^T / y with a factor a the graph computes: the sqrt
                 ratio of a running decay sum (torchscale's recurrent step), sigmoid(x), exp of a
                 buffer, a Python number; y none, per head or per key; K-first or V-first states;
                 and time loops decayed by sigmoid(x_t) or softplus(x_t) / (1 + |x_t|). Near:
                 factors that may be negative (a raw input, 1 - w, tanh), and in training the sqrt
                 ratio (sqrt(s_prev) may be 0 where log(a) needs a gradient).
  power-chunks   loop-free chunked retention (exclusive cumsum of chunk states) and chunk loops
                 whose decays are powers gamma ** n of a per-head gamma, an input or a buffer.
                 Near: a negative gamma buffer, no decay across chunks, an inclusive cumsum.
  buffer-mask    parallel retention over a [H, L, L] decay mask computed into a module buffer
                 and sliced to the length. Near: the mask strict, non-causal, of a negative gamma.

Module programs (buffers) define ``fn`` as an instance of ``Model``: the float64 reference runs
the same buffers (exact in float64) with float64 inputs.

Every family's GLA spellings must be rewritten (kind ``gla``); a recognizer gap found next is
marked kind ``gap`` (equal to eager only) with ``Program.gap`` saying why, until it is closed.
"""

from __future__ import annotations

from typing import Optional

import torch
from hypothesis import strategies as st

from fuzz_programs import Program, Src, dims

NEW_MUTATIONS = {
    "normalized": {"near": ["abs_sums", "row_max"], "equivalent": ["column_factor"]},
    "decay-factor": {"near": ["raw", "one_minus", "tanh"]},
    "power-chunks": {"near": ["negative_buffer", "no_cross_decay", "inclusive"]},
    "buffer-mask": {"near": ["strict", "noncausal", "negative_base"]},
}


def _kind(family: str, mutation: Optional[str]) -> str:
    return next((k for k, ms in NEW_MUTATIONS[family].items() if mutation in ms), "gla")


def _program(family: str, c: dict, d: dict, args: list, source: str, seed: int, train: bool,
             kind: Optional[str] = None) -> Program:
    kind = kind or _kind(family, c["mutation"])
    return Program(kind=kind, name=f"{family}/{c['mutation'] or c['variant']}", source=source, args=args,
                   dtype=torch.float32, seed=seed, gate_dist="decay", choices=c, dims=d,
                   expected={"gla": 1, "near": 0}.get(kind), train=train)


def _gammas(sign: str = "") -> str:
    """RetNet's per-head decays 1 - 2 ** (-base - h), [H]."""
    return f"{sign}(1 - 2.0 ** (-BASE - torch.arange(H, dtype=torch.float32)))"


# ---- normalized parallel retention ---------------------------------------------------------------
NORM_SUMS = ["keepdim", "dim_keepdim", "index"]
NORM_CLAMPS = ["clamp_min_kw", "clamp_min", "none"]


@st.composite
def normalized_program(draw, mutation: Optional[str] = None) -> Program:
    c = {
        "mutation": mutation,
        "layout": draw(st.sampled_from(["BHTD", "BTHD"])),
        "mask": draw(st.sampled_from(["inf_exp", "power", "nan_to_num"])),
        "rows": draw(st.sampled_from(["sqrt_sum", "sqrt_sum", "none"])),
        "scale": draw(st.sampled_from(["none", "scores", "q"])),
        "variant": draw(st.sampled_from(["before", "after"])),  # the division before or after @ v
        "detach": draw(st.booleans()),
        "cast": draw(st.booleans()),
        "sum": draw(st.sampled_from(NORM_SUMS)),
        "clamp": draw(st.sampled_from(NORM_CLAMPS)),
        "sqrt": draw(st.booleans()),
        "reverse": draw(st.booleans()),
        "base": draw(st.sampled_from([2, 3, 5])),
    }
    if c["layout"] == "BTHD" or c["mask"] == "nan_to_num":
        c["reverse"] = False  # the seq-first einsum spelling and torchscale's mask are causal
    d = draw(dims())
    args = [("q", _shape(c, d, d["K"]), "randn"), ("k", _shape(c, d, d["K"]), "randn"),
            ("v", _shape(c, d, d["V"]), "randn")]
    # (the former gap, K = 1, is rewritten now: its scores contract nothing but a size-1 axis)
    return _program("normalized", c, d, args, render_normalized(c), draw(st.integers(0, 2**16)),
                    draw(st.sampled_from([True, True, False])))


def _shape(c: dict, d: dict, last: int) -> tuple:
    return (d["B"], d["H"], d["T"], last) if c["layout"] == "BHTD" else (d["B"], d["T"], d["H"], last)


def render_normalized(c: dict) -> str:
    src = Src("q, k, v")
    bthd = c["layout"] == "BTHD"
    src("B, T, H, K = q.shape" if bthd else "B, H, T, K = q.shape")
    src(f"BASE = {c['base']}")
    src(f"log_gamma = torch.log({_gammas()})")
    src("i = torch.arange(T, dtype=torch.float32)")
    src("dist = (i[None, :] - i[:, None])" if c["reverse"] else "dist = (i[:, None] - i[None, :])")
    if c["mask"] == "inf_exp":
        src('M = torch.exp(dist.masked_fill(dist < 0, float("inf")) * log_gamma[:, None, None])')
    elif c["mask"] == "nan_to_num":
        src('dist = torch.masked_fill(dist, i[:, None] < i[None, :], float("inf"))')
        src("M = torch.nan_to_num(torch.exp(dist * log_gamma[:, None, None]))")
    else:
        src("M = (log_gamma.exp()[:, None, None] ** dist.clamp(min=0)).masked_fill(dist < 0, 0)")
    axis = -2 if c["mutation"] == "column_factor" else -1
    if c["rows"] == "sqrt_sum" or c["mutation"] == "column_factor":
        src(f"M = M / M.sum(dim={axis}, keepdim=True).sqrt()")
    if c["scale"] == "q":
        src("q = q * K ** -0.5")
    src('A = torch.einsum("bihd,bjhd->bhij", q, k) * M' if bthd else "A = (q @ k.transpose(-1, -2)) * M")
    if c["scale"] == "scores":
        src("A = A * K ** -0.5")
    src(f"n = {_normalizer(c)}")
    out = (lambda a: f'torch.einsum("bhij,bjhd->bihd", {a}, v)') if bthd else (lambda a: f"{a} @ v")
    if c["variant"] == "before":
        src(f"return {out('(A / n)')}")
    else:
        src(f"return {out('A')} / {'n.transpose(1, 2)' if bthd else 'n'}")
    return src.text()


def _normalizer(c: dict) -> str:
    """n(A's row sums) [B, H, T, 1]: the drawn chain (or a look-alike's statistic)."""
    x = "A" + (".detach()" if c["detach"] else "") + (".float()" if c["cast"] else "")
    m = c["mutation"]
    if m == "row_max":
        return f"{x}.amax(dim=-1, keepdim=True).clamp(min=1)"
    if m == "abs_sums":
        x += ".abs()"
    x += {"keepdim": ".sum(-1, keepdim=True)", "dim_keepdim": ".sum(dim=-1, keepdim=True)",
          "index": ".sum(-1)"}[c["sum"]]
    if m != "abs_sums":
        x += ".abs()"
    # the sums may come near 0 (and flip sign under rounding) without a clamp: a floor keeps
    # the reference well conditioned, so "none" still bounds them away from 0 by a shift
    x += {"clamp_min_kw": ".clamp(min=1)", "clamp_min": ".clamp_min(1.0)", "none": " + 1"}[c["clamp"]]
    x = f"({x})" if c["clamp"] == "none" else x
    if c["sqrt"]:
        x += ".sqrt()"
    return f"({x})[..., None]" if c["sum"] == "index" else x


# ---- decode steps and loops decayed by a computed factor -------------------------------------------
FACTORS = ["sqrt_ratio", "const_ratio", "sigmoid", "exp_buffer", "constant"]
DIVISORS = ["none", "head", "key", "const_head"]


@st.composite
def decay_factor_program(draw, mutation: Optional[str] = None) -> Program:
    loop = mutation is None and draw(st.sampled_from([False, False, True]))
    c = {
        "mutation": mutation,
        "loop": loop,
        "variant": draw(st.sampled_from(["sigmoid", "softplus"] if loop else FACTORS)),
        "divisor": draw(st.sampled_from(DIVISORS)),  # (the loops' divisor is from an input)
        "v_first": draw(st.booleans()),
        "read": draw(st.sampled_from(["sum", "einsum"])),
        "update": draw(st.sampled_from(["S * a + kv", "a * S + kv", "kv + S * a"])),
    }
    if mutation:
        c["variant"] = "computed"
    train = draw(st.sampled_from([True, True, False]))
    d = draw(dims(T=(2, 6) if loop else (1, 1)))
    if loop:
        return _loop_program(c, d, draw(st.integers(0, 2**16)), train)
    kind = None
    if c["variant"] in ("sqrt_ratio", "const_ratio") and train:
        kind = "near"  # sqrt(s_prev) may be 0 where the gradient of log(a) is needed
    args = [("q", (d["B"], d["H"], 1, d["K"]), "randn"), ("k", (d["B"], d["H"], 1, d["K"]), "randn"),
            ("v", (d["B"], d["H"], d["V"]), "randn"),
            ("prev", (d["B"], d["H"], d["V"], d["K"]) if c["v_first"] else (d["B"], d["H"], d["K"], d["V"]), "state")]
    if c["variant"] in ("sqrt_ratio", "const_ratio"):
        args.append(("prev_scale", (d["H"],), "positive"))
    if c["variant"] == "sqrt_ratio":
        args.append(("log_decay", (d["H"],), "gamma"))
    if c["variant"] == "sigmoid" or mutation:
        args.append(("x", (d["B"], d["H"]) if c["variant"] == "sigmoid" else (d["H"],), "randn"))
    if c["divisor"] == "head" and c["variant"] not in ("sqrt_ratio", "const_ratio"):
        args.append(("w", (d["H"],), "randn"))
    source = render_decode(c, d, [a[0] for a in args])
    # (the former gaps, a divisor built from constants and K or V of 1, are rewritten now)
    return _program("decay-factor", c, d, args, source, draw(st.integers(0, 2**16)), train, kind)


def render_decode(c: dict, d: dict, params: list) -> str:
    module = c["variant"] == "exp_buffer"
    src = Src(", ".join(params))
    if module:
        src.lines[0] = "class Model(torch.nn.Module):"
        src("def __init__(self):")
        src("    super().__init__()")
        src(f"    H, BASE = {d['H']}, 5")
        # float64, cast to q's dtype in forward (torchscale's decay buffer may be either)
        src(f"    self.register_buffer('log_decay', torch.log({_gammas()}).double())")
        src(f"def forward(self, {', '.join(params)}):")
        src.depth += 1
    src("B, H, _, K = q.shape")
    src("V = v.shape[-1]")
    vf = c["v_first"]
    ks = "k" if vf else "k.transpose(2, 3)"  # k in the state's orientation: [B, H, 1, K] or [B, H, K, 1]
    src(f"kv = {ks} * v.view({'B, H, V, 1' if vf else 'B, H, 1, V'})")
    _factor(src, c)
    if _divisor(src, c, ks):
        src("kv = kv / y")
    src(f"S = {c['update'].replace('S', 'prev')}")
    if c["read"] == "einsum":
        src(f'o = torch.einsum("{"bhvk,bhxk->bhv" if vf else "bhkv,bhxk->bhv"}", S, q)')
    else:
        src("o = torch.sum(q * S, dim=3)" if vf else "o = (q.transpose(2, 3) * S).sum(2)")
    src("return o, S, scale" if c["variant"] in ("sqrt_ratio", "const_ratio") else "return o, S")
    text = src.text()
    return text + "\n\nfn = Model()\n" if module else text


def _divisor(src: Src, c: dict, ks: str) -> bool:
    """y, the divisor of the outer product (the sqrt ratios' is their own, set by _factor)."""
    if c["variant"] in ("sqrt_ratio", "const_ratio"):
        return True
    line = {"key": f"y = ({ks}.square() + 1).sqrt()", "head": "y = (w.square() + 1).sqrt().view(H, 1, 1)",
            "const_head": "y = (1 + torch.arange(H, dtype=torch.float32)).sqrt().view(H, 1, 1)"}.get(c["divisor"])
    if line:
        src(line)
    return line is not None


def _factor(src: Src, c: dict) -> None:
    """a, the state's decay (and y, the divisor of the sqrt ratios)."""
    m, var = c["mutation"], c["variant"]
    if m:
        src({"raw": "a = x.view(1, H, 1, 1)", "one_minus": "a = (1 - x).view(1, H, 1, 1)",
             "tanh": "a = torch.tanh(x).view(1, H, 1, 1)"}[m])
    elif var in ("sqrt_ratio", "const_ratio"):
        src("decay = log_decay.exp()" if var == "sqrt_ratio" else "decay = 0.9")
        src("scale = prev_scale * decay + 1")
        src("a = (prev_scale.sqrt() * decay / scale.sqrt()).view(H, 1, 1)")
        src("y = scale.sqrt().view(H, 1, 1)")
    elif var == "sigmoid":
        src("a = torch.sigmoid(x).view(B, H, 1, 1)")
    elif var == "exp_buffer":
        src("a = self.log_decay.exp().to(q.dtype).view(H, 1, 1)")
    else:
        src("a = 0.9")


def _loop_program(c: dict, d: dict, seed: int, train: bool) -> Program:
    B, T, H, K, V = d["B"], d["T"], d["H"], d["K"], d["V"]
    args = [("q", (B, T, H, K), "randn"), ("k", (B, T, H, K), "randn"), ("v", (B, T, H, V), "randn"),
            ("x", (B, T, H), "randn")]
    if c["divisor"] != "none":
        args.append(("y", (B, T, H), "randn"))
    c = dict(c, variant=f"loop_{c['variant']}")
    return _program("decay-factor", c, d, args, render_factor_loop(c, [a[0] for a in args]), seed, train)


def render_factor_loop(c: dict, params: list) -> str:
    src = Src(", ".join(params))
    src("B, T, H, K = q.shape")
    src("V = v.shape[-1]")
    vf = c["v_first"]
    src("S = q.new_zeros(B, H, V, K)" if vf else "S = q.new_zeros(B, H, K, V)")
    src("outs = []")
    src("for t in range(T):")
    src.depth += 1
    a = {"loop_sigmoid": "torch.sigmoid(x[:, t])",
         "loop_softplus": "F.softplus(x[:, t]) / (1 + x[:, t].abs())"}.get(c["variant"], "torch.tanh(x[:, t])")
    src(f"a = ({a}).view(B, H, 1, 1)")
    src("kv = v[:, t, :, :, None] * k[:, t, :, None, :]" if vf else "kv = k[:, t, :, :, None] * v[:, t, :, None, :]")
    if c["divisor"] != "none":
        src("kv = kv / (y[:, t].square() + 1).sqrt().view(B, H, 1, 1)")
    src(f"S = {c['update']}")
    src("outs.append((S * q[:, t, :, None, :]).sum(-1))" if vf else "outs.append((q[:, t, :, :, None] * S).sum(-2))")
    src.depth -= 1
    src("return torch.stack(outs, 1)")
    return src.text()


@st.composite
def factor_loop_near(draw) -> Program:
    """A time loop decayed by tanh(x_t): may be negative."""
    c = {"mutation": "loop_tanh", "variant": "loop_tanh", "divisor": draw(st.sampled_from(DIVISORS[:2])),
         "v_first": draw(st.booleans()), "update": draw(st.sampled_from(["S * a + kv", "a * S + kv"]))}
    d = draw(dims(T=(2, 6)))
    B, T, H, K, V = d["B"], d["T"], d["H"], d["K"], d["V"]
    args = [("q", (B, T, H, K), "randn"), ("k", (B, T, H, K), "randn"), ("v", (B, T, H, V), "randn"),
            ("x", (B, T, H), "randn")] + ([("y", (B, T, H), "randn")] if c["divisor"] != "none" else [])
    return _program("decay-factor", c, d, args, render_factor_loop(c, [a[0] for a in args]),
                    draw(st.integers(0, 2**16)), draw(st.booleans()), kind="near")


# ---- chunked retention with power decays -----------------------------------------------------------
SHIFTS = ["cat", "pad", "minus_self"]


@st.composite
def power_chunks_program(draw, mutation: Optional[str] = None) -> Program:
    c = {
        "mutation": mutation,
        "variant": draw(st.sampled_from(["cumsum", "cumsum", "loop"])),
        "source": draw(st.sampled_from(["input", "buffer"])),
        "shift": draw(st.sampled_from(SHIFTS)),
        "pow": draw(st.sampled_from(["op", "method"])),
        "C": draw(st.sampled_from([2, 3, 4])),
        "base": draw(st.sampled_from([1, 2, 3])),
    }
    if mutation in ("no_cross_decay", "inclusive"):
        c["variant"] = "cumsum"
    if mutation == "negative_buffer":
        c["source"] = "buffer"
    if mutation == "inclusive":
        c["shift"] = "none"
    # one chunk has no state to carry: there the cross-chunk look-alikes are GLA
    d = draw(dims())
    d["T"] = c["C"] * draw(st.sampled_from([2, 3] if mutation in ("no_cross_decay", "inclusive") else [1, 2, 2, 3]))
    if mutation == "negative_buffer":
        d["H"] = 2  # one head negative, one not
    args = [(x, (d["B"], d["H"], d["T"], d[f]), "randn") for x, f in (("q", "K"), ("k", "K"), ("v", "V"))]
    if c["source"] == "input":
        args.append(("gamma", (d["H"],), "unit"))
    source = render_power_chunks(c, d, [a[0] for a in args])
    # (the former gaps: one chunk, B = 1, K or V of 1 or equal to other sizes, are rewritten now)
    return _program("power-chunks", c, d, args, source, draw(st.integers(0, 2**16)),
                    draw(st.sampled_from([True, True, False])))


def render_power_chunks(c: dict, d: dict, params: list) -> str:
    module = c["source"] == "buffer"
    src = Src(", ".join(params))
    if module:
        src.lines[0] = "class Model(torch.nn.Module):"
        src("def __init__(self):")
        src("    super().__init__()")
        src(f"    H, BASE = {d['H']}, {c['base']}")
        src(f"    self.register_buffer('gamma', {_gammas()})")
        if c["mutation"] == "negative_buffer":
            src("    self.gamma[-1] = -0.5  # gamma ** n alternates in sign")
        src(f"def forward(self, {', '.join(params)}):")
        src.depth += 1
        src("gamma = self.gamma")
    src("B, H, T, K = q.shape")
    src(f"V, C = v.shape[-1], {c['C']}")
    src("g = gamma[:, None, None]" if c["variant"] == "loop" else "g = gamma[:, None, None, None]")
    src("i = torch.arange(C, dtype=q.dtype)")
    src("causal = torch.tril(torch.ones(C, C, dtype=torch.bool))")
    power = "g.pow(i[:, None] - i[None, :])" if c["pow"] == "method" else "g ** (i[:, None] - i[None, :])"
    src(f"D = ({power}).masked_fill(~causal, 0)")
    if c["variant"] == "loop":
        _power_loop(src)
    else:
        _power_cumsum(src, c)
    text = src.text()
    return text + "\n\nfn = Model()\n" if module else text


def _power_loop(src: Src) -> None:
    src("S, outs = q.new_zeros(B, H, K, V), []")
    src("for s in range(0, T, C):")
    src.depth += 1
    src("qi, ki, vi = q[:, :, s:s + C], k[:, :, s:s + C], v[:, :, s:s + C]")
    src("outs.append((qi @ ki.transpose(-1, -2) * D) @ vi + (qi * g ** (i + 1)[:, None]) @ S)")
    src("S = S * g**C + (ki * g ** (C - 1 - i)[:, None]).transpose(-1, -2) @ vi")
    src.depth -= 1
    src("return torch.cat(outs, 2)")


def _power_cumsum(src: Src, c: dict) -> None:
    """The chunk states an exclusive cumsum over chunks of kv_m / gamma^(C m), rescaled."""
    src("n = torch.arange(T // C, dtype=q.dtype)")
    src("qc, kc, vc = q.reshape(B, H, -1, C, K), k.reshape(B, H, -1, C, K), v.reshape(B, H, -1, C, V)")
    src("kv = (kc * g ** (C - 1 - i)[:, None]).transpose(-1, -2) @ vc")
    src("gn = torch.ones_like(g)" if c["mutation"] == "no_cross_decay" else "gn = g ** (C * n)[:, None, None]")
    src("kv = kv / gn")
    src("s = kv.cumsum(2)")
    src({
        "cat": "s = torch.cat([torch.zeros_like(s[:, :, :1]), s[:, :, :-1]], 2)",
        "pad": "s = F.pad(s, (0, 0, 0, 0, 1, 0))[:, :, :-1]",
        "minus_self": "s = s - kv",
        "none": "s = s  # inclusive: the chunk's own keys read twice",
    }[c["shift"]])
    src("state = s * gn / g**C")
    src("o = ((qc @ kc.transpose(-1, -2)) * D) @ vc + (qc * g ** (i + 1)[:, None]) @ state")
    src("return o.flatten(2, 3)")


# ---- parallel retention over a buffer mask -------------------------------------------------------
@st.composite
def buffer_mask_program(draw, mutation: Optional[str] = None) -> Program:
    c = {
        "mutation": mutation,
        "variant": draw(st.sampled_from(["power", "exp", "tril"])),
        "apply": draw(st.sampled_from(["product", "einsum3", "einsum_then"])),
        "layout": draw(st.sampled_from(["BHTD", "BTHD"])),
        "scale": draw(st.sampled_from(["none", "q", "scores"])),
        "extra": draw(st.sampled_from([0, 0, 3])),  # the buffer longer than the sequence
        "base": draw(st.sampled_from([2, 3, 5])),
    }
    if mutation in ("negative_base", "noncausal"):
        c["variant"] = "power"
    d = draw(dims())
    args = [("q", _shape(c, d, d["K"]), "randn"), ("k", _shape(c, d, d["K"]), "randn"),
            ("v", _shape(c, d, d["V"]), "randn")]
    return _program("buffer-mask", c, d, args, render_buffer_mask(c, d), draw(st.integers(0, 2**16)),
                    draw(st.sampled_from([True, True, False])))


def render_buffer_mask(c: dict, d: dict) -> str:
    src = Src("")
    src.lines[0] = "class Model(torch.nn.Module):"
    src("def __init__(self):")
    src.depth += 1
    src("super().__init__()")
    src(f"H, L, BASE = {d['H']}, {d['T'] + c['extra']}, {c['base']}")
    src(f"gamma = {_gammas('-' if c['mutation'] == 'negative_base' else '')}")
    src("n = torch.arange(L, dtype=torch.float32)")
    src("dist = n[:, None] - n[None, :]")
    m = c["mutation"]
    keep = {"strict": "dist > 0", "noncausal": None}.get(m, "dist >= 0")
    if c["variant"] == "power":
        power = "dist.abs()" if m == "noncausal" else "dist.clamp(min=0)"
        src(f"mask = gamma[:, None, None] ** {power}" + (f" * ({keep})" if keep else ""))
    elif c["variant"] == "exp":
        src(f"mask = torch.exp(dist.clamp(min=0) * torch.log(gamma)[:, None, None]).masked_fill(~({keep}), 0)")
    else:
        src(f"mask = (gamma[:, None, None] ** dist.abs()).tril({-1 if m == 'strict' else 0})")
    src("self.register_buffer('mask', mask)")
    src.depth -= 1
    src("def forward(self, q, k, v):")
    src.depth += 1
    if c["layout"] == "BTHD":
        src("q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)")
    src("T, K = q.shape[2], q.shape[3]")
    src("M = self.mask[:, :T, :T]")
    if c["scale"] == "q":
        src("q = q * K ** -0.5")
    src({"product": "A = (q @ k.transpose(-1, -2)) * M",
         "einsum3": 'A = torch.einsum("bhqd,bhkd,hqk->bhqk", q, k, M)',
         "einsum_then": 'A = torch.einsum("bhid,bhjd->bhij", q, k) * M'}[c["apply"]])
    if c["scale"] == "scores":
        src("A = A * K ** -0.5")
    src("o = A @ v")
    src("return o.transpose(1, 2)" if c["layout"] == "BTHD" else "return o")
    return src.text() + "\n\nfn = Model()\n"


def new_form_categories() -> list:
    """(name, weight, strategy) of these families, for fuzz_programs.categories()."""
    cats = [
        ("normalized", 4, normalized_program()),
        ("decay-factor", 4, decay_factor_program()),
        ("power-chunks", 3, power_chunks_program()),
        ("buffer-mask", 3, buffer_mask_program()),
        ("decay-factor/loop_tanh", 1, factor_loop_near()),
    ]
    strategies = {"normalized": normalized_program, "decay-factor": decay_factor_program,
                  "power-chunks": power_chunks_program, "buffer-mask": buffer_mask_program}
    for family, kinds in NEW_MUTATIONS.items():
        cats += [(f"{family}/{m}", 1, strategies[family](mutation=m)) for ms in kinds.values() for m in ms]
    return cats
