"""Measured bandwidth and adaptive deadlines, as pure functions: `zgossip.linkstats`,
`partition.plan_bandwidths`, and the node's check of gossiped estimates."""
from __future__ import annotations

import math

import numpy as np
import pytest

from zgossip.linkstats import LinkStats, silence_limit, valid_rate
from zgossip.messages import Gossip
from zgossip.node import Node, NodeConfig
from zgossip.partition import MEASURED, UNMEASURED, plan_bandwidths, span_fractions


def test_download_estimate_counts_concurrent_transfers_and_ignores_bursts():
    # 3 senders share a 10 MB/s (80 Mbit/s) downlink: each 256 KiB part takes 3 x 26 ms while the
    # three run side by side, so they complete in bursts of 3 within a millisecond
    ls = LinkStats()
    ls.begin(0.0)
    part = 256 << 10
    t = 0.0
    for k in range(12):
        t = (k + 1) * 3 * part / 10e6
        for j, who in enumerate("abc"):
            ls.on_payload(who, part, t + j * 1e-4)
    est = ls.estimate_mbit()
    assert est is not None and 70 <= est <= 81, est  # a per-message rate would read ~5000 Mbit/s


def test_no_estimate_before_a_round_carried_enough():
    ls = LinkStats()
    assert ls.estimate_mbit() is None
    ls.begin(0.0)
    ls.on_payload("a", 1000, 0.01)  # too little, too soon
    assert ls.estimate_mbit() is None
    ls.on_payload("b", 1 << 20, 1.0)  # after the round ended here: still a transfer of it
    assert ls.estimate_mbit() == pytest.approx(8.0 * ((1 << 20) + 1000) / 1e6)


def test_estimate_is_a_high_percentile_of_recent_rounds():
    ls = LinkStats(window=8)
    for r, rate in enumerate([1e6] * 6 + [4e6, 4e6]):  # two rounds where the link was busy
        ls.begin(100.0 * r)
        ls.on_payload("a", int(rate), 100.0 * r + 1.0)
    assert ls.estimate_mbit() == pytest.approx(32.0)  # 4 MB/s, not the lulls' 1 MB/s


def test_pace_is_per_peer_seconds_per_byte():
    ls = LinkStats()
    ls.begin(0.0)
    for k in range(4):
        ls.on_payload("slow", 1 << 20, 2.0 * k)
        ls.on_payload("fast", 1 << 20, 0.1 * k + 0.01)
    assert ls.pace("slow") == pytest.approx(2.0 / (1 << 20))
    assert ls.pace("fast") == pytest.approx(0.1 / (1 << 20))
    assert ls.pace("nobody") is None


def test_silence_limit_caps_floors_and_extends_for_a_measured_slow_member():
    assert silence_limit(None, 1 << 20, 5.0, 1.0, 3.0, 60.0) == 5.0  # nothing measured: part_timeout
    assert silence_limit(1e-9, 1 << 20, 5.0, 1.0, 3.0, 60.0) == 1.0  # fast link: the floor
    assert silence_limit(1e-6, 1 << 20, 5.0, 1.0, 3.0, 60.0) == pytest.approx(3 * 1e-6 * (1 << 20))
    assert silence_limit(1e-5, 1 << 20, 5.0, 1.0, 3.0, 60.0) == pytest.approx(3 * 1e-5 * (1 << 20))  # 31 s > 5
    assert silence_limit(1e-4, 1 << 20, 5.0, 1.0, 3.0, 60.0) == 60.0  # never past the round


@pytest.mark.parametrize("x,ok", [(50.0, True), (1, True), (1e7, True), (0.0, False), (-5.0, False),
                                  (1e12, False), (float("nan"), False), (float("inf"), False), ("fast", False),
                                  (True, False), (None, False)])
def test_valid_rate(x, ok):
    assert valid_rate(x) is ok


def test_plan_bandwidths_declared_measured_and_unmeasured():
    assert plan_bandwidths([1000, 100, 20, 50], [0, 1, 0, 3]) == [1000, 100, 20, 50]  # declared: as is
    # measured rates within SAME_RATE (1.25x) of their neighbour form one class at its lowest rate: equal links, equal spans
    eq = plan_bandwidths([950, 1000, 900, 1010], [MEASURED | 1] * 4)
    assert eq == [900.0] * 4 and span_fractions(eq) == [0.25] * 4
    assert plan_bandwidths([90, 100, 18, 30], [MEASURED] * 4) == [90, 90, 18, 30]
    # someone has no estimate yet: every auto member at one rate (equal spans among them)
    assert plan_bandwidths([80, 1.0, 20, 40], [MEASURED, UNMEASURED, MEASURED, MEASURED]) == [1.0] * 4
    assert plan_bandwidths([80, 1.0, 20, 40], [MEASURED, UNMEASURED, 0, 0]) == [40.0, 40.0, 20, 40]
    assert plan_bandwidths([0.0, 30.0], [0, MEASURED]) == [0.0, 30.0]  # a client stays a client


def _node(**cfg):
    return Node("me" + "0" * 14, "tcp://10.0.0.1:1", NodeConfig(**cfg), np.random.default_rng(0))


def test_gossiped_estimates_are_validated_and_bad_ones_counted():
    node = _node(bandwidth="auto")
    good, bads = 42.5, [-5.0, 1e12, "fast", True, 0]
    entries = [(f"p{i:015d}", f"tcp://10.0.0.{i + 2}:1", 1, None, {"zg.bw": v})
               for i, v in enumerate([good, *bads])]
    node.on_message(Gossip("p" + "9" * 15, "tcp://10.0.0.99:1", heartbeat=1, peers=tuple(entries)), 1.0)
    assert node.stats["bad_bandwidth"] == len(bads)
    assert node.peer_bandwidths() == {"p" + "0" * 15: good}  # bad ones dropped, peers still known
    assert len(node.membership.live_ids()) == len(bads) + 2


def test_auto_advertises_placeholder_then_estimate():
    node = _node(bandwidth="auto")
    assert node.advertised_bandwidth() == (1.0, UNMEASURED)
    node.linkstats.begin(0.0)
    node.linkstats.on_payload("a", 4 << 20, 1.0)
    bw, flags = node.advertised_bandwidth()
    assert flags == MEASURED and bw == pytest.approx(4 * 8 * 1.048576)
    assert _node(bandwidth=20.0).advertised_bandwidth() == (20.0, 0)  # declared overrides


@pytest.mark.parametrize("bad", ["fast", -1.0, math.inf])
def test_bad_bandwidth_setting_raises(bad):
    with pytest.raises(ValueError, match="bandwidth"):
        NodeConfig(bandwidth=bad)


def test_result_data_counts_for_the_rate_but_not_for_pace():
    ls = LinkStats()
    ls.begin(0.0)
    ls.on_payload("owner", 1 << 20, 0.5, pace=False)  # a result that waited on a slow sender
    ls.on_payload("owner", 1 << 20, 5.0, pace=False)
    assert ls.pace("owner") is None
    assert ls.estimate_mbit() == pytest.approx(8.0 * (1 << 20) / 0.5 / 1e6)


def test_a_peer_whose_last_round_gave_no_sample_announces_no_estimate():
    # every split reproduces itself in passive measurements (LinkStats.fresh): a stale estimate
    # next to fresh ones would lock a split in, so it is announced as unmeasured (equal spans)
    node = _node(bandwidth="auto")
    node.linkstats.begin(0.0)
    node.linkstats.on_payload("a", 4 << 20, 1.0)
    assert node.advertised_bandwidth()[1] == MEASURED
    node.linkstats.begin(10.0)  # a round too short to give a sample
    node.linkstats.on_payload("a", 1000, 10.001)
    assert node.linkstats.estimate_mbit() is not None  # still known (gossiped, a deadline prior)
    assert node.advertised_bandwidth() == (1.0, UNMEASURED)


def test_upload_estimate_from_receipts_is_not_dragged_down_by_a_slow_owner():
    # our 10 MB/s (80 Mbit/s) uplink carries 4 parts of 256 KiB to each of 3 owners, side by side;
    # owner c's downlink takes 1 MB/s, so a and b share the other 9 MB/s until their streams end.
    # Owners report each part's arrival after our first part reached them (their own clocks).
    part = 256 << 10
    ls = LinkStats()
    ls.begin(0.0)
    fast, slow = part / 4.5e6, part / 1e6
    for k in range(4):
        ls.on_receipt("a", part, k * fast)
        ls.on_receipt("b", part, k * fast)
        ls.on_receipt("c", part, k * slow)
    up = ls.upload_mbit()
    # while all three ran the link was full (72 Mbit/s delivered, the rest still in flight to c);
    # bytes over the longest stream's length would read 24 Mbit/s
    assert up is not None and 65 <= up <= 81, up
    assert ls.download_mbit() is None and ls.estimate_mbit() is None  # no download sample yet: no estimate
    ls.on_payload("a", 4 << 20, 1.0)  # 32 Mbit/s down: the lower one is what the link is announced at
    assert ls.estimate_mbit() == pytest.approx(ls.download_mbit()) and ls.download_mbit() < up
    ls.begin(2.0)  # the round's samples join the history; a receipt without its round is ignored
    assert ls.upload_mbit() == pytest.approx(up)
    ls.on_receipt("a", part, -1.0)
    ls.on_receipt("a", 0, 0.5)
    assert ls.upload_mbit() == pytest.approx(up)


def test_uploads_shorter_than_the_upload_window_are_not_measured():
    # 3 MiB of parts over ~0.12 s: longer than the download's 50 ms window, shorter than the
    # upload's 0.2 s. Receipts that close together time the owners' event loops, not the link (on
    # the testbed's 1 Gbit hosts 50 ms windows read 450-590 Mbit/s and split equal hosts into rate
    # classes), so no upload sample is taken and the download stands alone
    part = 256 << 10

    def fed(**kw):
        ls = LinkStats(**kw)
        ls.begin(0.0)
        for k in range(4):
            for owner in "abc":
                ls.on_receipt(owner, part, k * 0.03)
        ls.on_payload("a", 6 << 20, 0.15)
        return ls

    ls = fed()
    assert ls.upload_mbit() is None
    assert ls.estimate_mbit() == ls.download_mbit() == pytest.approx(8.0 * (6 << 20) / 0.15 / 1e6)
    short = fed(min_upload_s=0.05)  # with the download's window the same receipts would be a sample
    assert short.upload_mbit() is not None and short.estimate_mbit() == short.upload_mbit()


def _receipts(ls: LinkStats, owners: str, parts: int, every: float, part: int = 256 << 10) -> None:
    for k in range(parts):
        for owner in owners:
            ls.on_receipt(owner, part, k * every)


def test_an_owner_stalled_before_our_last_part_gives_no_upload_sample():
    # fast links: 3 parts each reach 3 owners within 16 ms, but owner c froze (a pause, a GC, a busy
    # core) and read our last part only at 0.25 s. Bytes over 0.25 s would read ~100 Mbit/s for a
    # 1 Gbit/s uplink: the testbed's fast4 case took that as the host's rate, planned it in a class
    # of its own and kept it owning nothing (its later rounds too short to measure the upload
    # again), 1.3x slower per step. A window that ends in such a silence is no sample.
    part = 256 << 10
    ls = LinkStats()
    ls.begin(0.0)
    for k, t in enumerate((0.0, 0.0052, 0.016)):
        for owner in "abc":
            ls.on_receipt(owner, part, t)
    ls.on_receipt("a", part, 0.0244)
    ls.on_receipt("b", part, 0.0247)
    ls.on_receipt("c", part, 0.2537)
    assert ls.upload_mbit() is None
    # the same when the owner froze between our first two parts (the stream's lead is unknown)
    ls1 = LinkStats()
    ls1.begin(0.0)
    for owner, times in (("a", (0.0, 0.0052, 0.016, 0.0244)), ("b", (0.0, 0.0061, 0.016, 0.0247)),
                         ("c", (0.0, 0.2, 0.206, 0.214))):
        for t in times:
            ls1.on_receipt(owner, part, t)
    assert ls1.upload_mbit() is None
    # the same stream with its parts spread over the window (a slow uplink) is one
    ls2 = LinkStats()
    ls2.begin(0.0)
    _receipts(ls2, "abc", 4, 0.1)
    assert ls2.upload_mbit() is not None


def test_a_slow_owner_is_no_stall_and_does_not_hide_the_fast_streams():
    # the fidelity matrix's slow1 case: a 1 Gbit/s host's streams to two fast owners end within 20 ms,
    # the third owner's 10 Mbit/s downlink takes a part every ~0.2 s from the start: a slow stream,
    # not a stalled one. The sample is the running rate at its first receipts past the window, while
    # the fast streams' bytes count (bytes over the slow stream's whole length would read ~20 Mbit/s)
    part = 256 << 10
    ls = LinkStats()
    ls.begin(0.0)
    for k in range(4):
        ls.on_receipt("a", part, k * 0.005)
        ls.on_receipt("b", part, k * 0.005)
        ls.on_receipt("c", part, k * 0.21)
    up = ls.upload_mbit()
    assert up is not None and up > 60, up


def test_an_upload_sample_ages_out_after_window_rounds_without_one():
    ls = LinkStats(window=8)
    ls.begin(0.0)
    _receipts(ls, "abc", 4, 0.1)  # a slow round: a sample
    up = ls.upload_mbit()
    assert up is not None
    for r in range(1, 9):
        ls.begin(float(r))  # rounds too short to give an upload sample
        assert ls.upload_mbit() == pytest.approx(up)  # round 0 is among the last 8 completed
    ls.begin(9.0)
    assert ls.upload_mbit() is None  # no longer: it does not speak for the link any more
