#!/usr/bin/env python3
"""Summarise a kernel_timeline CSV (tools/kernel_timeline/kernel_timeline.cpp).

For one CUDA graph (default: the one replayed the most times), each kernel
node in replay order with the medians over replays of:
  dur   end - start (a PDL dependent's start is early: it waits inside)
  incr  end - the previous node's end: what the node adds to the step
  gap   start - the previous node's end (negative: started before it ended)
then the same increments summed per kernel name, and the step (last end -
first start). All in microseconds.

  summarize.py timeline.csv [--graph ID] [--top N]
  summarize.py timeline.csv --eager [--gap-ms G] [--burst B] [--top N]
      (kernels outside graphs, e.g. prefill: bursts split at idle gaps over
      G ms, then busy time per kernel name over all, or over burst B)
"""
import argparse
import collections
import csv
import re
import shutil
import statistics
import subprocess
import sys


def short_names(mangled):
    names = dict((m, m) for m in mangled)
    if shutil.which("c++filt"):
        out = subprocess.run(["c++filt"], input="\n".join(mangled), capture_output=True, text=True).stdout.split("\n")
        for m, d in zip(mangled, out):
            names[m] = d
    for m, d in names.items():
        d = d.replace("(anonymous namespace)::", "")
        d = re.sub(r"^void ", "", d)
        d = re.sub(r"\([^()]*\)$", "", d)  # arguments
        depth, s = 0, ""
        for ch in d:  # template arguments, kept one level deep as <..>
            if ch == "<":
                depth += 1
                s += "<" if depth == 1 else ""
            elif ch == ">":
                depth -= 1
                s += ">" if depth == 0 else ""
            elif depth <= 1:
                s += ch
        head, lt, tail = s.partition("<")
        s = re.sub(r"^.*::", "", head) + lt + tail  # namespaces of the function
        names[m] = s[:90]
    return names


def eager(rows, top, gap_ms, burst):
    """Kernels outside graphs (prefill steps), split into bursts wherever the
    GPU idles more than gap_ms between two of them: each burst's kernels, span
    (first start to last end) and busy time (summed durations: kernels on one
    stream do not overlap); then count and summed duration per kernel name over
    all of them, or over burst `burst` (an index into the burst table; -1 the
    last)."""
    rs = sorted(r for r in rows if not r[2])
    if not rs:
        sys.exit("summarize.py: no kernel ran outside a CUDA graph")
    bursts, cur = [], [rs[0]]
    for r in rs[1:]:
        if r[0] - max(x[1] for x in cur[-8:]) > gap_ms * 1e6:
            bursts.append(cur)
            cur = []
        cur.append(r)
    bursts.append(cur)
    print(f"bursts (split at idle gaps over {gap_ms:g} ms): # kernels span_us busy_us busy/span")
    for i, b in enumerate(bursts):
        span = (max(r[1] for r in b) - b[0][0]) / 1e3
        busy = sum(r[1] - r[0] for r in b) / 1e3
        print(f"  {i} {len(b)} {span:.1f} {busy:.1f} {100 * busy / span if span else 0:.1f}%")
    if burst is not None:
        if not -len(bursts) <= burst < len(bursts):
            sys.exit(f"summarize.py: no burst {burst}")
        rs = bursts[burst]
    names = short_names(sorted({r[6] for r in rs}))
    total = collections.defaultdict(lambda: [0, 0.0])
    for r in rs:
        t = total[names[r[6]]]
        t[0] += 1
        t[1] += (r[1] - r[0]) / 1e3
    busy = sum(t[1] for t in total.values())
    span = (max(r[1] for r in rs) - min(r[0] for r in rs)) / 1e3
    what = "eager kernels" if burst is None else f"burst {burst}"
    print(f"\n{what}: {len(rs)} kernels, busy {busy:.1f} us, span {span:.1f} us (first start to last end)\n")
    print("| kernel | launches | busy us | share |\n|---|---:|---:|---:|")
    for name, (n, us) in sorted(total.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"| {name} | {n} | {us:.1f} | {100 * us / busy:.1f}% |")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv")
    ap.add_argument("--graph", type=int, default=None)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--eager", action="store_true",
                    help="the kernels launched outside CUDA graphs (prefill steps): bursts, busy time per kernel name")
    ap.add_argument("--gap-ms", type=float, default=2.0, help="--eager: idle gaps over this split bursts")
    ap.add_argument("--burst", type=int, default=None, help="--eager: the kernel table of this burst only (-1: last)")
    args = ap.parse_args()
    rows = []
    columns = ["start_ns", "end_ns", "graph_id", "graph_node_id", "grid", "block", "name"]
    try:
        with open(args.csv, newline="") as f:
            reader = csv.DictReader(f)
            missing = [c for c in columns if c not in (reader.fieldnames or [])]
            if missing:
                sys.exit(f"summarize.py: {args.csv}: not a kernel_timeline CSV (no column {', '.join(missing)})")
            for line, r in enumerate(reader, start=2):
                try:
                    if not r["name"]:
                        raise ValueError("no name")
                    rows.append((int(r["start_ns"]), int(r["end_ns"]), int(r["graph_id"]), int(r["graph_node_id"]),
                                 int(r["grid"]), int(r["block"]), r["name"]))
                except (TypeError, ValueError):
                    sys.exit(f"summarize.py: {args.csv}:{line}: not a kernel row: {r}")
    except OSError as e:
        sys.exit(f"summarize.py: cannot read {args.csv}: {e.strerror}")
    except UnicodeDecodeError:
        sys.exit(f"summarize.py: {args.csv}: not a text CSV")
    if args.eager:
        eager(rows, args.top, args.gap_ms, args.burst)
        return
    by_graph = collections.defaultdict(list)
    for r in rows:
        if r[2]:
            by_graph[r[2]].append(r)
    if not by_graph:
        sys.exit("summarize.py: no kernel ran inside a CUDA graph")
    print("graphs: id nodes replays")
    for g, rs in sorted(by_graph.items()):
        n = len({r[3] for r in rs})
        print(f"  {g} {n} {len(rs) / n:.1f}")
    gid = args.graph
    if gid is None:
        gid = max(by_graph, key=lambda g: (len(by_graph[g]) / len({r[3] for r in by_graph[g]}), len(by_graph[g])))
    if gid not in by_graph:
        sys.exit(f"summarize.py: no graph {gid}")
    rs = sorted(by_graph[gid])
    nodes = len({r[3] for r in rs})
    # Replays in start order: a new one begins where a node repeats. A replay
    # missing a node (a record CUPTI dropped) is left out, and counted.
    replays, cur, seen = [], [], set()
    for r in rs:
        if r[3] in seen:
            replays.append(cur)
            cur, seen = [], set()
        cur.append(r)
        seen.add(r[3])
    replays.append(cur)
    incomplete = sum(1 for p in replays if len(p) != nodes)
    replays = [p for p in replays if len(p) == nodes]
    if not replays:
        sys.exit(f"summarize.py: graph {gid}: no complete replay")
    if incomplete:
        print(f"(graph {gid}: {incomplete} incomplete replays left out)")
    names = short_names(sorted({r[6] for r in rs}))
    order = [r[3] for r in replays[0]]
    stats = collections.defaultdict(lambda: {"dur": [], "incr": [], "gap": []})
    steps = []
    for p in replays:
        steps.append((max(r[1] for r in p) - p[0][0]) / 1e3)
        prev_end = p[0][0]
        for r in p:
            s = stats[r[3]]
            s["dur"].append((r[1] - r[0]) / 1e3)
            s["incr"].append((r[1] - prev_end) / 1e3)
            s["gap"].append((r[0] - prev_end) / 1e3)
            prev_end = max(prev_end, r[1])
    info = {r[3]: r for r in replays[0]}
    med = statistics.median
    print(f"\ngraph {gid}: {nodes} kernels, {len(replays)} replays, step {med(steps):.1f} us (median)\n")
    print("| # | kernel | grid | dur | incr | gap |\n|---:|---|---:|---:|---:|---:|")
    for i, node in enumerate(order):
        s, r = stats[node], info[node]
        print(f"| {i} | {names[r[6]]} | {r[4]} | {med(s['dur']):.2f} | {med(s['incr']):.2f} | {med(s['gap']):.2f} |")
    total = collections.defaultdict(lambda: [0, 0.0])
    for node in order:
        t = total[names[info[node][6]]]
        t[0] += 1
        t[1] += med(stats[node]["incr"])
    print(f"\n| kernel | per step | incr us | share |\n|---|---:|---:|---:|")
    step = med(steps)
    for name, (n, us) in sorted(total.items(), key=lambda kv: -kv[1][1])[:args.top]:
        print(f"| {name} | {n} | {us:.1f} | {100 * us / step:.1f}% |")


if __name__ == "__main__":
    main()
