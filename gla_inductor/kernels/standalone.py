"""Render the GLA jinja templates as plain ``@triton.jit`` kernels, without Inductor.

The templates are written for Inductor's ``TritonTemplate`` and call its jinja helpers. This module
gives the same helpers a plain-Triton meaning, so the same sources also run outside torch.compile:

  def_kernel(*names)  the ``@triton.jit`` signature: one pointer per name, then the main output
                      ``out_ptr0``, then every size and stride the body asked for, as scalar
                      arguments. Time sizes (dim 1) are ``do_not_specialize``, so a new T reuses
                      the kernel; head counts and head dims are specialized like any int argument
                      (on divisibility by 16). That matters: masks along K and V are then constant
                      over 16 elements, so loads vectorize and the loop pipeliner turns them into
                      asynchronous copies; with unspecialized sizes every masked load was a 2-byte
                      load per element, issued synchronously inside the chunk loop.
  size(name, i)       the scalar argument ``{name}_size_{i}``
  stride(name, i)     the scalar argument ``{name}_stride_{i}``; without i, all of them, comma separated
  store_output(...)   a ``tl.store`` of the value into ``out_ptr0`` at the given indices

Options reach the source twice, as ``TritonTemplate.generate`` passes its kwargs: as jinja variables
(for code that must vanish, such as an absent input) and as ``NAME: tl.constexpr = value`` lines at
the top of the body. ``INDEX_DTYPE`` is added the same way. Each rendered source is written to a
file (Triton reads a kernel's source back from disk) and imported once per process.
"""

import functools
import hashlib
import importlib.util
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import jinja2
import torch

__all__ = ["OUT", "ScalarArg", "StandaloneKernel", "load_template", "needs_int64", "render", "render_source",
           "specialization_key"]

TEMPLATE_DIR = Path(__file__).parent / "templates"
OUT = "out_ptr0"  # the main output's argument name, as in Inductor's generated kernels
_DEF_KERNEL = "<GLA_DEF_KERNEL>"  # placeholder: the signature is known only after the body rendered


def needs_int64(x: torch.Tensor) -> bool:
    """Whether an offset from x's data pointer may pass int32. Bounded by its storage's size (the
    exact largest offset, summed over dims, took ~40% of a launch's host time)."""
    return x.untyped_storage().nbytes() // x.element_size() >= 2**31


@functools.cache
def load_template(name: str) -> str:
    """Source of ``templates/<name>.py.jinja``."""
    return (TEMPLATE_DIR / f"{name}.py.jinja").read_text()


@dataclass(frozen=True)
class ScalarArg:
    """One size or stride the kernel takes as a scalar argument."""

    tensor: str
    kind: str  # "size" | "stride"
    dim: int

    @property
    def name(self) -> str:
        return f"{self.tensor}_{self.kind}_{self.dim}"


class _Helpers:
    """The jinja helpers for one render; records the pointers and scalars the body used."""

    def __init__(self, ndims: Mapping[str, int]):
        self.ndims = dict(ndims)
        self.pointers: tuple[str, ...] = ()
        self.scalars: dict[str, ScalarArg] = {}

    def def_kernel(self, *names: str) -> str:
        unknown = [n for n in (*names, OUT) if n not in self.ndims]
        if unknown:
            raise KeyError(f"no rank given for {unknown}")
        self.pointers = names
        return _DEF_KERNEL

    def _scalar(self, tensor: str, kind: str, dim: int) -> str:
        arg = ScalarArg(tensor, kind, dim)
        self.scalars.setdefault(arg.name, arg)
        return arg.name

    def size(self, name: str | None, index: int) -> str:
        return self._scalar(name or OUT, "size", index)

    def stride(self, name: str | None, index: int | None = None) -> str:
        name = name or OUT
        if index is None:
            return ", ".join(self._scalar(name, "stride", d) for d in range(self.ndims[name]))
        return self._scalar(name, "stride", index)

    def store_output(self, indices, val, mask=None, indent_width=4, val_shape=None, block_indexing=False) -> str:
        offset = " + ".join(f"({idx}) * {self.stride(OUT, d)}" for d, idx in enumerate(indices))
        mask_arg = f", mask={mask}" if mask else ""
        return f"tl.store({OUT} + {offset}, ({val}).to({OUT}.dtype.element_ty){mask_arg})"

    def header(self, kernel_name: str, defines: Mapping[str, Any]) -> str:
        args = [*self.pointers, OUT, *self.scalars]
        sizes = [a.name for a in self.scalars.values() if a.kind == "size" and a.dim == 1]
        lines = [
            "import triton",
            "import triton.language as tl",
            "",
            "",
            f"@triton.jit(do_not_specialize={sizes!r})",
            f"def {kernel_name}({', '.join(args)}):",
        ]
        lines += [f"    {name}: tl.constexpr = {value}" for name, value in defines.items()]
        return "\n".join(lines)


def render_source(
    template_names: Sequence[str],
    kernel_name: str,
    options: Mapping[str, Any],
    ndims: Mapping[str, int],
    int64_index: bool = False,
) -> tuple[str, _Helpers]:
    """The kernel module's source and the helpers that recorded its arguments.

    ``template_names`` are concatenated in order (the kernel first, then its ``@triton.jit`` helpers);
    ``ndims`` gives the rank of every tensor the template may name, ``OUT`` included.
    """
    helpers = _Helpers(ndims)
    env = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    template = env.from_string("\n".join(load_template(n) for n in template_names))
    body = template.render(
        def_kernel=helpers.def_kernel,
        size=helpers.size,
        stride=helpers.stride,
        store_output=helpers.store_output,
        **options,
    )
    defines = {**options, "INDEX_DTYPE": "tl.int64" if int64_index else "tl.int32"}
    return body.replace(_DEF_KERNEL, helpers.header(kernel_name, defines), 1), helpers


def specialization_key(args: Sequence[Any]) -> tuple:
    """What Triton specializes a launch's compiled kernel on, per argument, or finer: a tensor's dtype
    and 16-byte alignment, an int's equality to 1, divisibility by 16 and width (i32, i64 or u64),
    the type of anything else. Launches with equal keys can run the same compiled kernel."""
    return tuple(
        (a.dtype, a.data_ptr() % 16 == 0) if isinstance(a, torch.Tensor)
        else (a == 1, a % 16 == 0, -2**31 <= a < 2**31, a < 2**63) if type(a) is int
        else type(a)
        for a in args
    )


@dataclass(frozen=True)
class StandaloneKernel:
    """A rendered kernel and the order in which it takes its arguments."""

    fn: Any  # triton JITFunction (or InterpretedFunction under TRITON_INTERPRET=1)
    pointers: tuple[str, ...]
    scalars: tuple[ScalarArg, ...]
    source: str
    # compiled kernels by (warps, stages, current device, specialization_key): a launch whose key was seen
    # runs its compiled kernel directly, without JITFunction.run's binding, specialization and cache
    # lookup: host time a short eager forward notices (benchmarks/results/h100-2026-11-23-launch.md)
    compiled: dict = field(default_factory=dict, compare=False, repr=False)

    def __call__(self, grid, tensors: Mapping[str, torch.Tensor], out: torch.Tensor, *, num_warps: int,
                 num_stages: int) -> None:
        named = {**tensors, OUT: out}
        args: list[Any] = [named[n] for n in self.pointers]
        args.append(out)
        # one stride() call per tensor, not one per scalar: a launch takes ~30 sizes and strides of
        # ~8 tensors, and its host time matters where the GPU work is short (eager calls)
        dims = {n: {"size": t.shape, "stride": t.stride()} for n, t in named.items()}
        args += [dims[s.tensor][s.kind][s.dim] for s in self.scalars]
        if out.device.type != "cuda":  # the interpreter
            self.fn[grid](*args, num_warps=num_warps, num_stages=num_stages)
            return
        # Triton keeps its compiled kernels per current device too
        key = (num_warps, num_stages, torch.cuda.current_device(), specialization_key(args))
        kernel = self.compiled.get(key)
        if kernel is None:
            kernel = self.fn[grid](*args, num_warps=num_warps, num_stages=num_stages)
            self.compiled[key] = kernel
        else:
            kernel[(*grid, 1, 1)[:3]](*args)  # the compiled kernel's launcher wants all three grid sizes


def _kernel_dir() -> Path:
    return Path(tempfile.gettempdir()) / "gla_inductor_kernels"


# keyed by (source, interpreted): the same source decorates into a JITFunction or, under
# TRITON_INTERPRET=1, an InterpretedFunction
_BY_SOURCE: dict[tuple[str, bool], StandaloneKernel] = {}


def _import_kernel(source: str, kernel_name: str) -> Any:
    digest = hashlib.sha256(source.encode()).hexdigest()[:24]
    path = _kernel_dir() / f"{kernel_name}_{digest}.py"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(source)
        os.replace(tmp, path)
    spec = importlib.util.spec_from_file_location(f"gla_inductor_kernels.{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, kernel_name)


@functools.lru_cache(maxsize=None)
def _render_cached(template_names, kernel_name, options, ndims, int64_index, interpreted) -> StandaloneKernel:
    source, helpers = render_source(template_names, kernel_name, dict(options), dict(ndims), int64_index)
    kernel = _BY_SOURCE.get((source, interpreted))
    if kernel is None:
        kernel = StandaloneKernel(_import_kernel(source, kernel_name), helpers.pointers,
                                  tuple(helpers.scalars.values()), source)
        _BY_SOURCE[source, interpreted] = kernel
    return kernel


def render(
    template_names: Sequence[str],
    kernel_name: str,
    options: Mapping[str, Any],
    ndims: Mapping[str, int],
    int64_index: bool = False,
) -> StandaloneKernel:
    """The jit kernel for these options, rendered and imported once per process (cached by source)."""
    return _render_cached(tuple(template_names), kernel_name, tuple(sorted(options.items())),
                          tuple(sorted(ndims.items())), int64_index, os.environ.get("TRITON_INTERPRET") == "1")
