"""Where a state download spends its time: per-thread CPU of the downloader and the donors, CPU inside
StateDownload.on_chunk and inside SHA-256, for 1 donor and for k, with the hashing thread on and off
(ZmqDriver._HASH_ELSEWHERE_BYTES), for each chunk window (StateDownload.window).

Usage (from the repository root): PYTHONPATH=. flock /tmp/zgossip-measure.lock \
    python docs/profile_state_download.py SIZE_MIB DONORS REPS WINDOWS[,..] [CHUNK_MIB]
Each rep runs (1, off) (1, on) (k, on) (k, off), reversed on odd reps (ABBA)."""
import os, sys, time, statistics, json
import numpy as np
from zgossip import bench_state as B

def threads(pid):
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                s = f.read()
            name = s[s.index("(") + 1:s.rindex(")")]
            fl = s.rsplit(")", 1)[1].split()
            key = "main" if tid == str(pid) else name
            u, k = int(fl[11]) / 100, int(fl[12]) / 100
            a = out.setdefault(key, [0.0, 0.0]); a[0] += u; a[1] += k
        except OSError:
            pass
    return out

def dl_main(conn, peers, donors, chunk, timeout, window, offload):
    import hashlib, threading
    from zgossip import state as S
    from zgossip.averager import Averager
    acc = {"hash": 0.0, "copy": 0.0, "chunk_total": 0.0, "n": 0}
    orig_start = S.StateDownload.start
    def start(self, now):
        self.window = window
        return orig_start(self, now)
    S.StateDownload.start = start
    orig_digest = S.chunk_digest
    def digest(data):
        t = time.thread_time(); r = orig_digest(data); acc["hash"] += time.thread_time() - t; return r
    S.chunk_digest = digest
    orig_on_chunk = S.StateDownload.on_chunk
    def on_chunk(self, msg, now, digest=None, placed_in=None):
        t = time.thread_time(); orig_on_chunk(self, msg, now, digest, placed_in); acc["chunk_total"] += time.thread_time() - t; acc["n"] += 1
    S.StateDownload.on_chunk = on_chunk
    av = Averager([np.zeros(1)], prefix=B.PREFIX, initial_peers=list(peers), local_ipc=False,
                  allow_state_sharing=False, state_chunk_bytes=chunk, **B._PEER_OPTS)
    try:
        while av._ask_node(lambda node: len(node.membership.donors())) < donors:
            time.sleep(0.05)
        io_tid = av._ask_node(lambda node: threading.get_native_id())
        conn.send({"event": "ready", "io_tid": io_tid})
        while True:
            m = conn.recv()
            if m == "stop": break
            _, k, off = m
            import zgossip.zmq_driver as Z
            Z._HASH_ELSEWHERE_BYTES = (1 << 16) if off else (1 << 62)
            for key in acc: acc[key] = 0
            t0 = time.perf_counter()
            meta, arrays = av.load_state_from_peers(timeout=timeout, chunk_timeout=10.0, apply=False, donors=k)
            dt = time.perf_counter() - t0
            del arrays
            conn.send({"event": "got", "seconds": dt, **acc})
    finally:
        av.shutdown(timeout=2.0)

def tid_cpu(pid, tid):
    with open(f"/proc/{pid}/task/{tid}/stat") as f:
        fl = f.read().rsplit(")", 1)[1].split()
    return (int(fl[11]) + int(fl[12])) / 100

if __name__ == "__main__":
    size_mib, donors, reps = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    windows = [int(w) for w in sys.argv[4].split(",")]
    chunk = int(float(sys.argv[5]) * (1 << 20)) if len(sys.argv) > 5 else 4 << 20
    size = size_mib << 20
    for window in windows:
        P = B._Procs()
        try:
            P.start(B.donor_main, size, chunk, [], 0, True, 0.0)
            first = P.recv(0, 60, "donor0")
            for i in range(1, donors):
                P.start(B.donor_main, size, chunk, [first["endpoint"]], 0, True, 0.0)
                P.recv(i, 60, f"donor{i}")
            d = P.start(dl_main, [first["endpoint"]], donors, chunk, 120.0, window, False)
            ready = P.recv(d, 60, "dl")
            dpid = P.procs[d].pid
            P.conns[d].send(("get", donors, True)); P.recv(d, 120, "warm")
            for rep in range(reps):
                for k, off in ([(1, False), (1, True), (donors, True), (donors, False)] if rep % 2 == 0 else [(donors, False), (donors, True), (1, True), (1, False)]):
                    th0 = threads(dpid); don0 = [threads(p.pid) for p in P.procs[:-1]]; io0 = tid_cpu(dpid, ready["io_tid"])
                    b0 = B._machine_busy()
                    P.conns[d].send(("get", k, off)); g = P.recv(d, 120, "get")
                    th1 = threads(dpid); don1 = [threads(p.pid) for p in P.procs[:-1]]; io1 = tid_cpu(dpid, ready["io_tid"])
                    busy = B._machine_busy() - b0
                    dth = {n: round(sum(th1[n]) - sum(th0.get(n, [0, 0])), 2) for n in th1}
                    dth = {n: v for n, v in dth.items() if v > 0.005}
                    dd = {}
                    for a, b in zip(don0, don1):
                        for n in b:
                            v = sum(b[n]) - sum(a.get(n, [0, 0]))
                            if v > 0.005: dd[n] = round(dd.get(n, 0) + v, 2)
                    print(f"window {window} k={k} offload={off:d}: {g['seconds']:.2f}s  io-thread cpu {io1-io0:.2f} (on_chunk {g['chunk_total']:.2f}, hash {g['hash']:.2f}) "
                          f"dl threads {dth} donors {dd} machine busy {busy:.2f}/{2*g['seconds']:.2f}", flush=True)
        finally:
            P.close()
