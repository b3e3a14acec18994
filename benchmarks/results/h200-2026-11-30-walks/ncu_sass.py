import csv, sys, collections
path, which = sys.argv[1], int(sys.argv[2])
lines = open(path).read().splitlines()
starts = [i for i, l in enumerate(lines) if l.startswith('"Kernel Name"')] + [len(lines)]
sec = lines[starts[which] + 1:starts[which + 1]]
rows = list(csv.DictReader(sec))
tot = sum(int(r["Warp Stall Sampling (All Samples)"] or 0) for r in rows)
ins = sum(int(r["Instructions Executed"] or 0) for r in rows)
print("instructions", len(rows), "samples", tot, "executed", ins)
reasons = collections.Counter()
for r in rows:
    for k, v in r.items():
        if k.startswith("stall_") and "Not Issued" not in k and v not in ("", "-"):
            reasons[k] += int(v)
for k, v in reasons.most_common(12):
    print(f"  {k:24s} {100*v/tot:5.1f}%")
if len(sys.argv) > 3:
    for i, r in enumerate(rows):
        s = int(r["Warp Stall Sampling (All Samples)"] or 0)
        e = int(r["Instructions Executed"] or 0)
        print(f"{i:5d} {100*s/tot:5.1f} {e:9d} {r['Source'].strip()[:90]}")
