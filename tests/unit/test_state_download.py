"""State download alone: a StateDonor and StateDownloads driven directly, messages carried by hand."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from handfed import Outbox, ep, membership_with, pid
from zgossip import messages as M
from zgossip.errors import StateUnavailable
from zgossip.state import DownloadPhase, StateDonor, StateDownload

STATE = [np.arange(40, dtype=np.float32).reshape(4, 10), np.array([1, 2, 3], dtype=np.int64)]


class Newcomer:
    def __init__(self, donors: dict[int, float], deadline: float = 10.0) -> None:
        self.out = Outbox()
        m = membership_with(1, [], self.out)
        m.merge([(pid(i), ep(i), 1, share, {}) for i, share in donors.items()], 0.0)
        self.done: list[tuple] = []
        self.dl = StateDownload("req1", m, self.out, np.random.default_rng(0), 0.0, deadline, 1.0, 1 << 20,
                                lambda dl, meta, arrays, err: self.done.append((meta, arrays, err)))

    def carry(self, msgs, now: float, mutate=None) -> None:
        for _, msg in msgs:
            if mutate is not None:
                msg = mutate(msg)
            (self.dl.on_meta if isinstance(msg, M.StateMeta) else self.dl.on_chunk)(msg, now)


def donor(i: int) -> tuple[StateDonor, Outbox]:
    out = Outbox()
    return StateDonor(pid(i), ep(i), out, chunk_bytes=64), out


def test_download_from_the_best_donor_chunk_by_chunk():
    n = Newcomer({2: 1.0, 3: 5.0})
    n.dl.start(0.0)
    [(to, req)] = n.out.take()
    assert to == ep(3) and isinstance(req, M.StateReq) and req.req == "req1"
    d, dout = donor(3)
    d.serve(req.req, ep(1), {"epoch": 7}, STATE)
    sent = dout.take()
    assert isinstance(sent[0][1], M.StateMeta) and sent[0][1].ok
    assert [m.index for _, m in sent[1:]] == list(range(len(sent) - 1)) and len(sent) - 1 == 3 + 1
    n.carry(sent[:1], 0.1)
    assert n.dl.phase is DownloadPhase.STREAMING
    n.carry(sent[1:], 0.2)
    [(meta, arrays, err)] = n.done
    assert err is None and meta == {"epoch": 7}
    for a, b in zip(arrays, STATE):
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
    assert n.dl.phase is DownloadPhase.DONE and n.dl.next_deadline() is None


def test_a_corrupted_chunk_fails_the_checksum_and_the_next_donor_is_asked():
    n = Newcomer({2: 1.0, 3: 5.0})
    n.dl.start(0.0)
    d, dout = donor(3)
    d.serve("req1", ep(1), None, STATE)

    def flip(msg):
        if isinstance(msg, M.StateChunk) and msg.index == 1:
            bad = msg.data.copy()
            bad[0] ^= 1
            return dataclasses.replace(msg, data=bad)
        return msg

    n.out.take()
    n.carry(dout.take(), 0.1, mutate=flip)
    assert not n.done
    [(to, req)] = n.out.take()
    assert to == ep(2) and "checksum mismatch" in n.dl.history[-1]


def test_refusal_then_silence_then_nobody_left():
    n = Newcomer({2: 1.0, 3: 5.0})
    n.dl.start(0.0)
    d, dout = donor(3)
    d.refuse("req1", ep(1), "busy")
    n.carry(dout.take(), 0.1)
    assert [e for e, _ in n.out.take()] == [ep(3), ep(2)]
    n.dl.on_timer(1.1)  # asked at 0.1, no answer within the chunk timeout of 1 s
    [(meta, arrays, err)] = n.done
    assert isinstance(err, StateUnavailable) and "refused: busy" in str(err) and "no answer" in str(err)


def test_a_chunk_out_of_order_or_of_the_wrong_size_is_refused():
    n = Newcomer({3: 1.0})
    n.dl.start(0.0)
    d, dout = donor(3)
    d.serve("req1", ep(1), None, STATE)
    sent = dout.take()
    n.carry(sent[:1], 0.1)
    n.carry(sent[2:3], 0.2)  # chunk 1 before chunk 0
    assert "does not match" in n.dl.history[-1]
    [(meta, arrays, err)] = n.done  # no other donor
    assert isinstance(err, StateUnavailable)


def test_donor_refuses_a_state_it_cannot_send():
    d, dout = donor(3)
    d.serve("r", ep(1), None, [np.zeros(3, dtype=np.complex64)])
    [(_, meta)] = dout.take()
    assert not meta.ok and "complex64" in meta.reason


@pytest.mark.parametrize("limit", [100])
def test_state_larger_than_the_limit_is_refused(limit):
    n = Newcomer({3: 1.0})
    n.dl.max_bytes = limit
    n.dl.start(0.0)
    d, dout = donor(3)
    d.serve("req1", ep(1), None, STATE)
    n.carry(dout.take()[:1], 0.1)
    assert "limit" in n.dl.history[-1]
