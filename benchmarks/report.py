"""Results: the stamp (device, versions, date, commit), markdown tables, and the files a run writes
(``<stem>.json``, ``<stem>.md``, and ``<stem>.png`` where a benchmark plots and matplotlib is there)."""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch

ROOT = Path(__file__).resolve().parents[1]


def _git(*args) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def commit() -> str:
    """The short commit of the checkout, '+dirty' where tracked files differ from it."""
    c = _git("rev-parse", "--short", "HEAD") or "unknown"
    if c != "unknown" and _git("status", "--porcelain", "--untracked-files=no"):
        c += "+dirty"
    return c


def device_name(device: str) -> str:
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return f"{platform.processor() or platform.machine()} ({os.cpu_count()} cores)"


def device_tag(device: str) -> str:
    """'h100' for 'NVIDIA H100 80GB HBM3', 'cpu' on CPU: the first word of result file names."""
    if not device.startswith("cuda"):
        return "cpu"
    found = re.search(r"\b([A-Z]{1,2}\d{2,4})\b", device_name(device))
    return found.group(1).lower() if found else "gpu"


def stamp(device: str) -> dict:
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {"device": device_name(device), "torch": torch.__version__, "triton": triton_version,
            "python": sys.version.split()[0], "threads": torch.get_num_threads(),
            "date": datetime.datetime.now().isoformat(timespec="seconds"), "commit": commit()}


def stamp_line(meta: dict) -> str:
    return (f"{meta['device']}, torch {meta['torch']}, triton {meta['triton']}, python {meta['python']}, "
            f"{meta['threads']} threads, {meta['date']}, commit {meta['commit']}")


# ---------------------------------------------------------------------------------------------
# markdown
# ---------------------------------------------------------------------------------------------


def fmt(x, spec: str = ".3f") -> str:
    """A table cell: '—' for a missing or NaN value."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "—"
    if isinstance(x, (tuple, list)):
        return ", ".join(map(str, x)) or "—"
    return format(x, spec) if spec else str(x)


def table(rows: list, columns: list, keep_empty: bool = False) -> str:
    """A markdown table; columns are (header, key or callable of the row, format spec). Columns with
    no value in any row are left out unless keep_empty."""
    cells = [[fmt(get(r) if callable(get) else r.get(get), spec) for _, get, spec in columns] for r in rows]
    keep = [i for i in range(len(columns)) if keep_empty or any(c[i] != "—" for c in cells)]
    lines = ["| " + " | ".join(columns[i][0] for i in keep) + " |", "|" + "---|" * len(keep)]
    lines += ["| " + " | ".join(c[i] for i in keep) + " |" for c in cells]
    return "\n".join(lines)


def ratio(a, b, spec: str = ".2f") -> str:
    """a / b as '1.23x', '—' where either is missing."""
    if a is None or b is None or b == 0 or any(isinstance(x, float) and math.isnan(x) for x in (a, b)):
        return "—"
    return f"{a / b:{spec}}x"


# ---------------------------------------------------------------------------------------------
# the result of one run
# ---------------------------------------------------------------------------------------------


@dataclass
class Result:
    """What a benchmark returns: rows (JSON), markdown sections, notes (skipped columns, methods),
    and optionally a plot: ``plot(path) -> bool`` (False: nothing to plot)."""

    name: str
    title: str
    meta: dict
    rows: list = field(default_factory=list)
    sections: list = field(default_factory=list)
    notes: list = field(default_factory=list)
    plot: Optional[Callable] = None

    def markdown(self) -> str:
        parts = [f"# {self.title}", "", stamp_line(self.meta)]
        extra = {k: v for k, v in self.meta.items() if k not in ("device", "torch", "triton", "python", "threads",
                                                                  "date", "commit", "torch_device")
                 and not isinstance(v, dict)}
        if extra:
            parts += ["", "; ".join(f"{k}: {fmt(v, '')}" for k, v in extra.items())]
        if self.notes:
            parts += [""] + [f"- {n}" for n in self.notes]
        for s in self.sections:
            parts += ["", s]
        return "\n".join(parts) + "\n"

    def write(self, out_dir: str, stem: Optional[str] = None) -> list:
        """DIR/STEM.json, DIR/STEM.md (and .png); STEM defaults to '<device>-<date>-<name>'."""
        os.makedirs(out_dir, exist_ok=True)
        if stem is None:
            stem = f"{device_tag(self.meta.get('torch_device', 'cpu'))}-{self.meta['date'][:10]}-{self.name}"
        base = Path(out_dir) / stem
        written = [base.with_suffix(".json"), base.with_suffix(".md")]
        png = base.with_suffix(".png")
        if self.plot is not None:
            if plot_available():
                if self.plot(str(png)):
                    written.append(png)
            else:
                self.notes.append("matplotlib is not installed: no PNG plot")
        with open(written[0], "w") as f:
            json.dump({"meta": self.meta, "notes": self.notes, "rows": self.rows}, f, indent=1, default=str)
        written[1].write_text(self.markdown())
        return written


def new_result(name: str, title: str, device: str, **meta) -> Result:
    """A Result stamped for ``device`` ("cuda" or "cpu"), with benchmark-specific meta fields."""
    return Result(name, title, {**stamp(device), "torch_device": device, **meta})


def plot_available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def bar_plot(path: str, rows: list, group: Callable, series: str, values: list, log_scale: bool = True) -> bool:
    """Bars of each ``values`` key (one panel each), grouped by ``group(row)`` (a label), one bar per
    ``row[series]``; rows without the key are left out. False if nothing was plotted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = list(dict.fromkeys(group(r) for r in rows))
    names = list(dict.fromkeys(r[series] for r in rows))
    if not groups or not names:
        return False
    fig, axes = plt.subplots(1, len(values), figsize=(7 * len(values), 5), squeeze=False)
    width = 0.8 / len(names)
    for ax, key in zip(axes[0], values):
        for i, name in enumerate(names):
            heights = [next((r.get(key) or 0 for r in rows if r[series] == name and group(r) == g), 0) for g in groups]
            ax.bar([x + i * width for x in range(len(groups))], heights, width, label=name)
        ax.set_xticks([x + 0.4 for x in range(len(groups))])
        ax.set_xticklabels(groups, rotation=30, fontsize=7)
        ax.set_ylabel(key)
        if log_scale:
            ax.set_yscale("log")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
