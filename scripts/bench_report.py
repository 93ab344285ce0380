#!/usr/bin/env python3
"""Medians of the peerbench RESULT lines per (setup, payload, conc, conns, peer), with ratios
of QPS to raw and to tarpc, client and server CPU per call and peak memory."""
import statistics
import sys
from collections import defaultdict

rows = []
with open(sys.argv[1]) as f:
    for line in f:
        if line.startswith("RESULT"):
            rows.append(dict(p.split("=", 1) for p in line.split()[1:] if "=" in p))
if not rows:
    sys.exit("no RESULT lines")

groups = defaultdict(list)
for r in rows:
    groups[(r["label"], int(r["payload"]), int(r["conc"]), int(r["conns"]), r["peer"])].append(r)


def med(rs, k):
    vals = [float(r[k]) for r in rs if k in r]
    return statistics.median(vals) if vals else float("nan")


order = ["raw", "tarpc", "tonic", "rpc", "rpc_nogov"]
print("| setup | payload | conc | conns | peer | QPS | x raw | x tarpc | p50 µs | p99 µs | p99.9 µs "
      "| cli µs/call | srv µs/call | cli MiB | srv MiB | n |")
print("|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
for conf in sorted({k[:4] for k in groups}):
    peers = sorted({k[4] for k in groups if k[:4] == conf},
                   key=lambda p: order.index(p) if p in order else len(order))
    base = {p: med(groups[(*conf, p)], "qps") for p in ("raw", "tarpc") if (*conf, p) in groups}
    for p in peers:
        rs = groups[(*conf, p)]
        qps = med(rs, "qps")
        ratio = lambda b: f"{qps / base[b]:.2f}" if b in base and base[b] else "-"
        mib = lambda k: f"{med(rs, k) / 1024:.1f}" if any(k in r for r in rs) else "-"
        print(f"| {conf[0]} | {conf[1]} | {conf[2]} | {conf[3]} | {p} | {qps:,.0f} | {ratio('raw')} "
              f"| {ratio('tarpc')} | {med(rs, 'p50_us'):.0f} | {med(rs, 'p99_us'):.0f} "
              f"| {med(rs, 'p999_us'):.0f} | {med(rs, 'cpu_us_per_req'):.2f} "
              f"| {med(rs, 'srv_cpu_us_per_req'):.2f} | {mib('maxrss_kb')} | {mib('srv_maxrss_kb')} "
              f"| {len(rs)} |")
