"""A peer that shuts down cleanly says goodbye (BYE) on real sockets: the others forget it at once,
not after ``peer_timeout`` (the state machine and virtual-time cases are in tests/sim/test_goodbye.py)."""
from __future__ import annotations

import time

import numpy as np

import zgossip


def test_goodbye_on_real_sockets():
    kw = dict(prefix="bye", gossip_interval=0.05, peer_timeout=5.0)
    a = zgossip.Averager([np.zeros(4, np.float32)], **kw)
    others = []
    try:
        for _ in range(2):
            others.append(zgossip.Averager([np.zeros(4, np.float32)], initial_peers=[a.endpoint], **kw))
        b, c = others
        deadline = time.monotonic() + 10
        while any(len(x.peers()) < 2 for x in (a, b, c)):
            assert time.monotonic() < deadline, "membership did not converge"
            time.sleep(0.01)
        c.shutdown()
        stopped = time.monotonic()
        while c.peer_id in a.peers() or c.peer_id in b.peers():
            assert time.monotonic() - stopped < 2.0, "the others still count the stopped peer live (peer_timeout is 5 s)"
            time.sleep(0.01)
        time.sleep(0.3)
        assert a.peers() == [b.peer_id] and b.peers() == [a.peer_id]
    finally:
        for x in [a, *others]:
            x.shutdown()
