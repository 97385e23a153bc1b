"""One testbed host's peer process: a real `zgossip.Averager` driven over stdin/stdout JSON lines.

Started by `sim.testbed_run` inside the host's namespace (``python -m sim.testbed_peer``).
The first stdin line is its configuration::

    {"slot": 0, "listen": "tcp://10.x.y.1:41000", "initial_peers": [...], "tensor": "/dev/shm/...",
     "dtype": "float32", "averager": {...Averager keyword arguments...}}

It loads its tensor from ``tensor`` (the controller writes the simulator's initial values
there; after a crash the file still holds what the slot had after its last step, which is
what a rejoining process starts from), answers ``{"ready": ...}``, then serves:

    {"cmd": "step", "round": r, "at": MONOTONIC, "timeout": s, "ahead": s} -> outcome, group,
        timings, wall seconds from ``at``; the tensor is written back to ``tensor`` before the
        answer. ``ahead`` > 0: a scheduled step, called ``ahead`` seconds before ``at`` with
        ``scheduled_time=at`` (its all-reduce begins at ``at``)
    {"cmd": "info"} -> {"info": true, "endpoint", "peers": [peer ids it knows], "stats": {...}}
    {"cmd": "state", "timeout": s} -> {"state": "done", "sums": [float64 sum per array]} or
        {"state": "failed", "error": ...}: `load_state_from_peers`
    {"cmd": "stop"}

``"listen": null`` starts the peer in client mode (it binds nothing); ``curve.allowed`` lists the
public keys it accepts.

The controller is not on the emulated network: commands travel on the pipes. Protocol
lines go to the original stdout only; anything else printed lands on stderr.
"""
from __future__ import annotations

import json
import logging
import os
import sys
import time

import numpy as np


def _write_tensor(path: str, arr: np.ndarray) -> None:
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        np.save(f, arr)
    os.replace(tmp, path)  # the controller never reads a half-written file


def main() -> int:
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # stray prints must not corrupt the protocol
    logging.basicConfig(level=os.environ.get("ZGOSSIP_LOG", "WARNING"), stream=sys.stderr)

    def say(obj: dict) -> None:
        out.write(json.dumps(obj) + "\n")

    cfg = json.loads(sys.stdin.readline())
    from zgossip.averager import Averager
    from zgossip.errors import ZGossipError

    data = np.ascontiguousarray(np.load(cfg["tensor"]).astype(cfg["dtype"], copy=False))
    sec = {}
    if cfg.get("curve"):
        from zgossip.identity import KeyPair

        c = cfg["curve"]
        sec = {"secret_key": KeyPair(c["public"], c["secret"]), "allowed_keys": c["allowed"]}
    avg = Averager([data], listen=cfg["listen"], initial_peers=cfg["initial_peers"], local_ipc=False,
                   client_mode=cfg["listen"] is None, **cfg["averager"], **sec)
    say({"ready": True, "endpoint": avg.endpoint, "peer_id": avg.peer_id, "pid": os.getpid(),
         "t": time.monotonic()})
    try:
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd["cmd"] == "stop":
                break
            if cmd["cmd"] == "info":
                say({"info": True, "endpoint": avg.endpoint, "peers": sorted(avg.peers()), "stats": avg.stats})
                continue
            if cmd["cmd"] == "state":
                try:
                    _meta, arrays = avg.load_state_from_peers(timeout=float(cmd["timeout"]), chunk_timeout=2.0)
                    say({"state": "done", "sums": [float(np.asarray(a, np.float64).sum()) for a in arrays]})
                except ZGossipError as e:
                    say({"state": "failed", "error": f"{type(e).__name__}: {str(e)[:300]}"})
                continue
            if cmd["cmd"] != "step":
                say({"error": f"unknown command {cmd['cmd']!r}"})
                continue
            at, ahead = float(cmd["at"]), float(cmd.get("ahead", 0.0))
            time.sleep(max(0.0, at - ahead - time.monotonic()))  # the common start instant (one clock machine-wide)
            begin = time.monotonic()
            rep: dict = {"round": cmd["round"], "slot": cfg["slot"], "late_start": begin - (at - ahead)}
            try:
                if ahead:
                    ctl = avg.step(timeout=float(cmd["timeout"]), round=int(cmd["round"]), scheduled_time=at, wait=False)
                    res = ctl.result(timeout=ahead + float(cmd["timeout"]) + avg.config.allreduce_timeout + 5.0)
                else:
                    res = avg.step(timeout=float(cmd["timeout"]), round=int(cmd["round"]))
                end = time.monotonic()
                rep.update(outcome="done", group_id=res.group_id, group_size=len(res.members),
                           members=list(res.members), contributors=list(res.contributors), lost=list(res.lost),
                           complete=res.complete, timings=res.timings, bytes_sent=res.bytes_sent,
                           bytes_received=res.bytes_received, deadlines=res.deadlines,
                           span_parts=[s.parts for s in res.spans])
                try:
                    rep["bandwidth_estimates"] = avg.bandwidth_estimates()
                    rep["link_rates"] = avg.link_rates()
                except ZGossipError:
                    pass
            except (ZGossipError, TimeoutError) as e:
                end = time.monotonic()
                rep.update(outcome="failed", error=type(e).__name__, message=str(e)[:300])
            rep["wall"] = end - begin
            rep["seconds"] = max(0.0, end - at)
            with avg.get_tensors() as ts:
                _write_tensor(cfg["tensor"], ts[0])
            say(rep)
    finally:
        avg.shutdown(2.0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
