"""The self-repair vote (zgossip.repair.vote): majorities, ties, liars, peers at other versions."""
from __future__ import annotations

from zgossip.repair import read_mark, vote

A, B, C = "a" * 32, "b" * 32, "c" * 32


def test_the_odd_one_out_repairs_from_the_majority_holders():
    v = vote(3, B, [("p1", 3, A), ("p2", 3, A), ("p3", 3, A)])
    assert v.action == "repair" and v.majority == A and v.donors == ("p1", "p2", "p3") and (v.agreeing, v.voters) == (3, 4)
    assert vote(3, A, [("p1", 3, A), ("p2", 3, A), ("p3", 3, B)]).action == "agree"


def test_ties_and_pluralities_without_a_strict_majority_repair_nobody():
    assert vote(3, A, [("p1", 3, B)]).action == "split"  # 1 against 1
    assert vote(3, A, [("p1", 3, A), ("p2", 3, B), ("p3", 3, B)]).action == "split"  # 2 against 2
    assert vote(3, A, [("p1", 3, B), ("p2", 3, B), ("p3", 3, C), ("p4", 3, C)]).action == "split"  # 2 of 5 is no majority


def test_a_minority_of_liars_cannot_force_honest_peers_to_repair():
    honest = [(f"h{i}", 5, A) for i in range(3)]  # with us: 4 honest peers
    liars = [(f"x{i}", 5, B) for i in range(3)]  # 3 liars agreeing on one fake root
    assert vote(5, A, honest + liars).action == "agree"
    assert vote(5, A, honest + liars[:1] + [("x9", 5, C), ("x8", 5, C)]).action == "agree"
    # only when liars outnumber the honest peers can they win (no vote can do better)
    assert vote(5, A, honest + liars + [("x3", 5, B), ("x4", 5, B)]).action == "repair"


def test_only_peers_at_our_version_vote():
    # peers still mid-step (previous version) or ahead (next version) do not count
    v = vote(7, A, [("p1", 6, B), ("p2", 6, B), ("p3", 8, C), ("p4", 7, A)])
    assert v.action == "agree" and v.voters == 2
    assert vote(7, A, [("p1", 6, B)]).action == "alone"


def test_malformed_marks_are_ignored():
    assert read_mark({"zg.sv": 3, "zg.sh": A}) == (3, A)
    for bad in ({"zg.sv": -1, "zg.sh": A}, {"zg.sv": 3.0, "zg.sh": A}, {"zg.sv": True, "zg.sh": A},
                {"zg.sv": 3, "zg.sh": A[:31]}, {"zg.sv": 3, "zg.sh": "Z" * 32}, {"zg.sv": 3}, {}):
        assert read_mark(bad) is None
