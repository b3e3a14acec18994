"""Naive GLA programs, and programs that look like GLA but are not, generated from small
independent spelling choices (hypothesis strategies) for tests/recognize/test_fuzz.py.

A program is Python source (printable, reproducible) plus how to make its inputs. Kinds:

  gla          GLA as people write it; must be rewritten ``expected`` times (1)
  gap          GLA the recognizer does not cover yet (``gap`` names why); must only equal eager
  decode       one token: the time loop over a single step; must only equal eager
  near         not GLA (delta rule, normalized, RWKV-6 read, gate over V, wrong or shifted mask,
               ...); must not be rewritten
  known        a near miss that a known recognizer issue rewrites in part; must only equal eager
  equivalent   not GLA as written but GLA of other inputs (decay after the update, gate of
               step t - 1, exp(G_{i-1} - G_j), exp(G_j - G_i), a cumsum over K, a constant
               decay against the mask's direction): a rewrite is allowed, so only the
               numerics are checked

A GLA program may also pin the options of its rewrite (``expected_options``): a parallel form
whose initial-state or final-state term is off by one step is GLA plus code that the rewrite
must leave as it is (initial_state / final_state False).

Time loops (``loop_program``) and parallel forms (``parallel_program``, q and k optionally with
half v's heads, repeated in the code) are rendered from a dict of choices; near misses are the
same renderers with one ``mutation``. Retention (decays from positions and constants only) is in
fuzz_retention.py; normalized retention, decays by a computed factor, power-decay chunks and
buffer masks in fuzz_new_forms.py. Sizes stay tiny
(T <= 8, K, V <= 8, B, H <= 2) so that Dynamo traces each program in well under a second.
"""

from __future__ import annotations

import linecache
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from hypothesis import strategies as st

# ----------------------------------------------------------------------------------------------
# programs
# ----------------------------------------------------------------------------------------------


@dataclass
class Program:
    kind: str  # gla | gap | decode | near | known | equivalent
    name: str  # "<form>/<gate>" or "<form>/<mutation>", for the per-category counts
    source: str
    args: list  # (name, shape, init) per argument; init: "randn" | "gate" | "gamma" | "state" | "unit" |
    # "positive"
    dtype: torch.dtype  # of q, k, v and the gate; the state is always fp32; bf16 programs cast
    # to fp32 before any arithmetic
    seed: int
    gate_dist: str
    choices: dict
    dims: dict
    expected: Optional[int] = None  # rewrites the backend must make (None: not asserted)
    # options every rewrite must report (Match.options): the initial or final state folded
    # into the op, or not (a near-miss state term left as code)
    expected_options: dict = field(default_factory=dict)
    gap: Optional[str] = None
    train: bool = True  # inputs require grad and every gradient is checked; else under no_grad
    mutates: Optional[str] = None  # the input the program writes in place (a decode cache)
    _fn: Optional[Callable] = field(default=None, repr=False)

    def function(self) -> Callable:
        """The program as a function; its source is registered with linecache for tracebacks."""
        if self._fn is None:
            filename = f"<fuzz {self.name} {abs(hash(self.source)):x}>"
            linecache.cache[filename] = (len(self.source), None, self.source.splitlines(True), filename)
            scope = {"torch": torch, "F": F}
            exec(compile(self.source, filename, "exec"), scope)
            self._fn = scope["fn"]
        return self._fn

    def inputs(self) -> list:
        gen = torch.Generator().manual_seed(self.seed)
        out = []
        for _name, shape, init in self.args:
            x = torch.randn(shape, generator=gen, dtype=torch.float64)
            if init in ("gate", "gamma"):
                x = _GATE_DISTS[self.gate_dist](x, gen)
            elif init == "unit":  # a decay itself (gamma ** n), in (0.5, 1) like RetNet's: smaller ones
                # make gamma ** -(C n) large enough that fp32 programs lose digits of d gamma
                x = 0.5 + 0.5 * torch.sigmoid(x + 1)
            elif init == "positive":  # a running sum of decays, >= 1
                x = 1 + 5 * torch.rand(shape, generator=gen, dtype=torch.float64)
            # the state and the decays stay fp32: programs cast q, k, v and g only
            out.append(x.to(torch.float32 if init in ("state", "gamma", "unit", "positive") else self.dtype))
        return out

    def __repr__(self) -> str:
        return f"<program\n{self}>"

    def _repr_pretty_(self, printer, cycle) -> None:
        # how hypothesis prints a falsifying example (else field by field, the source as one line)
        printer.text(repr(self))

    def __str__(self) -> str:
        args = ", ".join(f"{n}{list(s)}" for n, s, _ in self.args)
        mode = "train" if self.train else "no_grad"
        head = f"# {self.kind} {self.name} ({mode}); inputs {args}, {self.dtype}"
        head += f", gate {self.gate_dist}, seed {self.seed}"
        if self.gap:
            head += f"\n# gap: {self.gap}"
        return head + "\n" + self.source


# log gates: mild decay (logsigmoid, the usual parametrisation), strong decay, and a mix of
# decay and growth (a positive log gate is legal GLA; T <= 8 keeps it in range)
_GATE_DISTS = {
    "decay": lambda x, gen: F.logsigmoid(x + 2.0),
    "strong": lambda x, gen: -4.0 * torch.rand(x.shape, generator=gen, dtype=torch.float64),
    "mixed": lambda x, gen: 0.3 * x,
}


class Src:
    """Lines of a function body at an indentation depth."""

    def __init__(self, signature: str):
        self.lines = [f"def fn({signature}):"]
        self.depth = 1

    def __call__(self, line: str) -> None:
        self.lines.append("    " * self.depth + line)

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


# ----------------------------------------------------------------------------------------------
# layouts
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    """Axis order of q, k, v (and of o): B, H, T and the feature axis D; N is B * H flattened."""

    axes: str  # "BTHD", "BHTD", "TBHD", "TND"

    @property
    def time(self) -> int:
        return self.axes.index("T")

    @property
    def flat(self) -> bool:
        return "N" in self.axes

    @property
    def batch(self) -> str:
        """einsum letters of the batch axes of one step: "bh" or "n"."""
        return "n" if self.flat else "bh"

    def shape(self, d: dict, last: Optional[int]) -> tuple:
        sizes = {"B": d["B"], "H": d["H"], "T": d["T"], "N": d["B"] * d["H"], "D": last}
        return tuple(sizes[a] for a in self.axes if a != "D" or last is not None)

    def state_shape(self, d: dict) -> tuple:
        return (d["B"] * d["H"], d["K"], d["V"]) if self.flat else (d["B"], d["H"], d["K"], d["V"])

    def head_shape(self, d: dict) -> tuple:
        """Shape of a constant gate: one per head, [H] (or [N] with flattened heads)."""
        return (d["B"] * d["H"],) if self.flat else (d["H"],)

    def unpack(self) -> str:
        return ", ".join(a if a != "D" else "K" for a in self.axes) + " = q.shape"

    def state_dims(self) -> str:
        return "N, K, V" if self.flat else "B, H, K, V"

    def at(self, x: str, t: str) -> str:
        return f"{x}[{':, ' * self.time}{t}]"


LAYOUTS = {name: Layout(name.upper()) for name in ("bthd", "bhtd", "tbhd", "tnd")}


def gate_args(layout: Layout, gate: str, d: dict, over: str = "K") -> list:
    """The gate argument of a program: [] or one (name, shape, init)."""
    if gate == "vector":
        return [("g", layout.shape(d, d[over]), "gate")]
    if gate == "scalar":
        return [("g", layout.shape(d, None), "gate")]
    if gate == "constant":
        return [("g_gamma", layout.head_shape(d), "gamma")]
    return []


# grouped heads: q and k of G heads, head-first [B, G, T, K], repeated over v's H heads in the code
SPREADS = ["repeat_interleave", "expand_reshape", "index_expand", "repeat"]


def spread(how: str, x: str) -> str:
    """x [B, G, T, K] repeated over the heads to [B, H, T, K] (R = H // G)."""
    return {
        "repeat_interleave": f"{x}.repeat_interleave(R, dim=1)",
        "expand_reshape": f"{x}.unsqueeze(2).expand(B, H // R, R, T, K).reshape(B, H, T, K)",
        "index_expand": f"{x}[:, :, None].expand(-1, -1, R, -1, -1).reshape(B, H, T, K)",
        "repeat": f"{x}.repeat(1, R, 1, 1)",
    }[how]


def emit_spread(src: Src, how: Optional[str]) -> None:
    if how is not None:
        src("R = H // q.shape[1]")
        src(f"q, k = {spread(how, 'q')}, {spread(how, 'k')}")


# ----------------------------------------------------------------------------------------------
# time loops
# ----------------------------------------------------------------------------------------------

SLICINGS = ["index", "select", "unbind", "narrow", "keepdim", "rows"]
OUTERS = ["broadcast_index", "broadcast_unsqueeze", "matmul", "matmul_fn", "einsum", "bmm"]
READS = ["broadcast_index", "broadcast_unsqueeze", "matmul", "matmul_fn", "einsum", "bmm"]
UPDATES = ["{S} * {d} + kv", "{d} * {S} + kv", "kv + {S} * {d}", "{S}.mul({d}).add(kv)"]
LOOP_SCALES = ["none", "q_pre", "q_step", "read", "out"]
CASTS = ["none", "float_top", "float_step", "to_step"]
STATE_INITS = ["zeros_new", "zeros_torch", "none_first", "h0", "h0_clone"]
ASSEMBLIES = ["setitem", "stack", "cat", "list_index"]
LOOP_MUTATIONS = {
    "near": ["delta", "normalized", "rwkv6", "exclusive", "gate_over_v", "shared_heads",
             "shifted_v", "nonlinear"],
    "equivalent": ["decay_after", "gate_prev"],
}


def _slice(c: dict, layout: Layout, x: str, t: str = "t") -> str:
    """One time step of x: [*batch, D] (or [B, H, 1, D] rows)."""
    td = layout.time
    return {
        "index": layout.at(x, t),
        "select": f"{x}.select({td}, {t})",
        "unbind": f"{x}s[{t}]",
        "narrow": f"{x}.narrow({td}, {t}, 1).squeeze({td})",
        "keepdim": f"{layout.at(x, f'{t}:{t} + 1')}.squeeze({td})",
        "rows": layout.at(x, f"{t}:{t} + 1"),
    }[c["slicing"]]


def _outer(c: dict, layout: Layout, k: str, v: str) -> str:
    b = layout.batch
    if c["slicing"] == "rows":
        return f"{k}.transpose(-1, -2) @ {v}"
    return {
        "broadcast_index": f"{k}[..., :, None] * {v}[..., None, :]",
        "broadcast_unsqueeze": f"{k}.unsqueeze(-1) * {v}.unsqueeze(-2)",
        "matmul": f"{k}.unsqueeze(-1) @ {v}.unsqueeze(-2)",
        "matmul_fn": f"torch.matmul({k}[..., None], {v}[..., None, :])",
        "einsum": f'torch.einsum("{b}k,{b}v->{b}kv", {k}, {v})',
        "bmm": (f"torch.bmm({k}.unsqueeze(2), {v}.unsqueeze(1))" if layout.flat else
                f"torch.bmm({k}.reshape(-1, K, 1), {v}.reshape(-1, 1, V)).view(B, H, K, V)"),
    }[c["outer"]]


def _read(c: dict, layout: Layout, q: str, S: str) -> str:
    b = layout.batch
    if c["slicing"] == "rows":
        return f"{q} @ {S}"
    return {
        "broadcast_index": f"({q}[..., :, None] * {S}).sum(-2)",
        "broadcast_unsqueeze": f"({q}.unsqueeze(-1) * {S}).sum(dim=-2)",
        "matmul": f"({q}.unsqueeze(-2) @ {S}).squeeze(-2)",
        "matmul_fn": f"torch.matmul({q}[..., None, :], {S})[..., 0, :]",
        "einsum": f'torch.einsum("{b}k,{b}kv->{b}v", {q}, {S})',
        "bmm": (f"torch.bmm({q}.unsqueeze(1), {S}).squeeze(1)" if layout.flat else
                f"torch.bmm({q}.reshape(-1, 1, K), {S}.reshape(-1, K, V)).view(B, H, V)"),
    }[c["read"]]


def _step_decay(c: dict, gate: str, over_v: bool) -> Optional[str]:
    """exp of the gate of one step, shaped to scale the state [*batch, K, V]."""
    fn = c["decay_fn"]
    e = "torch.exp(g_t)" if fn else "g_t.exp()"
    rows = c["slicing"] == "rows"
    if over_v:  # the near miss: one decay per value column
        return e if rows else f"{e}[..., None, :]"
    if gate == "vector":
        return f"{e}.transpose(-1, -2)" if rows else (f"{e}.unsqueeze(-1)" if fn else f"{e}[..., None]")
    if gate == "scalar":
        if rows:
            return f"{e}[..., None]"
        return f"{e}.unsqueeze(-1).unsqueeze(-1)" if fn else f"{e}[..., None, None]"
    if gate == "constant":
        return "decay"
    return None


def _update(c: dict, d: Optional[str], S: str = "S") -> str:
    if d is None:
        return f"{S} + kv"
    return c["update"].format(S=S, d=d)


@st.composite
def loop_program(draw, mutation: Optional[str] = None, decode: bool = False) -> Program:
    layout = LAYOUTS[draw(st.sampled_from(sorted(LAYOUTS)))]
    gates = ["vector", "scalar", "constant", "none"]
    if mutation in ("gate_over_v",):
        gates = ["vector"]
    elif mutation in ("decay_after", "gate_prev"):
        gates = ["vector", "scalar"] if mutation == "gate_prev" else ["vector", "scalar", "constant"]
    gate = draw(st.sampled_from(gates))
    c = {
        "layout": layout.axes,
        "gate": gate,
        "slicing": draw(st.sampled_from(SLICINGS)),
        "outer": draw(st.sampled_from(OUTERS)),
        "read": draw(st.sampled_from(READS)),
        "update": draw(st.sampled_from(UPDATES)),
        "decay_fn": draw(st.booleans()),
        "scale": draw(st.sampled_from(LOOP_SCALES)),
        "scale_value": draw(st.sampled_from(["K ** -0.5", "0.5"])),
        "cast": draw(st.sampled_from(CASTS)),
        "init": draw(st.sampled_from(STATE_INITS)),
        "final_state": draw(st.booleans()),
        "reverse": draw(st.booleans()),
        "reverse_range": draw(st.booleans()),
        "assembly": draw(st.sampled_from(ASSEMBLIES)),
        "mutation": mutation,
    }
    c["write_back"] = None
    if decode:
        # a decode step updates a state cache: returned, or written back in place
        c.update(init=draw(st.sampled_from(["h0", "h0_clone"])), final_state=True,
                 write_back=draw(st.sampled_from([None, "copy_", "setitem"])))
    d = draw(dims(T=(1, 1) if decode else (2, 8), at_least=_NEAR_MISS_SIZES.get(mutation)))
    if mutation == "shared_heads" and layout.flat:
        c["layout"] = "BTHD"  # the mutation sums over the head axis
    bf16 = c["cast"] != "none" and draw(st.booleans())
    return make_loop(c, d, torch.bfloat16 if bf16 else torch.float32, seed=draw(st.integers(0, 2**16)),
                     gate_dist=draw(st.sampled_from(sorted(_GATE_DISTS))), decode=decode,
                     train=draw(st.sampled_from([True, True, False])))


def make_loop(c: dict, d: dict, dtype: torch.dtype, seed: int, gate_dist: str, decode: bool = False,
              train: bool = True) -> Program:
    """The time-loop program of the choices c at sizes d."""
    layout = LAYOUTS[c["layout"].lower()]
    c = _fix_loop_choices(dict(c), layout, dtype)
    mutation, gate = c["mutation"], c["gate"]
    args = [("q", layout.shape(d, d["K"]), "randn"), ("k", layout.shape(d, d["K"]), "randn"),
            ("v", layout.shape(d, d["V"]), "randn")]
    args += gate_args(layout, gate, d, over="V" if mutation == "gate_over_v" else "K")
    if c["init"].startswith("h0"):
        args.append(("h0", layout.state_shape(d), "state"))
    kind = "decode" if decode else _mutation_kind(mutation, LOOP_MUTATIONS)
    gap = loop_gap(c, d) if kind == "gla" else near_miss_issue(c) if kind == "near" else None
    kind = {"gla": "gap", "near": "known"}.get(kind, kind) if gap else kind
    return Program(
        kind=kind, name=f"{'decode' if decode else 'loop'}/{mutation or gate}",
        source=render_loop(c, layout, [a[0] for a in args]), args=args, dtype=dtype, seed=seed,
        gate_dist=gate_dist, choices=c, dims=d, expected={"gla": 1, "near": 0}.get(kind), gap=gap,
        # an in-place write into an input is inference only (autograd refuses it on a leaf)
        train=train and not c.get("write_back"), mutates="h0" if c.get("write_back") else None,
    )


def _fix_loop_choices(c: dict, layout: Layout, dtype: torch.dtype) -> dict:
    """Make the drawn choices consistent (each fix keeps a valid program of the same meaning)."""
    if dtype == torch.bfloat16 and c["cast"] != "float_top" and (c["scale"] == "q_pre" or c["mutation"] == "normalized"):
        # no bf16 arithmetic before the casts: a compiled graph may keep such a product in fp32
        # (as Inductor does), which is no bug, but differs from eager by a bf16 rounding that
        # cancelling sums (dg_gamma) amplify past any fair tolerance
        c["cast"] = "float_top"
    if c["slicing"] == "rows" and layout.axes != "BHTD":
        c["slicing"] = "keepdim"  # row slices [B, H, 1, D] need the head-first layout
    if c["slicing"] == "rows":
        c["outer"] = c["read"] = "rows"
        c["assembly"] = "setitem" if c["assembly"] == "setitem" else "cat"
    if c["mutation"] and c["init"] == "none_first":
        c["init"] = "zeros_new"  # the mutations rewrite the update that `S = kv if S is None` skips
    return c


def _mutation_kind(mutation: Optional[str], mutations: dict) -> str:
    return next((kind for kind, ms in mutations.items() if mutation in ms), "gla")


def near_miss_issue(c: dict) -> Optional[str]:
    """A known recognizer issue that rewrites part of this near miss (correctly, but against
    its own rules); none at present (test_fuzz.py keeps the repros of fixed ones)."""
    return None


def loop_gap(c: dict, d: dict) -> Optional[str]:
    """Why the recognizer does not cover this GLA loop spelling yet; None when it must (every
    loop spelling now, K or V of size 1 included)."""
    return None


def render_loop(c: dict, layout: Layout, params: list) -> str:
    src = Src(", ".join(params))
    mutation, gate = c["mutation"], c["gate"]
    td = layout.time
    src(layout.unpack())
    src("V = v.shape[-1]")
    _loop_prologue(src, c, params)
    if c["slicing"] == "unbind":
        for x in params:
            if x in ("q", "k", "v", "g"):
                src(f"{x}s = {x}.unbind({td})")
    if gate == "constant":
        src("decay = torch.exp(g_gamma).view(-1, 1, 1)" if c["decay_fn"] else "decay = g_gamma.exp()[:, None, None]")
    _state_init(src, c, layout)
    _assembly_init(src, c)
    if c["reverse"]:
        src("for t in range(T - 1, -1, -1):" if c["reverse_range"] else "for t in reversed(range(T)):")
    else:
        src("for t in range(T):")
    src.depth += 1
    _loop_step(src, c, layout, gate, mutation)
    _assemble_step(src, c, layout)
    src.depth -= 1
    _assembly_finish(src, c, layout)
    if c["scale"] == "out":
        src("o = o * scale")
    if c["cast"] != "none":
        src("o = o.to(dtype)")
    if c.get("write_back") == "copy_":
        src("h0.copy_(S)")
    elif c.get("write_back") == "setitem":
        src("h0[...] = S")
    src("return o, S" if c["final_state"] and not c.get("write_back") else "return o")
    return src.text()


def _loop_prologue(src: Src, c: dict, params: list) -> None:
    if c["scale"] != "none":
        src(f"scale = {c['scale_value']}")
    if c["cast"] != "none":
        src("dtype = q.dtype")
    if c["cast"] == "float_top":
        src("q, k, v = q.float(), k.float(), v.float()")
        if "g" in params:
            src("g = g.float()")
    if c["mutation"] == "normalized":
        src("q, k = F.elu(q) + 1, F.elu(k) + 1  # positive features: the sums stay away from 0")
    if c["scale"] == "q_pre":
        src("q = q * scale")


def _state_init(src: Src, c: dict, layout: Layout) -> None:
    dims = layout.state_dims()
    fp32 = c["cast"] != "none"
    init = c["init"]
    if init == "zeros_new":
        src(f"S = q.new_zeros({dims}, dtype=torch.float32)" if fp32 else f"S = q.new_zeros({dims})")
    elif init == "zeros_torch":
        src(f"S = torch.zeros({dims})")
    elif init == "none_first":
        src("S = None")
    elif c["cast"] == "float_step" or c["cast"] == "float_top":
        src("S = h0.float()")
    elif c["cast"] == "to_step":
        src("S = h0.to(torch.float32)")
    else:
        src("S = h0.clone()" if init == "h0_clone" else "S = h0")
    if c["mutation"] == "normalized":
        src("z = 0.0")


def _assembly_init(src: Src, c: dict) -> None:
    if c["assembly"] == "setitem":
        src("o = v.new_zeros(v.shape, dtype=torch.float32)" if c["cast"] != "none" else "o = torch.zeros_like(v)")
    elif c["assembly"] == "list_index":
        src("outs = [None] * T")
    else:
        src("outs = []")


def _loop_step(src: Src, c: dict, layout: Layout, gate: str, mutation: Optional[str]) -> None:
    src(f"q_t, k_t = {_slice(c, layout, 'q')}, {_slice(c, layout, 'k')}")
    src(f"v_t = {_slice(c, layout, 'v', '(t - 1) % T' if mutation == 'shifted_v' else 't')}")
    if gate in ("vector", "scalar"):
        src(f"g_t = {_slice(c, layout, 'g', '(t - 1) % T' if mutation == 'gate_prev' else 't')}")
    cast = {"float_step": ".float()", "to_step": ".to(torch.float32)"}.get(c["cast"])
    if cast:
        src(f"q_t, k_t, v_t = q_t{cast}, k_t{cast}, v_t{cast}")
        if gate in ("vector", "scalar"):
            src(f"g_t = g_t{cast}")
    if c["scale"] == "q_step":
        src("q_t = q_t * scale")
    d = _step_decay(c, gate, over_v=mutation == "gate_over_v")
    if mutation == "delta":
        src("k_t = F.normalize(k_t, dim=-1)  # unit keys keep the delta rule stable")
        if d is not None:
            src(f"S = S * {d}")
        src(f"v_t = v_t - {_read(c, layout, 'k_t', 'S')}")
    src(f"kv = {_outer(c, layout, 'k_t', 'v_t')}")
    if mutation == "shared_heads":
        src("kv = kv.sum(1, keepdim=True).expand_as(kv)  # one update for all heads")
    if mutation == "rwkv6":
        src(f"o_t = {_read(c, layout, 'q_t', '(S + 0.5 * kv)')}")
    elif mutation == "exclusive":
        src(f"o_t = {_read(c, layout, 'q_t', 'S')}")
    if mutation == "delta":
        src("S = S + kv")
    elif mutation == "decay_after":
        src(f"S = (S + kv) * {d}")
    elif c["init"] == "none_first":
        src(f"S = kv if S is None else {_update(c, d)}")
    elif mutation == "nonlinear":
        src(f"S = torch.tanh({_update(c, d)})")
    else:
        src(f"S = {_update(c, d)}")
    if mutation not in ("rwkv6", "exclusive"):
        src(f"o_t = {_read(c, layout, 'q_t', 'S')}")
    if mutation == "normalized":
        src("z = z + k_t")
        src("o_t = o_t / ((q_t * z).sum(-1, keepdim=True) + 1e-6)")
    if c["scale"] == "read":
        src("o_t = o_t * scale")


def _assemble_step(src: Src, c: dict, layout: Layout) -> None:
    td = layout.time
    if c["assembly"] == "setitem":
        src(f"{layout.at('o', 't:t + 1' if c['slicing'] == 'rows' else 't')} = o_t")
    elif c["assembly"] == "list_index":
        src("outs[t] = o_t")
    elif c["assembly"] == "cat" and c["slicing"] != "rows":
        src(f"outs.append(o_t.unsqueeze({td}))")
    else:
        src("outs.append(o_t)")


def _assembly_finish(src: Src, c: dict, layout: Layout) -> None:
    td = layout.time
    if c["assembly"] == "setitem":
        return
    if c["reverse"] and c["assembly"] != "list_index":
        src("outs = outs[::-1]")
    if c["slicing"] == "rows" or c["assembly"] == "cat":
        src(f"o = torch.cat(outs, dim={td})")
    else:
        src(f"o = torch.stack(outs, dim={td})")


# ----------------------------------------------------------------------------------------------
# parallel forms
# ----------------------------------------------------------------------------------------------

CONTRACTIONS = ["matmul", "matmul_fn", "einsum", "bmm", "broadcast"]
MASK_BUILDS = ["tril_method", "tril_fn", "arange"]
MASK_APPLIES = ["tril", "fill0", "neginf", "where", "product"]
PAR_SCALES = ["none", "q", "scores", "out"]
PAR_MUTATIONS = {
    "near": ["triu", "strict", "exclusive", "noncausal", "normalized", "shared_heads"],
    # exp(F_i - F_j) on the causal triangle is GLA for any F (gate F_t - F_{t-1}): with F a
    # cumsum over K, a shift or a sign flip the programs are GLA of other gates
    "equivalent": ["shift_i", "sign", "cumsum_k"],
    # GLA whose initial-state term (decayed to step i - 1) or final state (decayed to step T - 2)
    # is one step off: the attention is rewritten, the term must stay code
    "partial": ["h0_shifted", "final_shifted"],
}
# what a rewrite of each partial mutation must leave out of the op
_PARTIAL_OPTIONS = {"h0_shifted": {"initial_state": False}, "final_shifted": {"final_state": False}}


@st.composite
def parallel_program(draw, mutation: Optional[str] = None, reverse: bool = False) -> Program:
    gates = ["scalar", "vector", "constant", "none"]
    if mutation in ("exclusive", "shift_i", "sign", "h0_shifted", "final_shifted"):
        gates = gates[:3]
    elif mutation == "triu":
        gates = ["scalar", "vector"]  # no or a constant decay against the mask is GLA reversed
    elif mutation == "cumsum_k":
        gates = ["vector"]
    gate = draw(st.sampled_from(gates))
    layouts = sorted(LAYOUTS)
    if mutation == "shared_heads":
        layouts = ["bhtd", "bthd", "tbhd"]
    layout = LAYOUTS[draw(st.sampled_from(layouts))]
    c = {
        "layout": layout.axes,
        "gate": gate,
        "vector_form": draw(st.sampled_from(["factored", "pairwise"])) if gate == "vector" else None,
        "scores": draw(st.sampled_from(CONTRACTIONS)),
        "out": draw(st.sampled_from(CONTRACTIONS)),
        "mask_build": draw(st.sampled_from(MASK_BUILDS)),
        "mask_apply": draw(st.sampled_from(MASK_APPLIES)),
        "mask_on": draw(st.sampled_from(["decay", "scores"])),
        "diff_unsqueeze": draw(st.booleans()),
        "pairwise_einsum": draw(st.booleans()),
        "cumsum_fn": draw(st.booleans()),
        "scale": draw(st.sampled_from(PAR_SCALES)),
        "scale_value": draw(st.sampled_from(["K ** -0.5", "0.5"])),
        "cast": draw(st.sampled_from(["none", "float", "to"])),
        "h0": draw(st.booleans()) if mutation is None else mutation == "h0_shifted",
        "final_state": draw(st.booleans()) if mutation is None else mutation == "final_shifted",
        "state_contract": draw(st.sampled_from(["matmul", "einsum"])),
        "reverse": reverse,
        "mutation": mutation,
        # q and k with half v's heads, repeated in the code (not where the heads are flattened)
        "grouped": None if layout.flat or mutation == "shared_heads" else draw(st.sampled_from([None] * 4 + SPREADS)),
    }
    d = draw(dims(at_least=_NEAR_MISS_SIZES.get(mutation)))
    if c["grouped"]:
        d = {**d, "G": d["H"], "H": 2 * d["H"]}
    bf16 = c["cast"] != "none" and draw(st.booleans())
    return make_parallel(c, d, torch.bfloat16 if bf16 else torch.float32, seed=draw(st.integers(0, 2**16)),
                         gate_dist=draw(st.sampled_from(sorted(_GATE_DISTS))),
                         train=draw(st.sampled_from([True, True, False])))


def make_parallel(c: dict, d: dict, dtype: torch.dtype, seed: int, gate_dist: str, train: bool = True) -> Program:
    """The parallel-form program of the choices c at sizes d."""
    layout = LAYOUTS[c["layout"].lower()]
    c = _fix_parallel_choices(dict(c))
    dqk = {**d, "H": d.get("G", d["H"])}  # grouped: q and k have G heads
    args = [("q", layout.shape(dqk, d["K"]), "randn"), ("k", layout.shape(dqk, d["K"]), "randn"),
            ("v", layout.shape(d, d["V"]), "randn")] + gate_args(layout, c["gate"], d)
    if c["h0"]:
        args.append(("h0", layout.state_shape(d), "state"))
    kind = _mutation_kind(c["mutation"], PAR_MUTATIONS)
    kind = "gla" if kind == "partial" else kind
    gap = parallel_gap(c, d) if kind == "gla" else None
    kind = "gap" if gap else kind
    return Program(
        kind=kind, name=f"parallel{'-reverse' if c['reverse'] else ''}/{c['mutation'] or c['gate']}",
        source=render_parallel(c, layout, [a[0] for a in args]), args=args, dtype=dtype, seed=seed,
        gate_dist=gate_dist, choices=c, dims=d, expected={"gla": 1, "near": 0}.get(kind), gap=gap,
        train=train, expected_options=parallel_options(c) if kind == "gla" else {},
    )


def parallel_options(c: dict) -> dict:
    """The options the rewrite of a GLA parallel program must report."""
    if c["mutation"] in _PARTIAL_OPTIONS:
        return dict(_PARTIAL_OPTIONS[c["mutation"]])
    return {"reverse": c["reverse"], "initial_state": c["h0"], "final_state": c["final_state"]}


def _fix_parallel_choices(c: dict) -> dict:
    """Make the drawn choices consistent (each fix keeps a valid program of the same meaning)."""
    gate = c["gate"]
    if c["vector_form"] == "pairwise":
        c["scores"] = "pairwise"
    if gate == "none" or c["vector_form"] == "factored":
        c["mask_on"] = "scores"  # there is no decay matrix to mask
    if c["mask_on"] == "scores" and c["mask_apply"] == "neginf":
        c["mask_apply"] = "fill0"  # -inf only before an exp
    if c["mask_on"] == "decay" and c["mask_apply"] == "tril":
        c["mask_apply"] = "fill0"  # .tril() on a [.., T, T, K] decay would cut the wrong axes
    if c["mutation"] == "shared_heads" and "bmm" in (c["scores"], c["out"]):
        c["scores"] = c["out"] = "matmul"  # bmm flattens the heads away
    return c


def parallel_gap(c: dict, d: dict) -> Optional[str]:
    """Why the recognizer does not cover this GLA spelling yet; None when it must (every
    parallel spelling now, K or V of size 1 included, except as below)."""
    if c.get("grouped") and d["V"] == 1 and d.get("G") == 1 and d["K"] == d["H"]:
        # with no value axis and q, k of one head, v's heads are an output axis only v has, as the
        # query time is q's; recognize/forms/parallel.py's _qkv_by_query tells them apart by length
        # (q's own axis is as long as the key time, v's as long as K), which fails here: a near
        # miss says so
        return "grouped q/k of one head, V = 1, K = H: the value's heads read like a query axis"
    return None


def render_parallel(c: dict, layout: Layout, params: list) -> str:
    src = Src(", ".join(params))
    src(layout.unpack())
    src("V = v.shape[-1]")
    if c.get("grouped"):
        src(f"H = v.shape[{layout.axes.index('H')}]")
    flat = layout.flat or "bmm" in (c["scores"], c["out"])
    if c["cast"] != "none":
        src("dtype = q.dtype")
    _to_head_first(src, c, layout, params)
    emit_spread(src, c.get("grouped"))
    if flat and not layout.flat:
        _flatten_heads(src, c, params)
    cast = {"float": ".float()", "to": ".to(torch.float32)"}.get(c["cast"])
    if cast:
        src(f"q, k, v = q{cast}, k{cast}, v{cast}")
        if "g" in params:
            src(f"g = g{cast}")
    if c["mutation"] == "normalized":
        src("q, k = F.elu(q) + 1, F.elu(k) + 1  # positive scores: the row sums stay away from 0")
    if c["scale"] != "none":
        src(f"scale = {c['scale_value']}")
    if c["scale"] == "q":
        src("q = q * scale")
    _mask(src, c)
    _scores(src, c, "n" if flat else "bh")
    if c["scale"] == "scores":
        src("A = A * scale")
    if c["mutation"] == "normalized":  # (by A's own row sums it is GLA: forms/normalized.py rewrites it)
        src("A = A / (A.abs().sum(-1, keepdim=True) + 1e-6)")
    if c["mutation"] == "shared_heads":
        src("A = A.sum(1, keepdim=True)  # one score matrix for all heads")
    src(f"o = {_contract(c['out'], 'A', 'v', 'ij,{b}jv->{b}iv', 'n' if flat else 'bh')}")
    if c["h0"]:
        _initial_state_term(src, c)
    if c["scale"] == "out":
        src("o = o * scale")
    if c["final_state"]:
        _final_state_term(src, c, "n" if flat else "bh")
        if flat and not layout.flat:
            src("S = S.view(B, H, K, V)")
    if flat and not layout.flat:
        src("o = o.view(B, H, T, V)")
    src({"BTHD": "o = o.transpose(1, 2)", "TBHD": "o = o.permute(2, 0, 1, 3)",
         "TND": "o = o.transpose(0, 1)", "BHTD": ""}[layout.axes] or "pass")
    if c["cast"] != "none":
        src("o = o.to(dtype)")
    src("return o, S" if c["final_state"] else "return o")
    return src.text().replace("    pass\n", "")


def _to_head_first(src: Src, c: dict, layout: Layout, params: list) -> None:
    """q, k, v (and g) to [*batch, T, D]."""
    move = {"BTHD": ".transpose(1, 2)", "TBHD": ".permute(1, 2, 0, 3)", "TND": ".transpose(0, 1)"}.get(layout.axes)
    if move is None:
        return
    src(f"q, k, v = q{move}, k{move}, v{move}")
    if "g" in params:
        if c["gate"] == "scalar":
            move = {"BTHD": ".transpose(1, 2)", "TBHD": ".permute(1, 2, 0)", "TND": ".transpose(0, 1)"}[layout.axes]
        src(f"g = g{move}")


def _flatten_heads(src: Src, c: dict, params: list) -> None:
    src("q, k, v = q.reshape(B * H, T, K), k.reshape(B * H, T, K), v.reshape(B * H, T, V)")
    if "g" in params:
        src("g = g.reshape(B * H, T, K)" if c["gate"] == "vector" else "g = g.reshape(B * H, T)")
    if "g_gamma" in params:
        src("g_gamma = g_gamma.repeat(B)  # [B * H], b-major like the reshape")
    if "h0" in params:
        src("h0 = h0.reshape(B * H, K, V)")


def _mask(src: Src, c: dict) -> None:
    """M [T, T] bool (and Mf, its 0/1 float form) for the causal mask, or its mutations."""
    m, build = c["mutation"], c["mask_build"]
    if build == "arange" or c["gate"] == "constant":
        src("i = torch.arange(T)")
    if m == "noncausal":
        return
    upper = (m == "triu") != c["reverse"]
    diag = {"strict": 1 if upper else -1, "exclusive": 1 if upper else -1}.get(m, 0)
    if build == "arange":
        op = {(False, 0): ">=", (False, -1): ">", (True, 0): "<=", (True, 1): "<"}[(upper, diag)]
        src(f"M = i[:, None] {op} i[None, :]")
    else:
        tri = "triu" if upper else "tril"
        arg = f"{diag}" if diag else ""
        if build == "tril_method":
            src(f"M = torch.ones(T, T, dtype=torch.bool).{tri}({arg})")
        else:
            src(f"M = torch.{tri}(torch.ones(T, T, dtype=torch.bool){', ' + arg if arg else ''})")
    if c["mask_apply"] == "product":
        src("Mf = M.float()" if build == "arange" else "Mf = M.to(q.dtype)")


def _cumsum(c: dict, axis: int) -> str:
    if c["reverse"]:
        return f"g.flip({axis}).cumsum({axis}).flip({axis})"
    return f"torch.cumsum(g, dim={axis})" if c["cumsum_fn"] else f"g.cumsum({axis})"


def _scores(src: Src, c: dict, b: str) -> None:
    """A [*batch, T, T]: q k^T with the decay and the mask."""
    gate, m = c["gate"], c["mutation"]
    if gate == "vector" and c["vector_form"] == "factored":
        src(f"G = {_cumsum(c, -1 if m == 'cumsum_k' else -2)}")
        gi, gj = ("-G", "G") if m == "sign" else ("(G - g)" if m in ("exclusive", "shift_i") else "G", "-G")
        src(f"A = {_contract(c['scores'], f'(q * torch.exp({gi}))', f'(k * torch.exp({gj}))', 'ik,{b}jk->{b}ij', b)}")
        _mask_scores(src, c)
        return
    D = _decay(src, c)
    if gate == "vector":  # pairwise [*batch, T, T, K]
        if c["pairwise_einsum"]:
            src(f'A = torch.einsum("{b}ik,{b}jk,{b}ijk->{b}ij", q, k, D)')
        else:
            src("A = (q[..., :, None, :] * k[..., None, :, :] * D).sum(-1)")
    else:
        src(f"A = {_contract(c['scores'], 'q', 'k', 'ik,{b}jk->{b}ij', b)}")
        if D is not None:
            src(f"A = A * {D}")
    if c["mask_on"] == "scores":
        _mask_scores(src, c)


def _decay(src: Src, c: dict) -> Optional[str]:
    """The decay matrix D (masked if the mask goes on the decay), or None without a gate."""
    gate, m = c["gate"], c["mutation"]
    if gate == "none":
        return None
    if gate == "constant":
        ij = {"sign": "(i[None, :] - i[:, None])", "exclusive": "(i[:, None] - i[None, :] - 1)",
              "shift_i": "(i[:, None] - i[None, :] - 1)"}.get(m, "(i[:, None] - i[None, :])")
        if c["reverse"]:
            ij = "(i[None, :] - i[:, None])"
        src(f"diff = {ij} * g_gamma[:, None, None]")
    else:
        vec = gate == "vector"
        src(f"G = {_cumsum(c, -2 if vec else -1)}")
        gi = "(G - g)" if m in ("exclusive", "shift_i") else "G"
        if vec:
            a, b = f"{gi}[..., :, None, :]", "G[..., None, :, :]"
        elif c["diff_unsqueeze"]:
            a, b = f"{gi}.unsqueeze(-1)", "G.unsqueeze(-2)"
        else:
            a, b = f"{gi}[..., :, None]", "G[..., None, :]"
        src(f"diff = {b} - {a}" if m == "sign" else f"diff = {a} - {b}")
    if m == "noncausal" or c["mask_on"] == "scores":
        src("D = diff.exp()")
        return "D"
    M = "M[:, :, None]" if gate == "vector" else "M"
    Mf = "Mf[:, :, None]" if gate == "vector" else "Mf"
    src({
        "fill0": f"D = diff.exp().masked_fill(~{M}, 0)",
        "neginf": f'D = diff.masked_fill(~{M}, float("-inf")).exp()',
        "where": f"D = torch.where({M}, diff.exp(), 0.0)",
        "product": f"D = diff.exp() * {Mf}",
    }[c["mask_apply"]])
    return "D"


def _mask_scores(src: Src, c: dict) -> None:
    m = c["mutation"]
    if m == "noncausal":
        return
    apply = c["mask_apply"]
    if apply == "tril":
        upper = (m == "triu") != c["reverse"]
        diag = ("1" if upper else "-1") if m in ("strict", "exclusive") else ""
        src(f"A = A.{'triu' if upper else 'tril'}({diag})")
    else:
        src({
            "fill0": "A = A.masked_fill(~M, 0)",
            "neginf": "A = A.masked_fill(~M, 0)",
            "where": "A = torch.where(M, A, 0.0)",
            "product": "A = A * Mf",
        }[apply])


def _contract(how: str, a: str, b: str, eq: str, batch: str) -> str:
    """a [*, I, C] with b over C: scores (b = k [*, J, C] -> [*, I, J]) or output (b = v [*, C, V])."""
    scores = eq.startswith("ik")
    eq = f"{batch}{eq}".replace("{b}", batch)
    if how == "einsum":
        return f'torch.einsum("{eq}", {a}, {b})'
    if how == "broadcast":
        return (f"({a}[..., :, None, :] * {b}[..., None, :, :]).sum(-1)" if scores else
                f"({a}[..., :, :, None] * {b}[..., None, :, :]).sum(-2)")
    bt = f"{b}.transpose(-1, -2)" if scores else b
    if how == "bmm":
        return f"torch.bmm({a}, {b}.transpose(1, 2))" if scores else f"torch.bmm({a}, {b})"
    if how == "matmul_fn":
        return f"torch.matmul({a}, {b}.mT)" if scores else f"torch.matmul({a}, {b})"
    return f"{a} @ {bt}"


def _initial_state_term(src: Src, c: dict) -> None:
    """+ scale * (q decayed from the start) @ h0: the initial state's share of every output
    (decayed one step short for the h0_shifted mutation)."""
    gate, short = c["gate"], c["mutation"] == "h0_shifted"
    G = "(G - g)" if short else "G"
    if gate == "vector":
        qd = f"q * {G}.exp()"
    elif gate == "scalar":
        qd = f"q * {G}.exp()[..., None]"
    elif gate == "constant":
        steps = ("(T - 1 - i)" if short else "(T - i)") if c["reverse"] else ("i" if short else "(i + 1)")
        qd = f"q * ({steps}[:, None] * g_gamma[:, None, None]).exp()"
    else:
        qd = "q"
    factor = "scale * " if c["scale"] == "scores" else ""
    src(f"o = o + {factor}({qd}) @ h0")


def _final_state_term(src: Src, c: dict, b: str) -> None:
    """S [*batch, K, V]: each k_j^T v_j decayed from step j to the end (to the start when
    reversed), plus h0 decayed over every step; one step short for final_shifted."""
    gate, rev, short = c["gate"], c["reverse"], c["mutation"] == "final_shifted"
    end = {(False, False): "-1:", (False, True): "-2:-1", (True, False): ":1", (True, True): "1:2"}[(rev, short)]
    if gate == "vector":
        src(f"kd = k * (G[..., {end}, :] - G).exp()")
        h0d = f"G[..., {'0' if rev else '-1'}, :, None].exp() * h0"
    elif gate == "scalar":
        src(f"kd = k * (G[..., {end}] - G).exp()[..., None]")
        h0d = f"G[..., {'0' if rev else '-1'}, None, None].exp() * h0"
    elif gate == "constant":
        steps = ("(i - 1)" if short else "i") if rev else ("(T - 2 - i)" if short else "(T - 1 - i)")
        src(f"kd = k * ({steps}[:, None] * g_gamma[:, None, None]).exp()")
        h0d = "(T * g_gamma).exp()[:, None, None] * h0"
    else:
        src("kd = k")
        h0d = "h0"
    if c["state_contract"] == "einsum":
        src(f'S = torch.einsum("{b}tk,{b}tv->{b}kv", kd, v)')
    else:
        src("S = kd.transpose(-1, -2) @ v")
    if c["h0"]:
        src(f"S = S + {h0d}")


# ----------------------------------------------------------------------------------------------
# strategies
# ----------------------------------------------------------------------------------------------


# K or V of 1 is legal but degenerate (the outer product is a broadcast); drawn now and then
_FEATURE_SIZES = [2, 3, 4, 5, 6, 7, 8] * 2 + [1]


@st.composite
def dims(draw, T=(2, 8), at_least: Optional[dict] = None) -> dict:
    low = {"B": 1, "H": 1, "K": 1, "V": 1, "T": T[0], **(at_least or {})}
    return {
        "B": draw(st.sampled_from([2, 1][: 2 - low["B"] + 1])),
        "T": draw(st.sampled_from(range(low["T"], T[1] + 1))),
        "H": draw(st.sampled_from([2, 1][: 2 - low["H"] + 1])),
        "K": draw(st.sampled_from([n for n in _FEATURE_SIZES if n >= low["K"]])),
        "V": draw(st.sampled_from([n for n in _FEATURE_SIZES if n >= low["V"]])),
    }


# Sizes below which a near miss coincides with GLA or its gradients vanish: summing one head,
# one gate column over V, K = 1 (a sum over heads of one key each is a vector-gated GLA whose
# keys are the heads; q / (q z) and k / |k| are constant in q and k, so their exact gradients
# are 0 and the fp32 ones rounding noise); RWKV-6 at T = 2 is GLA with a decay of 2 on 0.5 k v.
# Now that GLA with K or V of size 1 is rewritten, two near misses are GLA there too: the loop's
# update shared by all heads at V = 1 (sum_h k_h v_h is then one key vector u, S_h = d_h S_h + u,
# GLA with k = u and v = 1), and a gate over V at K = 1 (each value column is then its own
# scalar recurrence: GLA with K = V = 1 and the value axis a batch axis). The recognizer leaves
# both alone, but a near miss must not be GLA.
_NEAR_MISS_SIZES = {
    "shared_heads": {"H": 2, "K": 2, "V": 2},
    "gate_over_v": {"V": 2, "K": 2},
    "normalized": {"K": 2},
    "delta": {"K": 2},
    "rwkv6": {"T": 3},
}


def categories() -> list:
    """(name, weight, strategy) per category. The fuzz draws from each in proportion to its
    weight: one strategy over all of them, at a few hundred draws, left some near misses out."""
    from fuzz_new_forms import new_form_categories  # (these import this module)
    from fuzz_retention import RETENTION_MUTATIONS, retention_program

    cats = [
        ("loop", 30, loop_program()),
        ("parallel", 26, parallel_program()),
        ("parallel-reverse", 8, parallel_program(reverse=True)),
        ("parallel-reverse/triu", 2, parallel_program(mutation="triu", reverse=True)),
        ("parallel-reverse/strict", 2, parallel_program(mutation="strict", reverse=True)),
        ("decode", 9, loop_program(decode=True)),
        ("retention", 10, retention_program()),
    ]
    cats += [(f"retention/{m}", 2, retention_program(mutation=m)) for ms in RETENTION_MUTATIONS.values() for m in ms]
    cats += [(f"loop/{m}", 2, loop_program(mutation=m)) for ms in LOOP_MUTATIONS.values() for m in ms]
    cats += [(f"parallel/{m}", 2, parallel_program(mutation=m)) for ms in PAR_MUTATIONS.values() for m in ms]
    return cats + new_form_categories()
