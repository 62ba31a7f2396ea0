#!/usr/bin/env python3
"""Soak test of `nucleus serve`: mixed good and bad traffic with random disconnects.

Starts `nucleus serve` on the CPU tiny model on a loopback port (or uses --base-url
with --pid), then runs --concurrency client threads for --duration seconds. Each
request is one of the cases below, drawn at random; every case is bounded in time
and size, and all traffic goes to 127.0.0.1 only. At the end it prints (and writes
as JSON with --result-json) request counts by case and status, the p50/p99 latency
of the good requests, the server's RSS and KV blocks in use before and after, and
whether the server still answers a greedy request with the same text as at the start.

  tools/soak.py --bin build/bin/nucleus --duration 600 --concurrency 64
"""
import argparse
import gzip
import http.client
import json
import os
import random
import re
import socket
import subprocess
import sys
import threading
import time

HOST = "127.0.0.1"


def free_port():
    s = socket.socket()
    s.bind((HOST, 0))
    port = s.getsockname()[1]
    s.close()
    return port


def rss_bytes(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return -1


def metrics(port):
    c = http.client.HTTPConnection(HOST, port, timeout=30)
    c.request("GET", "/metrics")
    text = c.getresponse().read().decode()
    c.close()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def post(port, path, body, timeout=120, headers=None):
    c = http.client.HTTPConnection(HOST, port, timeout=timeout)
    h = {"Content-Type": "application/json"}
    h.update(headers or {})
    c.request("POST", path, body=body, headers=h)
    r = c.getresponse()
    data = r.read()
    c.close()
    return r.status, data


def raw(port, data, read=True, timeout=30):
    s = socket.create_connection((HOST, port), timeout=timeout)
    s.sendall(data)
    status = 0
    if read:
        buf = b""
        while b"\r\n" not in buf:
            chunk = s.recv(65536)
            if not chunk:
                break
            buf += chunk
        m = re.match(rb"HTTP/1\.1 (\d+)", buf)
        status = int(m.group(1)) if m else 0
    s.close()
    return status


def greedy(port):
    body = json.dumps({"prompt": "def fibonacci(n):\n", "max_tokens": 8, "temperature": 0})
    status, data = post(port, "/v1/completions", body)
    return status, json.loads(data)["choices"][0]["text"] if status == 200 else None


# Each case: (name, good, fn(port, rng) -> status). Good cases must answer 200.
def good_completion(port, rng):
    body = {"prompt": rng.choice(["x = ", "import os\n", "def f(a, b):\n", "Hello"]),
            "max_tokens": rng.randint(1, 24), "temperature": rng.choice([0, 0.8]), "seed": rng.randint(0, 99)}
    return post(port, "/v1/completions", json.dumps(body))[0]


def good_chat(port, rng):
    body = {"messages": [{"role": "user", "content": "hi " * rng.randint(1, 8)}], "max_tokens": rng.randint(1, 16)}
    return post(port, "/v1/chat/completions", json.dumps(body))[0]


def good_stream(port, rng):
    body = json.dumps({"prompt": "for i in", "max_tokens": rng.randint(1, 24), "stream": True})
    c = http.client.HTTPConnection(HOST, port, timeout=120)
    c.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
    r = c.getresponse()
    data = r.read()
    c.close()
    return r.status if data.endswith(b"data: [DONE]\n\n") else -1


def good_n(port, rng):
    body = {"prompt": ["a", "b"], "n": 3, "max_tokens": 4, "temperature": 1.0, "stop": ["\n"]}
    return post(port, "/v1/completions", json.dumps(body))[0]


def bad_json(port, rng):
    return post(port, "/v1/completions", rng.choice(["{not json", "[1,2]", '{"prompt": 5}', ""]))[0]


def bad_deep(port, rng):
    d = rng.randint(100, 80000)
    return post(port, "/v1/completions", '{"prompt": "x", "user": ' + "[" * d + "]" * d + "}")[0]


def bad_fields(port, rng):
    body = rng.choice([{"prompt": "x", "n": 100000}, {"prompt": "x", "temperature": -1},
                       {"prompt": [1, 10 ** 9]}, {"prompt": "x", "max_tokens": 10 ** 9},
                       {"prompt": "x", "stop": ["s"] * 1000}, {"prompt": "x", "stop_token_ids": [1] * 5000},
                       {"prompt": "x", "model": "nope"}])
    return post(port, "/v1/completions", json.dumps(body))[0]


def bad_big(port, rng):
    # Content-Length past the limit, sent without its body.
    return raw(port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 104857600\r\n\r\n")


def bad_gzip_bomb(port, rng):
    body = gzip.compress(b" " * (80 << 20))
    return post(port, "/v1/completions", body, headers={"Content-Encoding": "gzip"})[0]


def bad_method(port, rng):
    c = http.client.HTTPConnection(HOST, port, timeout=30)
    c.request(rng.choice(["PATCH", "PUT", "DELETE", "GET"]), "/v1/completions")
    status = c.getresponse().status
    c.close()
    return status


def slow_header(port, rng):
    # A slowloris client: header lines trickle in; the server answers 408.
    s = socket.create_connection((HOST, port), timeout=60)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
    status = 0
    try:
        for _ in range(60):
            time.sleep(0.5)
            s.sendall(b"X-Slow: 1\r\n")
    except OSError:
        pass
    try:
        buf = s.recv(4096)
        m = re.match(rb"HTTP/1\.1 (\d+)", buf)
        status = int(m.group(1)) if m else -2
    except OSError:
        status = -2
    s.close()
    return status


def disconnect_stream(port, rng):
    body = json.dumps({"prompt": "def f(x):\n", "max_tokens": 400, "ignore_eos": True, "stream": True}).encode()
    s = socket.create_connection((HOST, port), timeout=60)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
              + str(len(body)).encode() + b"\r\n\r\n" + body)
    s.recv(1024)
    time.sleep(rng.uniform(0, 0.5))
    s.close()
    return "disconnect"


def disconnect_plain(port, rng):
    body = json.dumps({"prompt": "def f(x):\n", "max_tokens": 400, "ignore_eos": True}).encode()
    s = socket.create_connection((HOST, port), timeout=60)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
              + str(len(body)).encode() + b"\r\n\r\n" + body)
    time.sleep(rng.uniform(0, 0.5))
    s.close()
    return "disconnect"


def pipelined(port, rng):
    one = json.dumps({"prompt": "x", "max_tokens": 2}).encode()
    req = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
           + str(len(one)).encode() + b"\r\n\r\n" + one)
    s = socket.create_connection((HOST, port), timeout=60)
    s.sendall(req * 3 + b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    data = b""
    while True:
        chunk = s.recv(65536)
        if not chunk:
            break
        data += chunk
    s.close()
    return 200 if len(re.findall(rb"HTTP/1\.1 200", data)) == 4 else -1


CASES = [  # (name, good, fn, weight)
    ("completion", True, good_completion, 30), ("chat", True, good_chat, 10), ("stream", True, good_stream, 15),
    ("n_choices", True, good_n, 5), ("pipelined", True, pipelined, 4),
    ("bad_json", False, bad_json, 6), ("deep_json", False, bad_deep, 4), ("bad_fields", False, bad_fields, 8),
    ("oversize", False, bad_big, 3), ("gzip_bomb", False, bad_gzip_bomb, 1), ("bad_method", False, bad_method, 3),
    ("slowloris", False, slow_header, 2), ("disconnect_stream", False, disconnect_stream, 5),
    ("disconnect_plain", False, disconnect_plain, 4),
]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", default="build/bin/nucleus")
    ap.add_argument("--model", default="models/tiny-dsv3")
    ap.add_argument("--duration", type=float, default=600)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--result-json")
    args = ap.parse_args()

    port = free_port()
    log = open("/tmp/nucleus_soak_server.log", "w")
    server = subprocess.Popen([args.bin, "serve", "--device", "cpu", "--model", args.model, "--host", HOST,
                               "--port", str(port)], stdout=log, stderr=subprocess.STDOUT)
    try:
        for _ in range(600):
            try:
                c = http.client.HTTPConnection(HOST, port, timeout=2)
                c.request("GET", "/health")
                if c.getresponse().status == 200:
                    break
            except OSError:
                time.sleep(0.1)
        else:
            sys.exit("server did not start")
        ref_status, ref_text = greedy(port)
        m0 = metrics(port)
        rss0 = rss_bytes(server.pid)
        counts, latencies, lock = {}, [], threading.Lock()
        stop_at = time.time() + args.duration
        names = [c for c in CASES for _ in range(c[3])]

        def worker(i):
            rng = random.Random(args.seed * 1000 + i)
            while time.time() < stop_at:
                name, good, fn, _ = rng.choice(names)
                t0 = time.time()
                try:
                    status = fn(port, rng)
                except Exception as e:  # noqa: BLE001: counted, never fatal to the soak
                    status = "exception:" + type(e).__name__
                dt = time.time() - t0
                with lock:
                    key = f"{name} {status}"
                    counts[key] = counts.get(key, 0) + 1
                    if good and status == 200:
                        latencies.append(dt)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(args.concurrency)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        time.sleep(2)
        m1 = metrics(port)
        rss1 = rss_bytes(server.pid)
        end_status, end_text = greedy(port)
        latencies.sort()
        q = lambda p: latencies[min(len(latencies) - 1, int(p * len(latencies)))] if latencies else None  # noqa: E731
        result = {
            "duration_s": args.duration, "concurrency": args.concurrency,
            "requests": sum(counts.values()), "by_case_and_status": dict(sorted(counts.items())),
            "good_ok": len(latencies), "good_latency_p50_s": q(0.5), "good_latency_p99_s": q(0.99),
            "rss_before_mib": rss0 / 2 ** 20, "rss_after_mib": rss1 / 2 ** 20,
            "kv_blocks_used_before": m0.get("nucleus_kv_blocks_used"), "kv_blocks_used_after": m1.get("nucleus_kv_blocks_used"),
            "requests_running_after": m1.get("nucleus_num_requests_running"),
            "same_greedy_text_after": (ref_status, ref_text) == (end_status, end_text),
            "server_alive": server.poll() is None,
        }
        print(json.dumps(result, indent=2))
        if args.result_json:
            with open(args.result_json, "w") as f:
                json.dump(result, f, indent=2)
        bad_good = {k: v for k, v in counts.items() if k.split()[0] in {c[0] for c in CASES if c[1]}
                    and not k.endswith(" 200")}
        ok = result["server_alive"] and result["same_greedy_text_after"] and result["kv_blocks_used_after"] == 0
        if bad_good:
            print("good requests that failed:", bad_good, file=sys.stderr)
        sys.exit(0 if ok and not bad_good else 1)
    finally:
        server.terminate()
        server.wait(timeout=60)


if __name__ == "__main__":
    main()
