import sys,re,collections
lines=open(sys.argv[1]).read().splitlines()
ins=[(int(m.group(1),16),m.group(2).strip()) for l in lines for m in [re.match(r"\s*/\*([0-9a-f]{4})\*/\s+(.*?);",l)] if m]
loops=[]
for a,t in ins:
    m=re.search(r"BRA 0x([0-9a-f]+)",t)
    if m and int(m.group(1),16)<a and "@" in t:
        loops.append((int(m.group(1),16),a))
for lo,hi in loops:
    body=[t for a,t in ins if lo<=a<=hi]
    c=collections.Counter(re.sub(r"^@!?U?P\w+\s+","",t).split()[0].split(".")[0] for t in body)
    print("loop", hex(lo), hex(hi), len(body), dict(c.most_common(12)))
