"""The ZeroMQ driver's user-thread calls: coalesced wake-ups lose nothing and keep each thread's order."""
from __future__ import annotations

import threading
import time

import numpy as np

import zgossip


def _avg() -> zgossip.Averager:
    return zgossip.Averager([np.zeros(4, np.float32)], prefix="calls", gossip_interval=0.5)


def test_many_threads_calling_at_once_every_call_runs_once_in_each_threads_order() -> None:
    with _avg() as a:
        tr = a._transport
        seen: list[tuple[int, int]] = []  # appended on the I/O thread only

        def worker(t: int) -> None:
            for k in range(2000):
                tr.call(lambda now, t=t, k=k: seen.append((t, k)))

        threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(30)
        count = tr.run_on_io(lambda node, now: len(seen), 10.0)  # a woken call runs after every earlier one
        assert count == 4 * 2000
        for t in range(4):
            assert [k for tt, k in seen if tt == t] == list(range(2000))


def test_publish_reaches_the_other_peer() -> None:
    with _avg() as a, zgossip.Averager([np.zeros(4, np.float32)], prefix="calls", gossip_interval=0.1,
                                        initial_peers=[a.endpoint]) as b:
        b.publish(epoch=7)
        deadline = time.monotonic() + 10
        while a.peer_infos().get(b.peer_id, {}).get("epoch") != 7:
            assert time.monotonic() < deadline, "b's published record never reached a"
            time.sleep(0.02)
