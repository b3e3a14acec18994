import sys, torch
a, b = torch.load(sys.argv[1]), torch.load(sys.argv[2])
for s in a:
    for i, n in enumerate(("o", "ht")):
        x, y = a[s][i], b[s][i]
        print(s, n, "max rel diff %.2e" % ((x - y).abs().max() / x.abs().max()).item(), "finite", bool(y.isfinite().all()))
