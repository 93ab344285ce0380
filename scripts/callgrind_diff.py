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
     r"^(malloc|free|realloc|calloc|posix_memalign|_mid_memalign.*|_int_malloc|_int_free|"
     r"_int_realloc|_int_memalign|malloc_consolidate|tcache.*|unlink_chunk.*|cfree|"
     r"__rust_(alloc|dealloc|realloc).*)$|alloc::alloc::"),
    ("system calls and libc", r"^(send|sendto|sendmsg|recv|recvfrom|read|write|writev|"
     r"epoll_wait|epoll_ctl|syscall|clock_gettime.*|__vdso.*|__libc_.*|__GI_.*|pthread_.*|"
     r"__lll_.*|futex.*)$"),
    ("clock reads and Instant arithmetic", r"Timespec|Instant|std::time|SystemTime"),
    ("tracing / telemetry / metrics", r"tracing|opentelemetry|metrics|telemetry"),
    ("prost and codec encode/decode", r"prost|encoded_len|encode_varint|decode_varint|"
     r"merge_field|serde|from_utf8|rpc_core::codec|decode_named_args|__private"),
    ("generated stubs (EchoClient/EchoServer)", r"EchoClient|EchoServer"),
    ("DashMap / hash maps", r"dashmap|hashbrown|ahash|RandomState|BuildHasher|Hasher|"
     r"lock_api|RwLock"),
    ("oneshot / mpsc / semaphore / Notify", r"oneshot|mpsc|Notify|semaphore|AtomicWaker"),
    ("tokio timers", r"tokio::time::|tokio::runtime::time|TimerEntry|Sleep|Timeout|"
     r"Option<tokio::runtime::Timer>"),
    ("tokio tasks: spawn, poll, wake, schedule, JoinHandle",
     r"tokio::runtime::task|tokio::runtime::scheduler|tokio::task|tokio::runtime::context|"
     r"waker|Waker|JoinHandle|OwnedTasks|coop"),
    ("tokio I/O driver", r"tokio::io|tokio::net|tokio::runtime::io|PollEvented|mio::"),
    ("bytes (Bytes/BytesMut)", r"bytes::"),
    ("arc-swap and Arc drops", r"arc_swap|Arc<.*>::drop_slow"),
    ("governance stack and engine", r"rpc_governance"),
    ("rpc-client", r"rpc_client"),
    ("rpc-server", r"rpc_server"),
    ("rpc-transport (frames, pending, reader, writer)", r"rpc_transport"),
    ("rpc-core", r"rpc_core"),
    ("benchmark program (load loop, histogram)", r"hdrhistogram|^bench::|raw::|peerbench_common"),
    ("btree (attachments maps)", r"btree"),
    ("std / core other", r"^(std|core|alloc)::|<(std|core|alloc)::"),
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
    ap.add_argument("--members", type=int, default=0,
                    help="with --groups: list this many largest functions of each group")
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
            if a.members:
                rows = sorted(((n, v) for n, v in excl.items() if group_of(n) == g),
                              key=lambda kv: -kv[1])
                for name, v in rows[: a.members]:
                    print(f"          {v:8.1f}  {name[: a.width - 20]}")


if __name__ == "__main__":
    sys.exit(main())
