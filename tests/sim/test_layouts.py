"""Peers whose tensors differ in count, shape or dtype: matchmaking never groups them, and every
peer involved is told what differs. The layout text itself, and GroupNotFound without repeats."""
from __future__ import annotations

import numpy as np
import pytest

import zgossip
from zgossip import layouts
from zgossip.matchmaking import _summarize
from zgossip.tensors import FlatLayout

from harness import TRANSPORTS, make


def _desc(*arrays: np.ndarray) -> str:
    return FlatLayout.of(list(arrays)).description


def test_description_round_trips_and_compresses_repeats():
    arrs = [np.zeros((3, 4), np.float32)] * 3 + [np.zeros(5, np.float64), np.zeros((), np.float32)]
    d = _desc(*arrs)
    assert d == "5|f4[3,4]*3;f8[5];f4[]"
    count, items, cut = layouts.parse(d)
    assert count == 5 and not cut
    assert items == [("f4", (3, 4), "")] * 3 + [("f8", (5,), ""), ("f4", (), "")]


@pytest.mark.parametrize("mine, theirs, expect", [
    ([np.zeros(10, np.float32)], [np.zeros(12, np.float32)], ["tensor 0 shape", "(10,)", "(12,)"]),
    ([np.zeros(10, np.float32)], [np.zeros(10, np.float64)], ["tensor 0 dtype", "float32", "float64"]),
    ([np.zeros(3, np.float32), np.zeros(2, np.float32)], [np.zeros(3, np.float32)], ["yours 2 tensors, theirs 1"]),
    ([np.zeros((2, 3), np.float32)] * 3, [np.zeros((3, 2), np.float32)] * 3, ["tensor 0 shape", "2 more tensors differ"]),
])
def test_difference_names_what_differs(mine, theirs, expect):
    text = layouts.difference(_desc(*mine), _desc(*theirs))
    for part in expect:
        assert part in text, (part, text)
    assert layouts.difference(_desc(*mine), _desc(*mine)) is None


def test_long_descriptions_are_cut_and_still_compared():
    many = [np.zeros(i + 1, np.float32) for i in range(600)]
    d = _desc(*many)
    assert len(d) <= layouts.MAX_CHARS and d.endswith("...")
    other = list(many)
    other[-1] = np.zeros(5, np.float32)  # differs past the cut
    text = layouts.difference(d, _desc(*other))
    assert "after the first" in text
    other[1] = np.zeros(7, np.float32)  # differs before it
    assert "tensor 1 shape" in layouts.difference(d, _desc(*other))


@pytest.mark.parametrize("junk", ["", "x", "3|", "2|f4[1]", "1|f4[a]", "1|f4[1]*0", "-1|", "1|f4[1]*99999999999",
                                  "1|f4(1)", None, 5])
def test_malformed_descriptions_from_peers_never_raise(junk):
    assert layouts.parse(junk) is None
    assert "could not be read" in layouts.difference("1|f4[1]", junk)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_every_peer_involved_learns_what_differs(transport):
    rng = np.random.default_rng(9)
    same = [[rng.standard_normal(8).astype(np.float32), rng.standard_normal((2, 3)).astype(np.float32)] for _ in range(2)]
    odd = [rng.standard_normal(8).astype(np.float32), rng.standard_normal((3, 2)).astype(np.float32)]
    before = [a.copy() for a in odd]
    h = make(transport, same + [odd], target_group_size=3, min_group_size=2, matchmaking_time=0.3)
    try:
        results = h.step_all(timeout=1.0)
        odd_id = h.peers[2].peer_id if transport == "sim" else h.avgs[2].peer_id
        for r in results[:2]:  # the two that averaged are told who was left out, and why
            assert isinstance(r, zgossip.StepResult) and len(r.members) == 2
            assert set(r.left_out) == {odd_id}
            assert "tensor 1 shape: yours float32 (2, 3), theirs float32 (3, 2)" in r.left_out[odd_id]
        err = results[2]
        assert isinstance(err, zgossip.GroupNotFound)
        text = str(err)
        assert "different tensor layout" in text
        assert "tensor 1 shape: yours float32 (3, 2), theirs float32 (2, 3)" in text
        assert "same count, shapes and dtypes" in text  # the advice fits the cause
        assert all(np.array_equal(a, b) for a, b in zip(h.tensors(2), before))
    finally:
        h.close()


def test_a_group_without_odd_peers_reports_nobody_left_out():
    rng = np.random.default_rng(2)
    h = make("sim", [[rng.standard_normal(8).astype(np.float32)] for _ in range(3)], target_group_size=3,
             matchmaking_time=0.3)
    results = h.step_all(timeout=1.0)
    assert all(isinstance(r, zgossip.StepResult) and r.left_out == {} for r in results)


def test_group_not_found_does_not_repeat_itself():
    rng = np.random.default_rng(5)
    # alone with min_group_size=2: several windows close the same way
    h = make("sim", [[rng.standard_normal(8).astype(np.float32)] for _ in range(2)], target_group_size=4,
             min_group_size=3, matchmaking_time=0.3)
    r = h.step_all(timeout=2.0)[0]
    assert isinstance(r, zgossip.GroupNotFound)
    what = str(r).split("What happened: ", 1)[1]
    entries = [e.strip() for e in what.split(";")]
    assert "times)" in what, what  # the windows were several, and are counted...
    assert len(entries) == len(set(entries)), f"repeated entries: {what}"  # ...not repeated


def test_summarize_counts_and_keeps_the_last_distinct_entries():
    hist = ["a: x", "a: x", "b: y", "a: x"] + [f"c{i}" for i in range(8)]
    text = _summarize(hist, keep=4)
    assert text.startswith("(6 earlier entries)") and text.endswith("c7")
    assert _summarize(["a", "a", "b"]) == "a (2 times); b"


def test_a_join_without_a_layout_description_still_decodes_and_is_told_that_layouts_differ():
    from zgossip import wire
    from zgossip.matchmaking import _Entry, _layout_report
    import msgpack

    from zgossip.wire import MsgType, make_message

    body = dict(key="k", step="s", bw=1.0, layout="f" * 24, hops=0, want=2, g=1)
    header = msgpack.unpackb(wire.encode(make_message(MsgType.JOIN, "p", "tcp://1.2.3.4:5", body))[0], raw=False)
    del header[4]["ld"]  # as an older peer sends it
    msg = wire.decode([msgpack.packb(header, use_bin_type=True)])
    assert msg.layout_desc == ""
    by_layout = {"A": [_Entry("a", "tcp://a:1", "s", 1.0, "A", 2, 1, _desc(np.zeros(3, np.float32)))],
                 "B": [_Entry("b", "tcp://b:1", "s", 1.0, "B", 2, 1, "")]}
    odd, why = _layout_report("A", by_layout["A"][0].desc, by_layout)
    assert odd == [["b", "their tensors differ in count, shape or dtype (no description was sent)"]]
    assert "1 other peer(s) (b) used this key with a different tensor layout" in why


def test_peers_that_compress_a_tensor_differently_are_told_it_is_the_compression():
    a, b = [np.zeros(10, np.float32)], [np.zeros(10, np.float32)]
    mine = FlatLayout.of(a, "int8")
    theirs = FlatLayout.of(b, None)
    assert mine.fingerprint != theirs.fingerprint
    assert mine.description == "1|f4[10]@int8" and theirs.description == "1|f4[10]"
    text = layouts.difference(mine.description, theirs.description)
    assert text == "tensor 0 compression: yours float32 (10,) as int8, theirs float32 (10,) as default", text
    # an fp16 tensor travels as fp16 by default: saying so explicitly is the same layout
    h = [np.zeros(4, np.float16)]
    assert FlatLayout.of(h, "fp16").fingerprint == FlatLayout.of(h).fingerprint


def test_a_codec_mismatch_gets_the_different_tensor_layout_error():
    rng = np.random.default_rng(3)
    ts = [[rng.standard_normal(64).astype(np.float32)] for _ in range(3)]
    h = make("sim", ts, per_peer=[{}, {}, {"compression": "int8"}], target_group_size=3, min_group_size=2,
             matchmaking_time=0.3)
    results = h.step_all(timeout=1.0)
    assert all(isinstance(r, zgossip.StepResult) for r in results[:2])
    assert isinstance(results[2], zgossip.GroupNotFound)
    assert "different tensor layout" in str(results[2]) and "tensor 0 compression" in str(results[2])


@pytest.mark.parametrize("dtype, local, avg", [(np.float16, -60000.0, 20000.0), (np.float32, -3e38, 1e38),
                                               (np.float64, -1.7e308, 1.7e308)])
def test_a_partial_move_near_the_dtypes_limit_stays_finite(dtype, local, avg):
    # averaging_alpha < 1: the step alone, avg - local, was rounded to the tensor's dtype and could
    # overflow to inf (a float16 tensor at -60000 moving 90 % toward 20000 became inf)
    t = np.array([local, 1.0], dtype=dtype)
    layout = FlatLayout.of([t])
    buf = np.array([avg, 3.0], dtype=layout.dtype)
    layout.apply([t], buf, [(0, 2)], 0.9)
    want = np.float64(local) + 0.9 * (np.float64(avg) - np.float64(local)) if dtype != np.float64 else \
        0.1 * local + 0.9 * avg
    assert np.isfinite(t).all()
    np.testing.assert_allclose(t.astype(np.float64), [want, 2.8], rtol=1e-3)
