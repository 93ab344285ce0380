#!/usr/bin/env python3
"""Per-call function costs from two callgrind runs of different lengths (scripts/callgrind.sh).

    callgrind_diff.py [--top N] [--calls N] [--title T] [--groups] BASE.cg FULL.cg

Runs `callgrind_annotate` on both files, exclusive and inclusive, subtracts the base run's cost
of each function from the full run's and divides by the number of calls between them, so that
start-up and shutdown drop out as they do for the totals. Prints the top N functions by
exclusive and by inclusive instructions per call; `--groups` also sums the exclusive costs into
the groups below (first matching pattern wins), which is where a call's instructions go.
"""

import argparse
import re
import subprocess
import sys
from collections import defaultdict

LINE = re.compile(r"^\s*([\d,]+)(?:\s+\([^)]*\))?\s+(\S.*)$")

# (group, pattern on the function name); first match wins, order matters.
GROUPS = [
    ("memcpy/memmove (futures and values moved)", r"mem(cpy|move)|__memcpy|__memmove"),
    ("memset/memcmp/strlen", r"mem(set|cmp)|__memset|strlen|bcmp"),
    ("allocation and free (malloc, free, realloc)",
     r"\b(malloc|free|realloc|calloc|_int_malloc|_int_free|_int_realloc|malloc_consolidate|"
     r"tcache|unlink_chunk|cfree|__rust_(alloc|dealloc|realloc)|alloc::alloc)"),
    ("system calls and libc I/O", r"\b(send|sendto|recv|recvfrom|read|write|writev|epoll_wait|"
     r"epoll_ctl|syscall|__libc_|clock_gettime|__vdso|futex|pthread_)"),
    ("tracing / span checks / metrics", r"tracing|opentelemetry|metrics|telemetry"),
    ("prost encode/decode", r"prost|encoded_len|::encode|::decode|merge_field|encode_varint|"
     r"decode_varint"),
    ("DashMap / hash maps", r"dashmap|hashbrown|ahash|RandomState|BuildHasher|hash::|Hasher"),
    ("oneshot / mpsc / sync channels", r"sync::oneshot|sync::mpsc|oneshot|mpsc|Notify|semaphore|"
     r"batch_semaphore"),
    ("tokio timers", r"tokio::time::|(?<![a-z_])time::|Sleep|Timeout|timer|clock"),
    ("tokio task spawn/wake/schedule",
     r"tokio::runtime::task|task::harness|task::raw|task::state|task::core|scheduler|"
     r"waker|Waker|wake|spawn|JoinHandle|multi_thread|worker::|inject|OwnedTasks|idle"),
    ("tokio I/O driver", r"tokio::io|tokio::net|io::driver|PollEvented|scheduled_io|mio::"),
    ("bytes", r"bytes::"),
    ("governance", r"rpc_governance"),
    ("client", r"rpc_client"),
    ("server", r"rpc_server"),
    ("transport", r"rpc_transport"),
    ("core", r"rpc_core"),
    ("benchmark program (histogram, clock, echo)", r"hdrhistogram|bench::|examples::|raw::|"
     r"peerbench_common|std::time|Instant"),
    ("std / core", r"^(std|core|alloc)::|<(std|core|alloc)::"),
]


def costs(path, inclusive):
    """Function name -> instructions, from callgrind_annotate."""
    args = ["callgrind_annotate", "--threshold=100", "--auto=no",
            f"--inclusive={'yes' if inclusive else 'no'}", path]
    out = subprocess.run(args, check=True, capture_output=True, text=True).stdout
    result = defaultdict(int)
    started = False
    for line in out.splitlines():
        if "file:function" in line:
            started = True
            continue
        if not started:
            continue
        m = LINE.match(line)
        if not m:
            continue
        name = re.sub(r"\s+\[[^\]]*\]$", "", m.group(2))
        # "file:function": keep the function; file names are noise here.
        if ":" in name and not name.startswith("<") and name.split(":", 1)[0].endswith(
                (".rs", ".c", ".S", "???", ".h")):
            name = name.split(":", 1)[1]
        elif name.startswith("???:"):
            name = name[4:]
        else:
            m2 = re.match(r"^[^ ]*?\.(rs|c|S|h):(.*)$", name)
            if m2:
                name = m2.group(2)
        result[name] += int(m.group(1).replace(",", ""))
    return result


def per_call(base, full, calls):
    out = {}
    for name in set(base) | set(full):
        d = (full.get(name, 0) - base.get(name, 0)) / calls
        if abs(d) >= 0.05:
            out[name] = d
    return out


def group_of(name):
    for group, pat in GROUPS:
        if re.search(pat, name):
            return group
    return "other"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--calls", type=float, required=True)
    ap.add_argument("--title", default="")
    ap.add_argument("--groups", action="store_true")
    ap.add_argument("--width", type=int, default=150)
    ap.add_argument("base")
    ap.add_argument("full")
    a = ap.parse_args()
    excl = per_call(costs(a.base, False), costs(a.full, False), a.calls)
    incl = per_call(costs(a.base, True), costs(a.full, True), a.calls)
    total = sum(excl.values())
    print(f"== {a.title}: {total:.0f} instructions per call (sum of exclusive costs)")
    for label, table in (("exclusive", excl), ("inclusive", incl)):
        print(f"-- top {a.top} by {label} instructions per call")
        rows = sorted(table.items(), key=lambda kv: -kv[1])
        if label == "inclusive":
            # The thread roots and the runtime's loop hold everything (and count recursion
            # twice): leave them out.
            rows = [(n, d) for n, d in rows if d < 0.9 * total]
        for name, d in rows[: a.top]:
            print(f"{d:9.1f} {100 * d / total:5.1f}%  {name[: a.width]}")
    if a.groups:
        sums = defaultdict(float)
        for name, d in excl.items():
            sums[group_of(name)] += d
        print("-- exclusive instructions per call, grouped")
        for g, d in sorted(sums.items(), key=lambda kv: -kv[1]):
            print(f"{d:9.1f} {100 * d / total:5.1f}%  {g}")


if __name__ == "__main__":
    sys.exit(main())
