"""`zgossip.cuts`: which closed connections count as cut, and from whom (pure bookkeeping, time passed in).
The calls stand for the ROUTER monitor's events (accepted, closed, handshake_failed) and the
driver's first message of a connection (opened), in the orders libzmq can deliver them."""
from __future__ import annotations

import logging

from zgossip.cuts import UNKNOWN_SOURCE, ConnectionCuts
from zgossip.droplog import DropLog

LOG = logging.getLogger("test.cuts")


def make(cap: int = 8192) -> tuple[ConnectionCuts, dict]:
    stats: dict = {}
    return ConnectionCuts(stats, DropLog("node"), LOG, limit_bytes=1000, grace=0.5, cap=cap), stats


def lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "closed without goodbye" in r.getMessage()]


def test_a_cut_counts_after_its_grace_and_logs_once_per_source(caplog) -> None:
    cuts, stats = make()
    caplog.set_level(logging.WARNING)
    for t, rid in ((0.0, b"r1"), (1.0, b"r2")):
        cuts.accepted("7")
        cuts.opened("7", rid, "p1", "peer p1")
        cuts.closed("7", t + 0.1)
        assert cuts.next_deadline() == t + 0.6
        cuts.on_timer(t + 0.5)
        assert stats["connections_cut"] == int(t)  # not yet
        cuts.on_timer(t + 0.6)
    assert stats["connections_cut"] == 2
    assert len(lines(caplog)) == 1 and "peer p1" in lines(caplog)[0] and "1000-byte limit" in lines(caplog)[0]
    assert cuts.next_deadline() is None and not cuts.conns and not cuts._slots


def test_a_goodbye_within_the_grace_excuses_every_connection_of_that_peer(caplog) -> None:
    cuts, stats = make()
    for fd, rid in (("5", b"lane1"), ("6", b"lane0")):
        cuts.accepted(fd)
        cuts.opened(fd, rid, "p", "peer p")
    cuts.closed("5", 1.0)  # its results lane closes first ...
    cuts.said_goodbye("p", 1.2)  # ... the BYE on the other lane is read later
    cuts.closed("6", 1.2)
    cuts.on_timer(5.0)
    assert stats["connections_cut"] == 0 and not lines(caplog)
    cuts.accepted("6")
    cuts.opened("6", b"again", "p", "peer p")  # back, and gone without goodbye this time
    cuts.closed("6", 61.0)
    cuts.on_timer(62.0)
    assert stats["connections_cut"] == 1


def test_a_probe_then_a_peer_on_the_same_descriptor() -> None:
    """A peer on this host probes our local socket (no handshake), then connects; libzmq gives the
    probe's descriptor to the real connection. The driver reads the monitor before the first message."""
    cuts, stats = make()
    cuts.accepted("9")  # the probe
    cuts.handshake_failed()
    cuts.accepted("9")  # the peer, on the same descriptor: the probe's DISCONNECTED is not read yet
    cuts.opened("9", b"peer", "a", "peer a")
    cuts.closed("9", 1.0)  # the probe's
    cuts.on_timer(2.0)
    assert stats["connections_cut"] == 0 and cuts.conns["9"][1] == "a"
    cuts.closed("9", 3.0)  # the peer's
    cuts.on_timer(4.0)
    assert stats["connections_cut"] == 1 and not cuts._slots


def test_a_first_message_read_after_its_disconnect_still_names_the_source(caplog) -> None:
    cuts, stats = make()
    caplog.set_level(logging.WARNING)
    cuts.accepted("4")
    cuts.closed("4", 0.0)  # the monitor was read before the connection's queued message
    cuts.opened("4", b"late", "b", "peer b")
    cuts.on_timer(1.0)
    assert stats["connections_cut"] == 1 and "peer b" in lines(caplog)[0]


def test_failed_handshakes_are_no_cuts_but_other_silent_connections_are(caplog) -> None:
    cuts, stats = make()
    caplog.set_level(logging.WARNING)
    cuts.accepted("3")
    cuts.accepted("4")
    cuts.handshake_failed()
    cuts.closed("3", 0.0)  # the failed handshake's connection
    cuts.closed("4", 0.0)  # no message, no failed handshake: its first frame was over the limit (or it died)
    cuts.on_timer(1.0)
    assert stats["connections_cut"] == 1
    assert len(lines(caplog)) == 1 and UNKNOWN_SOURCE in lines(caplog)[0]


def test_a_source_learnt_later_replaces_an_unknown_one_and_leaving_counts_nothing() -> None:
    cuts, stats = make()
    cuts.accepted("8")
    cuts.opened("8", b"r", None, "a sender without keys")  # undecodable first message
    assert cuts.conns["8"][2] == "a sender without keys"
    cuts.opened("8", b"r", "q", "q at tcp://h:1")
    assert cuts.conns["8"][1:3] == ["q", "q at tcp://h:1"]
    cuts.closed("8", 1.0)
    cuts.on_timer(2.0, counting=False)  # this node is leaving
    assert stats["connections_cut"] == 0


def test_memory_is_bounded() -> None:
    cuts, stats = make(cap=4)
    for i in range(100):
        cuts.handshake_failed()
    for i in range(100):
        for _ in range(20):
            cuts.accepted(str(i))
        cuts.opened(str(i), b"r", f"p{i}", f"peer p{i}")
        cuts.said_goodbye(f"p{i}", 0.0)
        cuts.closed(str(1000 + i), 0.0)  # (its ACCEPTED was lost)
    assert len(cuts._slots) <= 4 and all(len(s) <= 8 for s in cuts._slots.values())
    assert len(cuts.conns) <= 4 and len(cuts._goodbyes) <= 4 and cuts._failed_handshakes <= 4
    assert len(cuts._waiting) <= 4
    cuts.on_timer(10.0)
    assert stats["connections_cut"] == 100 - 4  # four matched off the (bounded) failed handshakes


def test_a_silent_lane_closing_with_a_known_one_is_that_peers(caplog) -> None:
    """A peer opens its results lane early (wire.warm_lanes) and may never use it: when it leaves
    with a goodbye nothing counts; when it crashes its two connections count once, by its id; a
    silent connection closing alone counts with an unknown source."""
    cuts, stats = make()
    caplog.set_level(logging.WARNING)
    for t, bye in ((0.0, True), (10.0, False)):
        cuts.accepted("1")
        cuts.opened("1", b"lane0-%d" % t, "p", "peer p")
        cuts.accepted("2")  # its results lane: nothing sent on it
        if bye:
            cuts.said_goodbye("p", t)
        cuts.closed("2", t + 0.01)  # (either may be reported first)
        cuts.closed("1", t + 0.02)
        cuts.on_timer(t + 1.0)
    assert stats["connections_cut"] == 1
    assert len(lines(caplog)) == 1 and "peer p" in lines(caplog)[0]
    cuts.accepted("3")
    cuts.closed("3", 20.0)  # alone: e.g. its first frame was over the limit
    cuts.on_timer(21.0)
    assert stats["connections_cut"] == 2 and UNKNOWN_SOURCE in lines(caplog)[1]
