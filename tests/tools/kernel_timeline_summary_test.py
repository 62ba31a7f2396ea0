#!/usr/bin/env python3
"""tools/kernel_timeline/summarize.py on a hand-made timeline.

Graph 7 (three nodes, five replays, one missing its UP record and left out)
is the most replayed and is chosen over graph 9 (one replay) and the kernel
outside any graph. Node times, ns from the replay's first start (replay r
shifted by 100 us, node 102's end 28.5, 29.5, 30.5, 29.5 us in the four
complete replays):
  node 100 route  start 0      end 3000
  node 101 up     start 1000   end 23000   (a PDL dependent: starts early)
  node 102 down   start 23500  end 28500 / 29500 / 30500
Hand-computed medians, us: route dur 3.0 incr 3.0 gap 0.0; up dur 22.0
incr 20.0 gap -2.0; down dur 6.0 incr 6.5 gap 0.5; step 29.5. Per name:
up 20.0 us = 67.8% of the step.
"""
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
SUMMARIZE = os.path.join(HERE, "..", "..", "tools", "kernel_timeline", "summarize.py")
ROUTE = "_ZN7nucleus7kernels12_GLOBAL__N_116moe_route_kernelENS0_16MoeRoutingParamsEPKfS4_PiPfl"


def main():
    rows = ["start_ns,end_ns,graph_id,graph_node_id,stream,grid,block,name"]
    for r, down_end in enumerate([28500, 29500, 30500, 0, 29500]):
        t0 = 1_000_000 + r * 100_000
        rows.append(f"{t0},{t0 + 3000},7,100,13,1,128,{ROUTE}")
        if down_end == 0:  # a replay whose UP record was dropped: left out
            rows.append(f"{t0 + 23500},{t0 + 28000},7,102,13,192,256,_Z4downv")
            continue
        rows.append(f"{t0 + 1000},{t0 + 23000},7,101,13,132,256,_Z2upv")
        rows.append(f"{t0 + 23500},{t0 + down_end},7,102,13,192,256,_Z4downv")
    rows.append("5000000,5001000,9,1,13,1,32,_Z5otherv")
    rows.append("10,20,0,0,13,1,32,_Z5eagerv")
    # Eager (prefill) kernels: busy 0.01 + 30 + 20 us, 20.01 of it eager(), span 10 ns .. 220 us.
    rows.append("100000,130000,0,0,13,1,32,_Z5otherv")
    rows.append("200000,220000,0,0,13,1,32,_Z5eagerv")
    with tempfile.NamedTemporaryFile("w", suffix=".csv", delete=False) as f:
        f.write("\n".join(rows) + "\n")
        path = f.name
    try:
        out = subprocess.run([sys.executable, SUMMARIZE, path], capture_output=True, text=True, check=True).stdout
        bad = subprocess.run([sys.executable, SUMMARIZE, path, "--graph", "42"], capture_output=True, text=True)
        eager_out = subprocess.run([sys.executable, SUMMARIZE, path, "--eager", "--gap-ms", "0.05"],
                                   capture_output=True, text=True, check=True).stdout
        burst_out = subprocess.run([sys.executable, SUMMARIZE, path, "--eager", "--gap-ms", "0.05", "--burst", "-1"],
                                   capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(path)
    want = [
        "(graph 7: 1 incomplete replays left out)",
        "graph 7: 3 kernels, 4 replays, step 29.5 us (median)",
        "| 0 | moe_route_kernel | 1 | 3.00 | 3.00 | 0.00 |",
        "| 1 | up | 132 | 22.00 | 20.00 | -2.00 |",
        "| 2 | down | 192 | 6.00 | 6.50 | 0.50 |",
        "| up | 1 | 20.0 | 67.8% |",
    ]
    failed = [w for w in want if w not in out]
    eager_want = [
        "  0 1 0.0 0.0 100.0%",      # 10 .. 20 ns, then 99.98 us idle
        "  1 1 30.0 30.0 100.0%",    # 100 .. 130 us, then 70 us idle
        "  2 1 20.0 20.0 100.0%",
        "eager kernels: 3 kernels, busy 50.0 us, span 220.0 us (first start to last end)",
        "| other | 1 | 30.0 | 60.0% |",
        "| eager | 2 | 20.0 | 40.0% |",
    ]
    failed += ["--eager: " + w for w in eager_want if w not in eager_out]
    if "burst -1: 1 kernels, busy 20.0 us, span 20.0 us" not in burst_out or "| eager | 1 | 20.0 | 100.0% |" not in burst_out:
        failed.append("--eager --burst -1: the last burst's table")
    if bad.returncode == 0 or "no graph 42" not in bad.stderr:
        failed.append("--graph 42 (absent) is refused naming it")
    if failed:
        print(out)
        print("missing:\n  " + "\n  ".join(failed))
        return 1
    print("kernel_timeline_summary_test: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
