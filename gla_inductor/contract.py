"""What a GLA call is: one frozen record that every stage reads by name, and the rules of the op.

    o_t = scale * q_t S_t,   S_t = diag(exp(g_t)) S_{t-1} + k_t^T v_t

Recognizers describe what they found as a ``GLACall`` of graph nodes, the emitter turns it into the
op's arguments (``op_args``), the custom ops turn their arguments back into a ``GLACall`` of tensors
(``from_op_args``), and dispatch, the implementations, the kernels and the lowerings read its fields.
Nobody indexes op arguments by position: adding an argument (packed-sequence offsets, state-pool
indices) means adding a field here and a name to the schema tuple.

The rules shared by every implementation live here too: gate kinds, grouped heads, dtypes, and the
validation of the public functions' inputs.
"""

from __future__ import annotations

import dataclasses
import weakref
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
from torch import Tensor

from .gates import GateFn, check_gate_name, log_gate

__all__ = [
    "CHUNK_BWD_ARGS", "CHUNK_FWD_ARGS", "CHUNK_STATES_ARGS", "FINAL_STATE_ARGS", "FLOAT_DTYPES", "GLACall",
    "LayoutWarning", "RECURRENT_ARGS", "check_shape", "check_tensor", "compute_dtype", "gate_kind", "group_size",
    "output_dtype", "repeat_groups", "sum_groups", "validate_gate", "validate_inputs", "validate_varlen",
]

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

# The ops' schemas, argument by argument (their implementations' signatures must match: a test checks).
CHUNK_FWD_ARGS = ("q", "k", "v", "g", "g_gamma", "initial_state", "scale", "output_final_state", "reverse",
                  "gate_fn", "gate_scale", "gate_lo", "gate_hi", "gate_a", "gate_bias", "cu_seqlens")
CHUNK_BWD_ARGS = ("q", "k", "v", "g", "g_gamma", "initial_state", "do", "dht", "scale", "reverse",
                  "gate_fn", "gate_scale", "gate_lo", "gate_hi", "gate_a", "gate_bias", "cu_seqlens")
RECURRENT_ARGS = ("q", "k", "v", "g", "g_gamma", "state", "scale", "reverse", "state_indices")
# chunk_final_state (and chunk_sums): a run's state from zero, or with do its dual, and the decay
FINAL_STATE_ARGS = ("q", "k", "v", "g", "g_gamma", "do", "scale", "reverse", "gate_fn", "gate_scale", "gate_lo",
                    "gate_hi", "gate_a", "gate_bias")
# chunk_fwd_states: the forward with the prefix states every state_interval steps (inference only)
CHUNK_STATES_ARGS = ("q", "k", "v", "g", "g_gamma", "initial_state", "scale", "state_interval",
                     "gate_fn", "gate_scale", "gate_lo", "gate_hi", "gate_a", "gate_bias", "cu_seqlens")

# Values of the trailing arguments that a call may leave out (the schemas' defaults).
_DEFAULTS = {"gate_fn": "", "gate_scale": 1.0, "gate_lo": None, "gate_hi": None, "gate_a": None, "gate_bias": None,
             "cu_seqlens": None, "state_indices": None}
# The defaulted tails of the schemas, in order: a call's arguments leave out each group whose
# values are all defaults, from the end (graphs print the op calls; a call without packed sequences
# or pool indices keeps the arguments it has always had).
_GATE_GROUP = ("gate_fn", "gate_scale", "gate_lo", "gate_hi", "gate_a", "gate_bias")
_OPTIONAL_GROUPS = (_GATE_GROUP, ("cu_seqlens",), ("state_indices",))


@dataclass(frozen=True, eq=False)  # tensors compare elementwise: a call is equal only to itself
class GLACall:
    """One GLA computation. The tensor fields hold tensors, graph nodes or IR nodes, whichever the
    stage works with; ``gate_kind`` and ``group_size`` read shapes from any of them.

    q, k: [B, T, G, K] with G dividing H (grouped heads; G == H usually); v: [B, T, H, V];
    g: log gate [B, T, H, K] (vector) or [B, T, H] (scalar), or, with a fused ``gate``, that
    function's input; g_gamma: [H] constant log gate; initial_state: [B, H, K, V];
    gate_a [H], gate_bias [H] or [H, K]: the parameters of a "softplus" gate.
    state_indices: [B] int32/int64 slots of a state pool (``fused_recurrent`` only): initial_state is
    then a pool [P, H, K, V] and sequence b reads and writes slot state_indices[b]; an index outside
    [0, P) marks a padded batch entry (output zeros, no slot touched).
    cu_seqlens: packed sequences, int32/int64 offsets [N + 1] (any device): B == 1, sequence n is
    steps cu_seqlens[n] to cu_seqlens[n + 1] - 1, run as if alone; initial_state and the final
    state are then [N, H, K, V].
    """

    q: Any
    k: Any
    v: Any
    g: Any = None
    g_gamma: Any = None
    initial_state: Any = None
    scale: float = 1.0
    output_final_state: bool = False
    reverse: bool = False
    gate: GateFn = GateFn()  # a NamedTuple: Dynamo must wrap every default (see gates.GateFn)
    gate_a: Any = None
    gate_bias: Any = None
    cu_seqlens: Any = None
    state_indices: Any = None

    # ---- derived facts --------------------------------------------------------------------------
    @property
    def gate_kind(self) -> str:
        """"vector", "scalar", "constant" or "none"."""
        return gate_kind(self.g, self.g_gamma)

    @property
    def group_size(self) -> int:
        """Heads of v per head of q and k."""
        return group_size(self.q, self.v)

    @property
    def varlen(self) -> bool:
        """Whether the call runs packed sequences (``cu_seqlens``)."""
        return self.cu_seqlens is not None

    @property
    def num_sequences(self) -> int:
        """N: the sequences of a packed call, else the batch size B."""
        return _shape(self.cu_seqlens)[0] - 1 if self.varlen else _shape(self.q)[0]

    @property
    def fused_gate(self) -> bool:
        return bool(self.gate.name)

    @property
    def compute_dtype(self) -> torch.dtype:
        return compute_dtype(self.q, self.k, self.v, self.g, self.g_gamma, self.initial_state, self.gate_a,
                             self.gate_bias)

    @property
    def output_dtype(self) -> torch.dtype:
        return output_dtype(self.q, self.k, self.v)

    @property
    def state_dtype(self) -> torch.dtype:
        """dtype of the final state: fp32, or fp64 when the op computes in fp64."""
        return compute_dtype(self.q, self.k, self.v, self.g, self.g_gamma, self.initial_state)

    def tensors(self) -> dict[str, Any]:
        """The tensor inputs by name, absent ones included as None."""
        return dict(q=self.q, k=self.k, v=self.v, g=self.g, g_gamma=self.g_gamma, initial_state=self.initial_state,
                    gate_a=self.gate_a, gate_bias=self.gate_bias)

    def replace(self, **changes) -> "GLACall":
        return dataclasses.replace(self, **changes)

    def with_log_gate(self) -> "GLACall":
        """The same call with a fused gate function applied: g becomes the log gate itself, computed
        in the compute dtype (the PyTorch implementations read log gates)."""
        if not self.fused_gate:
            return self
        g = log_gate(self.g, self.gate, self.gate_a, self.gate_bias, self.compute_dtype)
        return self.replace(g=g, gate=GateFn(), gate_a=None, gate_bias=None)

    # ---- the ops' arguments ---------------------------------------------------------------------
    def _named(self, **extra) -> dict[str, Any]:
        fn = self.gate
        return dict(self.tensors(), scale=_number(self.scale), output_final_state=bool(self.output_final_state),
                    reverse=bool(self.reverse), gate_fn=fn.name, gate_scale=fn.scale, gate_lo=fn.lo, gate_hi=fn.hi,
                    cu_seqlens=self.cu_seqlens, state_indices=self.state_indices, **extra)

    def op_args(self, full: bool = False) -> tuple:
        """``chunk_fwd``'s positional arguments, the fused gate's left out where they are all
        defaults (unless ``full``), cu_seqlens where it is None."""
        return _positional(CHUNK_FWD_ARGS, self._named(), trim=not full)

    def bwd_op_args(self, do, dht) -> tuple:
        """``chunk_bwd``'s positional arguments for the output gradients do and dht."""
        return _positional(CHUNK_BWD_ARGS, self._named(do=do, dht=dht))

    def final_state_op_args(self, do=None) -> tuple:
        """``chunk_final_state``'s (and ``chunk_sums``') arguments, all of them: the dual's with do."""
        return _positional(FINAL_STATE_ARGS, self._named(do=do), trim=False)

    def states_op_args(self, state_interval: int) -> tuple:
        """``chunk_fwd_states``'s arguments, all of them."""
        return _positional(CHUNK_STATES_ARGS, self._named(state_interval=int(state_interval)), trim=False)

    def recurrent_op_args(self, state) -> tuple:
        """``fused_recurrent``'s arguments: the state it reads and overwrites takes initial_state's place;
        state_indices only when given (without them, the 8 arguments the op has always been called with)."""
        return _positional(RECURRENT_ARGS, self._named(state=state))

    @classmethod
    def from_op_args(cls, args: Sequence, kwargs: Optional[dict] = None, names: Sequence[str] = CHUNK_FWD_ARGS
                     ) -> "GLACall":
        """The call that op arguments (positional and keyword, by the schema ``names``) describe;
        extra arguments of the schema (do, dht) are ignored, a fused_recurrent's state is the
        initial state."""
        named = dict(_DEFAULTS, **dict(zip(names, args)), **(kwargs or {}))
        if "state" in named:
            named["initial_state"] = named.pop("state")
        gate = GateFn(named["gate_fn"], _number(named["gate_scale"]), named["gate_lo"], named["gate_hi"])
        return cls(q=named["q"], k=named["k"], v=named["v"], g=named.get("g"), g_gamma=named.get("g_gamma"),
                   initial_state=named.get("initial_state"), scale=named.get("scale", 1.0),
                   output_final_state=bool(named.get("output_final_state", "state" in names)),
                   reverse=bool(named.get("reverse", False)), gate=gate, gate_a=named["gate_a"],
                   gate_bias=named["gate_bias"], cu_seqlens=named.get("cu_seqlens"),
                   state_indices=named["state_indices"])


def _number(x):
    """A Python number as a float; a number computed in the graph (a node, a SymFloat) as it is."""
    return float(x) if isinstance(x, (int, float)) else x


def _positional(names: Sequence[str], named: dict, trim: bool = True) -> tuple:
    """The arguments in schema order, each of the schema's defaulted groups (``_OPTIONAL_GROUPS``)
    left out from the end while all its values are defaults, as the op calls of the graphs have
    always been written: the fused gate's only where trim, cu_seqlens whenever it is None."""
    args = [named[n] for n in names]
    for group in reversed(_OPTIONAL_GROUPS):
        index = [names.index(n) for n in group if n in names]
        if not index:  # not a group of this schema
            continue
        if index[-1] != len(args) - 1 or group == _GATE_GROUP and not trim:
            break
        if not all(_is_default(args[i], _DEFAULTS[names[i]]) for i in index):
            break
        args = args[:index[0]]
    return tuple(args)


def _is_default(x, default) -> bool:
    return x is None if default is None else type(x) is type(default) and x == default


# ----------------------------------------------------------------------------------------------
# shapes of tensors, graph nodes and IR nodes alike
# ----------------------------------------------------------------------------------------------


def _shape(x) -> tuple:
    if hasattr(x, "shape"):
        return tuple(x.shape)
    if hasattr(x, "meta"):  # an fx node
        val = x.meta.get("val", x.meta.get("example_value"))
        return tuple(val.shape)
    return tuple(x.get_size())  # an Inductor IR node


def gate_kind(g, g_gamma) -> str:
    if g is not None:
        return "vector" if len(_shape(g)) == 4 else "scalar"
    return "constant" if g_gamma is not None else "none"


# ----------------------------------------------------------------------------------------------
# grouped heads: q, k [B, T, G, K] shared by groups of H / G heads of v (GQA; Mamba2's C and B)
# ----------------------------------------------------------------------------------------------


def group_size(q, v) -> int:
    """Heads of v per head of q and k: head h reads q/k head h // group_size, the order of
    ``x.repeat_interleave(group_size, dim=2)``. 1 when they have as many heads."""
    G, H = _shape(q)[2], _shape(v)[2]
    return H // G if G else 1


def repeat_groups(x: Tensor, H: int) -> Tensor:
    """q or k [B, T, G, D] repeated to H heads (repeat_interleave order); x itself when G == H."""
    G = x.shape[2]
    return x if G == H else x.repeat_interleave(H // G, dim=2)


def sum_groups(dx: Tensor, G: int, dtype: torch.dtype) -> Tensor:
    """Per-head gradients [B, T, H, D] of a q or k shared by groups of heads, summed over each group
    to [B, T, G, D] in dtype (the transpose of ``repeat_groups``; at least fp32 accumulation). dx
    itself, cast, when G == H."""
    if dx.shape[2] == G:
        return dx if dx.dtype == dtype else dx.to(dtype)
    acc = torch.promote_types(dx.dtype, torch.float32)
    return dx.unflatten(2, (G, -1)).sum(3, dtype=acc).to(dtype)


# ----------------------------------------------------------------------------------------------
# dtypes
# ----------------------------------------------------------------------------------------------


def compute_dtype(*tensors: Optional[Tensor]) -> torch.dtype:
    # fp64 oracles must stay fp64 end to end; every other dtype accumulates in fp32
    if any(t is not None and t.dtype == torch.float64 for t in tensors):
        return torch.float64
    return torch.float32


def output_dtype(q: Tensor, k: Tensor, v: Tensor) -> torch.dtype:
    return torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)


# ----------------------------------------------------------------------------------------------
# validation of the public functions' inputs (the ops themselves trust their callers)
# ----------------------------------------------------------------------------------------------


class LayoutWarning(UserWarning):
    """The inputs' sizes suggest another layout than the one a function reads them in."""


def _shape_str(dims) -> str:
    return "[" + ", ".join(str(d) for d in dims) + "]"


def check_tensor(api: str, name: str, x) -> None:
    if not isinstance(x, Tensor):
        raise TypeError(f"{api}: {name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{api}: {name} has dtype {x.dtype}; expected float16, bfloat16, float32 or float64")


def check_shape(api: str, name: str, x: Tensor, q: Tensor, layout: str, expected: tuple) -> None:
    """Raise unless x has the ``expected`` shape; None entries of ``expected`` are free."""
    if x.dim() == len(expected) and all(e is None or d == e for d, e in zip(x.shape, expected)):
        return
    letters = layout.strip("[]").split(", ")
    want = _shape_str(letter if e is None else e for letter, e in zip(letters, expected))
    raise ValueError(
        f"{api}: {name} has shape {tuple(x.shape)} but q has shape {tuple(q.shape)}; "
        f"expected {name} to be {layout} = {want}"
    )


def _check_groups(api: str, q: Tensor, k: Tensor, v: Tensor) -> None:
    """Grouped heads: k shaped like q, [B, T, G, K], and v [B, T, H, V] with H a multiple of G."""
    B, T, G, K = q.shape
    if k.dim() == 4 and k.shape[:2] == (B, T) and k.shape[2] != G and k.shape[3] == K:
        raise ValueError(
            f"{api}: k has shape {tuple(k.shape)} but q has shape {tuple(q.shape)}; expected k to be "
            f"[B, T, G, K] = {_shape_str((B, T, G, K))}: q and k must have the same number of heads G "
            "(each shared by H / G heads of v)")
    check_shape(api, "k", k, q, "[B, T, H, K]", (B, T, G, K))
    H = v.shape[2] if v.dim() == 4 else -1
    if v.dim() == 4 and v.shape[:2] == (B, T) and (H == G or G > 0 and H > 0 and H % G == 0):
        return
    raise ValueError(
        f"{api}: v has shape {tuple(v.shape)} but q has shape {tuple(q.shape)}; expected v to be "
        f"[B, T, H, V] = {_shape_str((B, T, G, 'V'))}, or with H any multiple of q and k's {G} heads "
        f"(grouped heads: head h reads q/k head h // (H / {G}))")


def validate_inputs(q, k, v, g, g_gamma, initial_state, *, api: str = "chunk_gla", grouped: bool = False,
                    cu_seqlens=None) -> None:
    """Clear errors naming the tensor and the shape expected, prefixed by the public function ``api``.
    With grouped, q and k may have fewer heads than v (a divisor of v's). With cu_seqlens (checked
    first by ``validate_varlen``), initial_state holds one state per sequence."""
    named = {"q": q, "k": k, "v": v, "g": g, "g_gamma": g_gamma, "initial_state": initial_state}
    for name, x in named.items():
        if x is not None or name in ("q", "k", "v"):
            check_tensor(api, name, x)
    if q.dim() != 4:
        raise ValueError(f"{api}: q has shape {tuple(q.shape)}; expected q to be 4-D [B, T, H, K]")
    B, T, H, K = q.shape
    if grouped:
        _check_groups(api, q, k, v)
        H = v.shape[2]
    else:
        check_shape(api, "k", k, q, "[B, T, H, K]", (B, T, H, K))
        check_shape(api, "v", v, q, "[B, T, H, V]", (B, T, H, None))
    if g is not None and g_gamma is not None:
        raise ValueError(f"{api}: got both g and g_gamma; pass at most one gate")
    if g is not None and g.dim() == 3:
        check_shape(api, "g", g, q, "[B, T, H]", (B, T, H))
    elif g is not None and g.dim() == 4:
        check_shape(api, "g", g, q, "[B, T, H, K]", (B, T, H, K))
    elif g is not None:
        raise ValueError(
            f"{api}: g has shape {tuple(g.shape)} but q has shape {tuple(q.shape)}; expected g to be "
            f"[B, T, H, K] = {_shape_str((B, T, H, K))} (vector gate) or [B, T, H] = {_shape_str((B, T, H))} "
            "(scalar gate)"
        )
    if g_gamma is not None:
        check_shape(api, "g_gamma", g_gamma, q, "[H]", (H,))
    if initial_state is not None and cu_seqlens is None:
        check_shape(api, "initial_state", initial_state, q, "[B, H, K, V]", (B, H, K, v.shape[-1]))
    elif initial_state is not None:
        check_shape(api, "initial_state", initial_state, q, "[N, H, K, V]",
                     (cu_seqlens.shape[0] - 1, H, K, v.shape[-1]))
    for name, x in named.items():
        if x is not None and x.device != q.device:
            raise ValueError(
                f"{api}: {name} is on {x.device} but q is on {q.device}; all tensors must share one device"
            )


def validate_gate(fn: GateFn, q: Tensor, g: Optional[Tensor], gate_a, gate_bias, *, api: str = "chunk_gla") -> None:
    """Clear errors for a fused gate's inputs."""
    check_gate_name(fn.name, api)
    if not fn.name:
        if gate_a is not None or gate_bias is not None:
            raise ValueError(f"{api}: gate_a and gate_bias need gate_fn='softplus'")
        return
    if g is None:
        raise ValueError(f"{api}: gate_fn={fn.name!r} needs g, the gate function's input")
    if fn.name == "logsigmoid" and (gate_a is not None or gate_bias is not None):
        raise ValueError(f"{api}: gate_a and gate_bias belong to gate_fn='softplus'")
    if fn.name == "softplus":
        H = g.shape[2]  # v's heads (q's may be fewer)
        heads = tuple(g.shape[2:])
        layout = "[H]" if g.dim() == 3 else "[H, K]"
        for name, x, want, want_layout in (("gate_a", gate_a, (H,), "[H]"), ("gate_bias", gate_bias, heads, layout)):
            if x is None:
                raise ValueError(f"{api}: gate_fn='softplus' needs {name} {want_layout} = {_shape_str(want)}")
            check_tensor(api, name, x)
            if tuple(x.shape) != want:
                raise ValueError(f"{api}: {name} has shape {tuple(x.shape)}; expected {want_layout} = "
                                 f"{_shape_str(want)} for g of shape {tuple(g.shape)}")
            if x.device != q.device:
                raise ValueError(f"{api}: {name} is on {x.device} but q is on {q.device}")


def validate_varlen(q, cu_seqlens, initial_state, *, api: str = "chunk_gla", host_copy=None) -> None:
    """Clear errors for packed sequences: cu_seqlens an integer tensor [N + 1] of offsets from 0 up
    to T, never decreasing (sequences of length 0 are allowed), q [1, T, H, K], initial_state
    [N, H, K, V]. The offsets' values are read where that costs no synchronization with a device
    that may be capturing a CUDA graph: on the CPU, or outside graph capture and compilation (one
    device-to-host copy for each new offsets tensor: ``_checked_before``). ``host_copy`` (FLA's
    cu_seqlens_cpu, a CPU tensor like cu_seqlens) is read instead of cu_seqlens."""
    _check_offsets_tensor(api, "cu_seqlens", cu_seqlens)
    if host_copy is not None:
        _check_offsets_tensor(api, "cu_seqlens_cpu", host_copy)
        if host_copy.device.type != "cpu" or host_copy.shape != cu_seqlens.shape:
            raise ValueError(f"{api}: cu_seqlens_cpu is a {host_copy.device.type} tensor of shape "
                             f"{tuple(host_copy.shape)}; expected a CPU copy of cu_seqlens, shape "
                             f"{tuple(cu_seqlens.shape)}")
    N = cu_seqlens.shape[0] - 1
    if isinstance(q, Tensor) and q.dim() == 4 and q.shape[0] != 1:
        raise ValueError(f"{api}: q has shape {tuple(q.shape)}; with cu_seqlens the sequences are packed along "
                         f"time: expected q to be [1, T, H, K] = {_shape_str((1, 'T', *q.shape[2:]))}")
    if isinstance(initial_state, Tensor) and initial_state.dim() >= 1 and initial_state.shape[0] != N:
        raise ValueError(f"{api}: initial_state has shape {tuple(initial_state.shape)} but cu_seqlens holds "
                         f"N = {N} sequences; expected initial_state to be [N, H, K, V] with N = {N}")
    T = q.shape[1] if isinstance(q, Tensor) and q.dim() == 4 else None
    offsets = cu_seqlens if host_copy is None else host_copy
    if _offsets_readable(offsets) and not _checked_before(offsets, T):
        values = offsets.tolist()
        _check_offsets(api, values, T)
        longest = max(end - start for start, end in zip(values, values[1:]))
        _last_checked[:] = [weakref.ref(offsets), offsets._version, T, weakref.ref(cu_seqlens), longest]


def _check_offsets_tensor(api: str, name: str, offsets) -> None:
    if not isinstance(offsets, Tensor):
        raise TypeError(f"{api}: {name} must be a torch.Tensor, got {type(offsets).__name__}")
    if offsets.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{api}: {name} has dtype {offsets.dtype}; expected int32 or int64 offsets")
    if offsets.dim() != 1 or offsets.shape[0] < 2:
        raise ValueError(f"{api}: {name} has shape {tuple(offsets.shape)}; expected [N + 1], the offsets "
                         f"0 = {name}[0] <= ... <= {name}[N] = T of N >= 1 packed sequences")


# The offsets checked last (a weak reference, their version counter, T, then cu_seqlens itself and
# the longest sequence): the layers of a model called on one packed batch pass the same tensor,
# whose values are then read once, not once per layer (a GPU tensor's read waits for the device:
# the host could no longer run ahead of it).
_last_checked: list = [None, None, None, None, 0]


def _checked_before(cu_seqlens: Tensor, T) -> bool:
    ref, version, last_T = _last_checked[:3]
    return ref is not None and ref() is cu_seqlens and version == cu_seqlens._version and last_T == T


def packed_longest(cu_seqlens: Tensor, T) -> int:
    """The longest packed sequence's length, where ``validate_varlen`` read these offsets (or their
    cu_seqlens_cpu) on the host for a call of T steps; 0 where it did not (compiled code, offsets
    first seen during a CUDA-graph capture, offsets changed since). What the kernels' schedule may
    use: the kernels themselves never read the offsets on the host."""
    ref, version, last_T, seqlens, longest = _last_checked
    if seqlens is None or seqlens() is not cu_seqlens or last_T != T:
        return 0
    return longest if ref() is not cu_seqlens or version == cu_seqlens._version else 0


def _offsets_readable(cu_seqlens: Tensor) -> bool:
    if torch.compiler.is_compiling() or cu_seqlens.device.type == "meta":
        return False
    if cu_seqlens.is_cuda:
        return not torch.cuda.is_current_stream_capturing()
    return True


def _check_offsets(api: str, offsets: list[int], T: Optional[int]) -> None:
    if offsets[0] != 0:
        raise ValueError(f"{api}: cu_seqlens starts at {offsets[0]}; the first offset must be 0")
    for n, (start, end) in enumerate(zip(offsets, offsets[1:])):
        if end < start:
            raise ValueError(f"{api}: cu_seqlens decreases from {start} to {end} at entries {n} and {n + 1}; "
                             "offsets must not decrease (sequence n is steps cu_seqlens[n] to cu_seqlens[n + 1] - 1)")
    if T is not None and offsets[-1] != T:
        raise ValueError(f"{api}: cu_seqlens ends at {offsets[-1]} but q has T = {T} steps; the last offset must "
                         "be the packed length T")
