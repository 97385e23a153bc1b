"""Run the same protocol scenario on either transport: SimPy (virtual time) or ZeroMQ (real sockets)."""
from __future__ import annotations

import concurrent.futures as cf
import time
from typing import Any, Sequence

import numpy as np

import zgossip
from sim import SimCluster
from zgossip.node import NodeConfig, StepDone

TRANSPORTS = ["sim", "zmq"]

#: Averager arguments that are not NodeConfig's (the sim harness passes them to `add_peer`)
AVERAGER_ONLY = ("compression", "error_feedback")

FAST = dict(gossip_interval=0.05, peer_timeout=2.0, matchmaking_time=0.5, request_timeout=0.3, part_timeout=2.0)


class SimHarness:
    def __init__(self, tensors: Sequence[Sequence[np.ndarray]], per_peer: Sequence[dict] | None = None, seed: int = 0, **cfg: Any) -> None:
        self.cluster = SimCluster(seed=seed)
        self.peers = []
        for i, ts in enumerate(tensors):
            kw = {**FAST, **cfg, **(per_peer[i] if per_peer else {})}
            kw.setdefault("prefix", "test")
            initial = [self.peers[0].endpoint] if self.peers else []
            extra = {k: kw.pop(k) for k in AVERAGER_ONLY if k in kw}
            self.peers.append(self.cluster.add_peer(NodeConfig(**kw), initial_peers=initial, tensors=ts, **extra))
        self.cluster.run(until=self.cluster.env.now + 1.0)  # gossip converges
        for p in self.peers:
            assert len(p.node.membership.live_ids()) == len(self.peers) - 1

    def tensors(self, i: int) -> list[np.ndarray]:
        return self.peers[i].tensors

    def step_all(self, weights: Sequence[float] | None = None, gathers: Sequence[Any] | None = None,
                 timeout: float = 5.0, indices: Sequence[int] | None = None) -> list[Any]:
        idx = range(len(self.peers)) if indices is None else indices
        evs = []
        for i in idx:
            w = 1.0 if weights is None else weights[i]
            g = None if gathers is None else gathers[i]
            evs.append(self.peers[i].step_tensors(weight=w, gather=g, timeout=timeout))
        self.cluster.run(until=self.cluster.env.all_of(evs))
        return [e.value.result if isinstance(e.value, StepDone) else e.value.error for e in evs]

    def close(self) -> None:
        pass


class ZmqHarness:
    def __init__(self, tensors: Sequence[Sequence[np.ndarray]], per_peer: Sequence[dict] | None = None, seed: int = 0, **cfg: Any) -> None:
        self.avgs: list[zgossip.Averager] = []
        self._tensors = [list(ts) for ts in tensors]
        try:
            for i, ts in enumerate(tensors):
                kw = {**FAST, **cfg, **(per_peer[i] if per_peer else {})}
                kw.setdefault("prefix", "test")
                initial = [self.avgs[0].endpoint] if self.avgs else []
                self.avgs.append(zgossip.Averager(list(ts), initial_peers=initial, seed=seed * 100 + i, **kw))
            deadline = time.monotonic() + 10
            while any(len(a.peers()) < len(self.avgs) - 1 for a in self.avgs):
                assert time.monotonic() < deadline, "membership did not converge"
                time.sleep(0.02)
        except BaseException:
            self.close()
            raise

    def tensors(self, i: int) -> list[np.ndarray]:
        return self._tensors[i]

    def step_all(self, weights: Sequence[float] | None = None, gathers: Sequence[Any] | None = None,
                 timeout: float = 5.0, indices: Sequence[int] | None = None) -> list[Any]:
        idx = range(len(self.avgs)) if indices is None else indices
        futs = []
        for i in idx:
            w = 1.0 if weights is None else weights[i]
            g = None if gathers is None else gathers[i]
            futs.append(self.avgs[i].step(weight=w, gather=g, timeout=timeout, wait=False))
        out = []
        for f in futs:
            try:
                out.append(f.result(timeout + 30))
            except (zgossip.ZGossipError, cf.TimeoutError) as e:
                out.append(e)
        return out

    def close(self) -> None:
        for a in self.avgs:
            a.shutdown()


def make(transport: str, tensors, per_peer=None, seed: int = 0, **cfg):
    return (SimHarness if transport == "sim" else ZmqHarness)(tensors, per_peer, seed, **cfg)


def virtual_swarm(n: int, make: Any, body: Any, seed: int = 0, latency: float = 0.005,
                  start_at: Sequence[float] | None = None, fast: dict | None = None) -> tuple[list, list]:
    """`n` training peers on the simulator's transport, each built by ``make(i, initial_peers, averager_opts)``
    and driven by ``body(i, peer)`` in its own simulated thread, peer ``i`` starting at virtual time
    ``start_at[i]`` (a late joiner). Waits and sleeps cost no wall time and one seed gives one run; the
    simulated threads end when their bodies return. Returns (peers, what each body returned)."""
    from sim import NetworkModel, SimPeer

    cl = SimCluster(seed=seed, network=NetworkModel(latency=latency))
    peers: list = [None] * n
    out: list = [None] * n
    opts = dict(FAST if fast is None else fast)
    opts.pop("matchmaking_time", None)  # the training classes set their own window

    def life(i: int) -> None:
        if start_at is not None and start_at[i] > 0:
            cl.clock.sleep(start_at[i])
        ep = f"sim://peer{i}"
        peer = SimPeer(cl, ep)
        cl.peers[ep] = peer
        peers[i] = make(i, [] if i == 0 else ["sim://peer0"], {**opts, "transport": peer, "seed": [seed, i]})
        # the cluster reaches a peer's averager through its SimPeer (the Accumulator keeps it private)
        peer.averager = getattr(peers[i], "averager", None) or peers[i]._averager
        out[i] = body(i, peers[i])

    threads = [cl.spawn(life, i, name=f"trainer{i}") for i in range(n)]
    cl.run(until=cl.env.all_of([t.done for t in threads]))
    cl.clock.close()
    return peers, out
