"""`gla_inductor.explain(fn, *args, **kwargs)`: what the backend rewrote, and what it left alone.

`print(report)` shows a table that fits 100 columns, with each source line as `file:line` and a
short excerpt; `report.to_dict()` gives everything, full source lines included, as plain data
(JSON-serializable) for tools.
"""

from __future__ import annotations

import math
import textwrap
from dataclasses import dataclass, field

import torch

from .backend import _listeners, backend as gla_backend

WIDTH = 100  # columns of the printed report
_ROLES = "BTHKV"  # the shape columns, in this order


@dataclass
class MatchInfo:
    form: str
    gate: str
    layout: str  # q's axes in role letters, as the code holds it: "bthk", "bhtk", ...
    shapes: dict
    options: dict
    source: list  # "file.py:LINE  code" of the user's lines behind the match
    note: str = ""  # the cost rule's measurement, where it timed the choice

    def to_dict(self) -> dict:
        return {
            "form": self.form,
            "gate": self.gate,
            "layout": self.layout,
            "shapes": {k: _plain(v) for k, v in self.shapes.items()},
            "options": {k: _plain(v) for k, v in self.options.items()},
            "source": [_source_dict(s) for s in self.source],
            "note": self.note,
        }


@dataclass
class NearMissInfo:
    form: str
    reason: str
    source: list

    def to_dict(self) -> dict:
        return {"form": self.form, "reason": self.reason, "source": [_source_dict(s) for s in self.source]}


@dataclass
class Report:
    matches: list = field(default_factory=list)
    near_misses: list = field(default_factory=list)
    graphs: int = 0
    rewrite_seconds: float = 0.0

    def to_dict(self) -> dict:
        """The report as plain data (dicts, lists, str, int, float, bool), for json.dumps."""
        return {
            "graphs": self.graphs,
            "rewrite_seconds": self.rewrite_seconds,
            "matches": [m.to_dict() for m in self.matches],
            "near_misses": [n.to_dict() for n in self.near_misses],
        }

    def __str__(self) -> str:
        lines = [
            f"gla_inductor: {len(self.matches)} rewrite(s), {len(self.near_misses)} near miss(es) "
            f"in {self.graphs} graph(s); recognition took {self.rewrite_seconds * 1000:.1f} ms"
        ]
        if self.matches:
            lines += ["", _matches_table(self.matches)]
            lines += [line for i, m in enumerate(self.matches) if m.note
                      for line in textwrap.wrap(f"#{i} {m.note}", WIDTH, subsequent_indent="    ")]
        if self.near_misses:
            lines += ["", "left alone:", _near_misses_table(self.near_misses)]
        return "\n".join(lines)


def explain(fn, *args, **kwargs) -> Report:
    """Compile `fn` with the backend, run it once on the arguments, and report."""
    report = Report()

    def listen(gm, result):
        report.graphs += 1
        report.rewrite_seconds += result.seconds
        for m in result.matches:
            report.matches.append(MatchInfo(m.form, m.gate, m.layout, m.shapes, m.options, m.source_lines(), m.note))
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


# ---- plain data ------------------------------------------------------------------------------
def _split_source(entry: str) -> tuple[str, int | None, str]:
    """(file, line, code) of a "file.py:LINE  code" entry (recognize.match.source_lines)."""
    where, _, code = entry.partition("  ")
    file, _, line = where.rpartition(":")
    if not file or not line.isdigit():
        return where, None, code.strip()
    return file, int(line), code.strip()


def _source_dict(entry: str) -> dict:
    file, line, code = _split_source(entry)
    return {"file": file, "line": line, "code": code}


def _plain(value):
    """A JSON-serializable stand-in: symbolic sizes become ints where known, else their text."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    try:
        return int(value)
    except (TypeError, ValueError, RuntimeError):
        return str(value)


# ---- the printed tables ----------------------------------------------------------------------
def _options(options: dict) -> str:
    """What the op does besides the plain forward map: reverse time, an initial state read,
    the final state produced."""
    names = {"reverse": "reverse", "initial_state": "h0", "final_state": "ht"}
    return ",".join(name for key, name in names.items() if options.get(key)) or "-"


def _excerpt(entry: str, width: int) -> str:
    """`file:line  code`, the code cut to fit `width` (the file's name cut from the left if even
    `file:line` does not fit)."""
    file, line, code = _split_source(entry)
    where = f"{file}:{line}" if line is not None else file
    if len(where) > width:
        return "..." + where[len(where) - width + 3 :]
    text = f"{where}  {code}" if code else where
    return text if len(text) <= width else text[: max(len(where), width - 3)] + "..."


def _matches_table(matches: list) -> str:
    roles = [r for r in _ROLES if any(r in m.shapes for m in matches)]
    roles += sorted({k for m in matches for k in m.shapes} - set(roles))
    header = ["#", "form", "gate", "layout", *roles, "options", "source"]
    rows = [[str(i), m.form, m.gate, m.layout or "?", *(str(m.shapes.get(r, "")) for r in roles),
             _options(m.options)] for i, m in enumerate(matches)]
    source_width = _source_width(header, rows)
    for row, m in zip(rows, matches):
        row.append(_excerpt(m.source[0], source_width) if m.source else "?")
    return _table(header, rows)


def _near_misses_table(near_misses: list) -> str:
    """One row per near miss (form, source), its reason wrapped below it."""
    header = ["#", "form", "source"]
    rows = [[str(i), n.form] for i, n in enumerate(near_misses)]
    source_width = _source_width(header, rows)
    for row, n in zip(rows, near_misses):
        row.append(_excerpt(n.source[0], source_width) if n.source else "?")
    indent = " " * (len(str(len(near_misses) - 1)) + 2)
    lines = _table(header, rows).split("\n")
    out = lines[:2]
    for line, n in zip(lines[2:], near_misses):
        out.append(line)
        out += textwrap.wrap(n.reason, WIDTH, initial_indent=indent, subsequent_indent=indent + "  ")
    return "\n".join(out)


def _source_width(header: list, rows: list) -> int:
    """Columns left for the last column once the others (and their gaps) are laid out."""
    used = sum(max(len(r[i]) for r in [header] + rows) + 2 for i in range(len(header) - 1))
    return max(len(header[-1]), WIDTH - used)


def _table(header: list, rows: list) -> str:
    widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
    fmt = "  ".join("{:<%d}" % w for w in widths)
    out = [fmt.format(*header), fmt.format(*["-" * w for w in widths])]
    out += [fmt.format(*r) for r in rows]
    return "\n".join(line.rstrip() for line in out)
