"""Link measurements on a testbed: each host's RTT and TCP throughput to a fast partner, vs configured.

`selftest(hosts)` builds a `sim.testbed.Testbed`, and for each host i picks the fastest
other host j (highest min(up, down), then lowest latency) and measures

* RTT: median of 20 one-byte TCP ping-pongs (TCP_NODELAY); configured 2 * (lat_i + lat_j);
* up / down: TCP goodput i -> j and j -> i over the second half of a ~2 s transfer (after
  slow start); configured min(up_i, down_j) and min(up_j, down_i). Goodput is payload:
  ~95 % of the tbf rate, which counts Ethernet/IP/TCP headers too.

This module is also the probe process itself (``python -m sim.testbed_probe serve|rtt|send``).
"""
from __future__ import annotations

import json
import socket
import statistics
import subprocess
import sys
import time
from typing import Sequence

__all__ = ["selftest", "format_selftest"]

_PORT = 42000


def _serve(ip: str, port: int, timeout: float) -> None:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    s.bind((ip, port))
    s.listen(4)
    s.settimeout(timeout)
    print(json.dumps({"listening": True}), flush=True)
    while True:
        try:
            c, _ = s.accept()
        except socket.timeout:
            return
        c.settimeout(timeout)
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        kind = c.recv(1)
        if kind == b"p":  # ping-pong
            while (b := c.recv(1)) and b != b"q":
                c.sendall(b)
        elif kind == b"t":  # throughput: count bytes until EOF, answer the rate of the second half
            marks = []
            n = 0
            while True:
                d = c.recv(1 << 20)
                if not d:
                    break
                n += len(d)
                marks.append((time.monotonic(), n))
            t0, t1 = marks[0][0], marks[-1][0]
            mid = t0 + (t1 - t0) / 2
            first = next(m for m in marks if m[0] >= mid)
            rate = (n - first[1]) * 8 / max(1e-9, t1 - first[0]) / 1e6
            print(json.dumps({"mbit": rate, "bytes": n, "seconds": t1 - t0}), flush=True)
        elif kind == b"x":
            c.close()
            return
        c.close()


def _rtt(ip: str, port: int, n: int) -> None:
    c = socket.create_connection((ip, port), timeout=10)
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    c.sendall(b"p")
    rtts = []
    for _ in range(n):
        t = time.monotonic()
        c.sendall(b"1")
        c.recv(1)
        rtts.append(time.monotonic() - t)
    c.sendall(b"q")
    c.close()
    print(json.dumps({"rtt_ms": statistics.median(rtts) * 1e3, "min_ms": min(rtts) * 1e3}), flush=True)


def _send(ip: str, port: int, seconds: float) -> None:
    c = socket.create_connection((ip, port), timeout=30)
    c.sendall(b"t")
    chunk = b"\0" * (1 << 20)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        c.sendall(chunk)
    c.shutdown(socket.SHUT_WR)
    try:
        c.recv(1)  # wait for the server to close: everything arrived
    except ConnectionResetError:  # the server closes with linger 0
        pass
    c.close()


def _partner(hosts: Sequence, i: int) -> int:
    others = [j for j in range(len(hosts)) if j != i]
    return max(others, key=lambda j: (min(hosts[j].up_mbit, hosts[j].down_mbit), -hosts[j].latency_ms, -j))


def selftest(hosts: Sequence, seed: int = 0, seconds: float = 2.0) -> dict:
    """Configured vs measured RTT and TCP goodput for every host (needs >= 2 hosts)."""
    from .testbed import Testbed, machine_info

    if len(hosts) < 2:
        raise ValueError("the selftest needs at least two hosts")
    me = [sys.executable, "-m", "sim.testbed_probe"]
    rows = []
    with Testbed(hosts, seed=seed) as tb:
        t0 = tb.forwarder_stats()["cpu_seconds"]
        servers = []
        for k in range(tb.n):
            p = tb.popen(k, [*me, "serve", tb.ip(k), str(_PORT), "60"], stdout=subprocess.PIPE, text=True)
            servers.append(p)
        for p in servers:
            p.stdout.readline()
        for i in range(tb.n):
            j = _partner(hosts, i)
            hi, hj = hosts[i], hosts[j]
            rtt = json.loads(tb.run(i, [*me, "rtt", tb.ip(j), str(_PORT), "20"], timeout=30).stdout)
            res = {}
            for key, src, dst in (("up", i, j), ("down", j, i)):
                out = tb.run(src, [*me, "send", tb.ip(dst), str(_PORT), str(seconds)], timeout=seconds + 60)
                if out.returncode != 0:
                    raise RuntimeError(f"throughput probe {src}->{dst} failed: {out.stderr.strip()[-300:]}")
                res[key] = json.loads(servers[dst].stdout.readline())["mbit"]
            rows.append({"host": i, "partner": j,
                         "rtt_ms": {"configured": 2 * (hi.latency_ms + hj.latency_ms), "measured": rtt["rtt_ms"]},
                         "up_mbit": {"configured": min(hi.up_mbit, hj.down_mbit), "measured": res["up"]},
                         "down_mbit": {"configured": min(hj.up_mbit, hi.down_mbit), "measured": res["down"]}})
        fwd = tb.forwarder_stats()
        for k in range(tb.n):
            tb.run(k, [sys.executable, "-c", f"import socket; socket.create_connection(('{tb.ip(k)}', {_PORT})).send(b'x')"],
                   timeout=10)
    return {"links": rows, "forwarder": {"cpu_seconds": fwd["cpu_seconds"] - t0, "late_mean_us": fwd["late_mean_us"],
                                         "late_max_us": fwd["late_max_us"]}, "machine": machine_info()}


def format_selftest(st: dict) -> str:
    lines = [f"{'host':>4} {'partner':>7} {'RTT ms cfg':>10} {'measured':>9} {'up Mbit cfg':>11} {'measured':>9} "
             f"{'down Mbit cfg':>13} {'measured':>9}"]
    for r in st["links"]:
        lines.append(f"{r['host']:>4} {r['partner']:>7} {r['rtt_ms']['configured']:>10.1f} {r['rtt_ms']['measured']:>9.2f} "
                     f"{r['up_mbit']['configured']:>11.1f} {r['up_mbit']['measured']:>9.1f} "
                     f"{r['down_mbit']['configured']:>13.1f} {r['down_mbit']['measured']:>9.1f}")
    f = st["forwarder"]
    lines.append(f"forwarder: {f['cpu_seconds']:.2f} CPU s; frames released {f['late_mean_us']:.0f} us late on "
                 f"average (max {f['late_max_us'] / 1e3:.1f} ms); goodput excludes ~5% Ethernet/IP/TCP headers")
    return "\n".join(lines)


def main(argv: Sequence[str]) -> int:
    cmd = argv[0]
    if cmd == "serve":
        _serve(argv[1], int(argv[2]), float(argv[3]))
    elif cmd == "rtt":
        _rtt(argv[1], int(argv[2]), int(argv[3]))
    elif cmd == "send":
        _send(argv[1], int(argv[2]), float(argv[3]))
    else:
        print(f"unknown probe command {cmd}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
