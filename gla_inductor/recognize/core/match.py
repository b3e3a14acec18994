"""What a recognizer found: a proven GLA instance to replace, or a near miss and why."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable

import torch.fx as fx


class Reject(Exception):
    """A candidate that is not proven GLA (or cannot be replaced safely); the message says why."""


@dataclass
class Match:
    form: str  # "chunked" | "loop" | "decode" | "parallel"
    gate: str  # "vector" | "scalar" | "constant" | "none"
    layout: str  # the user's layout of q, in role letters, e.g. "bthk" or "bhtk"
    shapes: dict  # B, T, H, K, V
    nodes: list  # the user's nodes that the match covers (for source lines)
    apply: Callable  # apply(graph) -> None; inserts the GLA op and rewires
    options: dict = field(default_factory=dict)  # reverse, initial_state, scale
    covers: set = field(default_factory=set)  # further nodes the replacement makes dead
    note: str = ""  # how the cost rule decided to rewrite it, where it measured (explain prints it)

    def __post_init__(self) -> None:
        self.layout = role_layout(self.layout)

    def source_lines(self) -> list[str]:
        return source_lines(self.nodes)


def role_layout(letters: str) -> str:
    """Role letters of a layout, each run of upper-case sub-letters as the role they are parts
    of: the recognizers split only the head axis in parts (heads = groups x repeats), so q with
    the group part of the heads ("bAk", Mamba2's C at decode) has the head axis ("bhk")."""
    return re.sub("[A-Z]+", "h", letters)


@dataclass
class NearMiss:
    form: str
    reason: str
    nodes: list

    def source_lines(self) -> list[str]:
        return source_lines(self.nodes)


def source_lines(nodes: list) -> list[str]:
    """'file.py:LINE  code' of the user's frame behind each node (deduplicated)."""
    lines: list[str] = []
    for n in nodes:
        st = n.meta.get("stack_trace") if isinstance(n, fx.Node) else None
        if not st:
            continue
        rows = [r.strip() for r in st.strip().splitlines()]
        frames = [i for i, r in enumerate(rows) if r.startswith("File ")]
        if not frames:
            continue
        i = frames[-1]
        parts = rows[i].split(",")
        where = parts[0][len("File ") :].strip('"').split("/")[-1] + ":" + parts[1].replace("line", "").strip()
        code = rows[i + 1] if i + 1 < len(rows) else ""
        entry = f"{where}  {code}"
        if entry not in lines:
            lines.append(entry)
    return lines
