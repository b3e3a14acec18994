"""Summarize an Nsight Compute SASS source page (csv): stall samples by instruction kind, and the hottest lines.

    python benchmarks/ncu_hot.py ncu_sass.csv
"""

import collections
import csv
import sys


def main(path: str) -> None:
    with open(path) as f:
        lines = f.read().splitlines()
    start = next(i for i, l in enumerate(lines) if l.startswith('"#"') or l.startswith('"Address"') or "Source" in l)
    rows = list(csv.DictReader(lines[start:]))
    cols = list(rows[0])
    samples = next(c for c in cols if "Sampling" in c and "All" in c)
    executed = next((c for c in cols if c.startswith("Instructions Executed")), None)
    total = sum(float(r[samples] or 0) for r in rows)
    by_op = collections.Counter()
    inst_by_op = collections.Counter()
    for r in rows:
        op = r["Source"].split()[0] if r["Source"].split() else "?"
        if op.startswith("@"):
            op = r["Source"].split()[1]
        op = op.split(".")[0]
        by_op[op] += float(r[samples] or 0)
        if executed:
            inst_by_op[op] += float(r[executed] or 0)
    print(f"columns: {cols}")
    print(f"stall samples {total:.0f}; instructions executed {sum(inst_by_op.values()):.0f}")
    print("op: share of stall samples, share of executed instructions")
    for op, s in by_op.most_common(25):
        print(f"  {op:12s} {s / total:6.1%}  {inst_by_op[op] / max(1, sum(inst_by_op.values())):6.1%}")
    print("hottest instructions:")
    for r in sorted(rows, key=lambda r: -float(r[samples] or 0))[:25]:
        print(f"  {float(r[samples] or 0) / total:6.1%}  {r['Source'][:90]}")


if __name__ == "__main__":
    main(sys.argv[1])
