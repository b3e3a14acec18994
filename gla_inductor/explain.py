"""`gla_inductor.explain(fn, *args, **kwargs)`: what the backend rewrote, and what it left alone."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .backend import _listeners, backend as gla_backend


@dataclass
class MatchInfo:
    form: str
    gate: str
    layout: str
    shapes: dict
    options: dict
    source: list


@dataclass
class NearMissInfo:
    form: str
    reason: str
    source: list


@dataclass
class Report:
    matches: list = field(default_factory=list)
    near_misses: list = field(default_factory=list)
    graphs: int = 0
    rewrite_seconds: float = 0.0

    def __str__(self) -> str:
        lines = [
            f"gla_inductor: {len(self.matches)} rewrite(s), {len(self.near_misses)} near miss(es) "
            f"in {self.graphs} graph(s); recognition took {self.rewrite_seconds * 1000:.1f} ms"
        ]
        if self.matches:
            lines.append("")
            lines.append(_table(
                ["#", "form", "gate", "layout", "shapes", "options", "source"],
                [
                    [str(i), m.form, m.gate, m.layout, _shapes(m.shapes), _options(m.options),
                     m.source[0] if m.source else "?"]
                    for i, m in enumerate(self.matches)
                ],
            ))
        if self.near_misses:
            lines.append("")
            lines.append("left alone:")
            lines.append(_table(
                ["#", "form", "reason", "source"],
                [[str(i), n.form, n.reason, n.source[0] if n.source else "?"] for i, n in enumerate(self.near_misses)],
            ))
        return "\n".join(lines)


def explain(fn, *args, **kwargs) -> Report:
    """Compile `fn` with the backend, run it once on the arguments, and report."""
    report = Report()

    def listen(gm, result):
        report.graphs += 1
        report.rewrite_seconds += result.seconds
        for m in result.matches:
            report.matches.append(MatchInfo(m.form, m.gate, m.layout, m.shapes, m.options, m.source_lines()))
        for n in result.near_misses:
            report.near_misses.append(NearMissInfo(n.form, n.reason, n.source_lines()))

    # A fresh backend object makes Dynamo compile again rather than reuse an earlier entry.
    def explain_backend(gm, example_inputs, **kw):
        return gla_backend(gm, example_inputs, **kw)

    _listeners.append(listen)
    try:
        torch.compile(fn, backend=explain_backend)(*args, **kwargs)
    finally:
        _listeners.remove(listen)
    return report


def _options(options: dict) -> str:
    """What the op does besides the plain forward map: reverse time, an initial state read,
    the final state produced."""
    names = {"reverse": "reverse", "initial_state": "h0", "final_state": "ht"}
    return " ".join(name for key, name in names.items() if options.get(key)) or "-"


def _shapes(shapes: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in shapes.items())


def _table(header: list, rows: list) -> str:
    widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
    fmt = "  ".join("{:<%d}" % w for w in widths)
    out = [fmt.format(*header), fmt.format(*["-" * w for w in widths])]
    out += [fmt.format(*r) for r in rows]
    return "\n".join(out)
