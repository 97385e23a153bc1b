"""The round-level model (`sim.roundlevel`): cross-checked against the real protocol, plus its own properties.

Cross-check design. New Moshpit coordinates depend on the group id the real
rendezvous peer draws, and ranks on the order JOINs arrive, so an independent
round-level run cannot reproduce them. Instead both run side by side from the same
start, and every round:

1. the round-level model draws the availability; unavailable peers do not step in
   the real cluster (they skip the round but keep the swarm's round counter);
2. the partition the model forms on its own (from *its* coordinates) must equal the
   real one — on lines that hold more peers than one group, where the real choice
   depends on arrival order, the group sizes must agree;
3. the model then takes the real groups (members in rank order) and derives the
   permutations from the real group ids exactly as `MoshpitGrid.next_coords` does,
   steps, and must match every peer's values (float tolerance) and coordinates
   (exactly). The model's state is never copied from the real run, so a
   divergence in any round breaks every later comparison.
"""
from __future__ import annotations

import re

import numpy as np
import pytest

from sim import NetworkModel, SimCluster
from sim.moshpit import MethodSpec, main as moshpit_main, moshpit_table, rounds_to
from sim.roundlevel import (
    Groups, Method, RoundLevelSwarm, allreduce_all_or_nothing, distance_to_truth, draw_available, line_keys,
    moshpit_groups, perms_from_group_ids, place_on_grid, random_groups, ring_gossip,
)
from zgossip.grid import MoshpitGrid
from zgossip.node import NodeConfig, StepDone, StepFailed
from zgossip.errors import GroupNotFound

pytestmark = pytest.mark.timeout(300)

FAST = dict(gossip_interval=0.05, peer_timeout=5.0, matchmaking_time=0.3, request_timeout=0.2, part_timeout=1.0)


# ============================================================================ cross-check helpers
class RealGrid:
    """A SimPy cluster of real zgossip nodes on a Moshpit grid, stepped round by round."""

    def __init__(self, values: np.ndarray, coords: np.ndarray, grid: tuple[int, ...], target: int, min_size: int,
                 seed: int = 0) -> None:
        self.cluster = SimCluster(seed=seed, network=NetworkModel(latency=0.001))
        self.peers = []
        for i, (v, c) in enumerate(zip(values, coords)):
            cfg = NodeConfig(prefix="rl", grid=grid, grid_coords=tuple(int(x) for x in c), target_group_size=target,
                             min_group_size=min_size, part_size_bytes=64, **FAST)
            self.peers.append(self.cluster.add_peer(cfg, tensors=[np.array(v, dtype=np.float64).copy()], known=self.peers))
        self.index = {p.peer_id: i for i, p in enumerate(self.peers)}

    def step(self, available: np.ndarray) -> dict[int, StepDone | StepFailed]:
        evs = {}
        for i, p in enumerate(self.peers):
            if available[i]:
                evs[i] = p.step_tensors(timeout=2.0)
            else:
                # The node keeps its own round counter and only advances it when it steps; a peer that skips a
                # round must still average along the swarm's axis next time (see the report on node.round_index).
                p.node.round_index += 1
        self.cluster.run(until=self.cluster.env.all_of(list(evs.values())))
        return {i: e.value for i, e in evs.items()}

    def groups(self, outcome: dict) -> tuple[Groups, list[str]]:
        """The real round's groups, members in rank order, and their ids (in order of first member index)."""
        seen: dict[str, list[int]] = {}
        for i in sorted(outcome):
            act = outcome[i]
            if isinstance(act, StepDone):
                seen.setdefault(act.result.group_id, [self.index[m] for m in act.result.members])
        return Groups.from_lists(list(seen.values())), list(seen)

    def values(self) -> np.ndarray:
        return np.stack([p.tensors[0] for p in self.peers])

    def coords(self) -> np.ndarray:
        return np.array([p.node.coords for p in self.peers])


def assert_same_partition(model: Groups, real: Groups, coords: np.ndarray, available: np.ndarray, grid, axis: int,
                          full: int) -> None:
    """Equal partitions on every line the protocol cuts without choice; equal group sizes on overfull lines."""
    keys = line_keys(coords, grid, axis)
    on_line = np.bincount(keys[available], minlength=int(np.prod(grid)))

    def by_line(g: Groups) -> dict[int, list[frozenset]]:
        out: dict[int, list[frozenset]] = {}
        for s in g.as_sets():
            ks = {int(keys[i]) for i in s}
            assert len(ks) == 1, f"group {sorted(s)} spans several lines"
            out.setdefault(ks.pop(), []).append(s)
        return out

    m, r = by_line(model), by_line(real)
    assert set(m) == set(r), "different lines met"
    for k in m:
        if on_line[k] <= full:
            assert set(m[k]) == set(r[k]), f"line {k}: model {m[k]} != real {r[k]}"
        else:
            assert sorted(map(len, m[k])) == sorted(map(len, r[k])), f"overfull line {k}: group sizes differ"


def run_side_by_side(grid, coords, p, rounds, seed, target, min_size=2, dim=3, lone_first=False):
    """Run both side by side; ``lone_first``: in round 0, peer 0 is the only available peer of its line."""
    n = len(coords)
    rng = np.random.default_rng(seed)
    values = rng.standard_normal((n, dim))
    real = RealGrid(values, coords, grid, target, min_size, seed=seed)
    model = RoundLevelSwarm(values, Method.MOSHPIT, np.random.default_rng(seed + 1), p_unavailable=p,
                            group_size=target, min_group_size=min_size, grid=grid, coords=coords, cut="even")
    full = max(min_size, min(target, max(grid)))
    history = []
    for r in range(rounds):
        axis = r % len(grid)
        available = draw_available(model.rng, n, p)
        if lone_first and r == 0:
            keys = line_keys(model.coords, grid, 0)
            available[keys == keys[0]] = False
            available[0] = True
        coords_before = model.coords.copy()
        outcome = real.step(available)
        real_groups, gids = real.groups(outcome)
        # (2) the model's own partition, from its own state, with the same availability
        own = moshpit_groups(model.coords, grid, r, available, np.random.default_rng([seed, r]),
                             target_group_size=target, min_group_size=min_size, cut="even")
        assert_same_partition(own, real_groups, coords_before, available, grid, axis, full)
        # peers the model leaves alone failed to find a group in the real run, and nobody else did
        met = set(real_groups.members.tolist())
        for i, act in outcome.items():
            if i in met:
                assert isinstance(act, StepDone) and act.result.complete
                assert tuple(act.result.coords) == tuple(coords_before[i])
            else:
                assert isinstance(act, StepFailed) and isinstance(act.error, GroupNotFound), act
        # (3) the model steps with the real groups and the real group ids' permutations
        model.step(available=available, groups=real_groups, perms=perms_from_group_ids(gids, grid[axis]))
        np.testing.assert_allclose(model.values, real.values(), rtol=1e-12, atol=1e-14)
        assert np.array_equal(model.coords, real.coords())
        history.append((int(available.sum()), real_groups.n_groups, len(met)))
    return model, real, history


# ============================================================================ cross-checks
def test_full_4x4_grid_no_faults_matches_real_protocol_and_is_exact_in_two_rounds():
    grid = (4, 4)
    coords = np.array([(i % 4, i // 4) for i in range(16)])
    model, real, history = run_side_by_side(grid, coords, p=0.0, rounds=4, seed=3, target=4)
    assert all(h == (16, 4, 16) for h in history)  # 4 full lines of 4, every round
    truth = model.truth
    for vals in (model.values, real.values()):
        np.testing.assert_allclose(vals, np.broadcast_to(truth, vals.shape), rtol=0, atol=1e-12)
    # the model on its own (own group formation, own permutations) is exact after d = 2 rounds too
    rng = np.random.default_rng(3)
    alone = RoundLevelSwarm(rng.standard_normal((16, 3)), Method.MOSHPIT, rng, grid=grid, coords=coords, group_size=4)
    alone.step()
    assert alone.metric()[1] > 1e-3
    alone.step()
    assert alone.metric()[1] < 1e-24


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_unavailability_matches_real_protocol(seed):
    grid = (6, 6)
    coords = place_on_grid(36, grid, np.random.default_rng(seed))
    model, real, history = run_side_by_side(grid, coords, p=0.3, rounds=6, seed=seed, target=6, lone_first=True)
    # the scenario exercised faults: skipped peers every round, and (at least) peer 0 alone on its line in round 0
    assert all(h[0] < 36 for h in history) and history[0][2] < history[0][0]
    assert np.isclose(model.values.mean(axis=0), model.truth).all()  # group averaging keeps the sum


def test_iid_coordinates_with_overfull_lines_match_real_protocol():
    """Collided cells make lines hold more peers than a group: the matchmaker cuts them evenly after its
    straggler grace, mirrored by cut='even'."""
    grid = (3, 3)
    coords = place_on_grid(18, grid, np.random.default_rng(5), placement="iid")
    assert np.bincount(line_keys(coords, grid, 0)).max() > 3  # at least one overfull line at the start
    run_side_by_side(grid, coords, p=0.1, rounds=4, seed=5, target=3)


def test_perms_from_group_ids_is_what_the_grid_draws():
    g = MoshpitGrid((5, 7))
    ids = ["a1b2c3d4e5f60718", "00ff00ff00ff00ff", "x"]
    perms = perms_from_group_ids(ids, 7)
    for gid, perm in zip(ids, perms):
        for rank in range(9):
            assert g.next_coords((2, 3), 1, gid, rank) == (2, int(perm[rank % 7]))


# ============================================================================ model properties
def test_moshpit_full_grid_without_faults_is_exact_in_d_rounds():
    for grid in [(4, 5, 6), (32, 32), (2, 2, 2, 2, 2)]:
        n = int(np.prod(grid))
        rng = np.random.default_rng(n)
        s = RoundLevelSwarm(rng.standard_normal(n), "moshpit", rng, grid=grid, group_size=max(grid))
        for _ in range(len(grid) - 1):
            s.step()
        assert s.metric()[1] > 1e-8, grid
        rec = s.step()
        assert rec.max_sq < 1e-24 and rec.participants == n, grid


def test_random_groups_reduce_mse_by_one_over_group_size():
    n, g = 100_000, 8
    rng = np.random.default_rng(11)
    s = RoundLevelSwarm(rng.standard_normal(n), "random", rng, group_size=g)
    before = s.metric()[0]
    expected = (n - g) / (g * (n - 1))  # E[MSE after / MSE before] for a uniformly random partition
    for _ in range(4):
        after = s.step().mse
        assert abs(after / before / expected - 1) < 0.05
        before = after


def test_unavailable_peers_keep_value_and_coordinates_and_members_take_distinct_indices():
    grid = (8, 8, 8)
    rng = np.random.default_rng(2)
    s = RoundLevelSwarm(rng.standard_normal((400, 2)), "moshpit", rng, p_unavailable=0.2, grid=grid, group_size=8)
    for r in range(6):
        v0, c0 = s.values.copy(), s.coords.copy()
        available = draw_available(s.rng, s.n_peers, 0.2)
        rec = s.step(available=available)
        axis = r % 3
        moved = np.ones(s.n_peers, bool)
        moved[rec.groups.members] = False
        assert np.array_equal(s.values[moved], v0[moved]) and np.array_equal(s.coords[moved], c0[moved])
        assert available[rec.groups.members].all()
        other = [a for a in range(3) if a != axis]
        assert np.array_equal(s.coords[:, other], c0[:, other])
        for members in np.split(rec.groups.members, np.cumsum(rec.groups.sizes)[:-1]):
            new = s.coords[members, axis]
            assert len(set(new.tolist())) == len(members)  # groups here are <= 8 = M_axis
            assert np.allclose(s.values[members], v0[members].mean(axis=0))
        np.testing.assert_allclose(s.values.mean(axis=0), s.truth, atol=1e-12)


@pytest.mark.parametrize("cut,expected", [("even", [17, 16, 5]), ("fill", [8, 8, 8, 8, 5])])
def test_overfull_line_cut(cut, expected):
    """33 peers on one line of a (8, 4) grid (cells collide) plus a short line of 5; groups up to 8."""
    coords = np.array([(i % 8, 0) for i in range(33)] + [(i, 1) for i in range(5)])
    g = moshpit_groups(coords, (8, 4), 0, np.ones(38, bool), np.random.default_rng(0),
                       target_group_size=8 if cut == "fill" else 17, min_group_size=2, cut=cut)
    assert sorted(g.sizes.tolist(), reverse=True) == sorted(expected, reverse=True)


def test_min_group_size_and_lone_peers():
    coords = np.array([(0, 0), (1, 0), (2, 0), (0, 1), (0, 2), (1, 2)])
    g = moshpit_groups(coords, (3, 3), 0, np.ones(6, bool), np.random.default_rng(0), target_group_size=3, min_group_size=2)
    assert g.as_sets() == {frozenset({0, 1, 2}), frozenset({4, 5})}  # peer 3 is alone on its line
    g1 = moshpit_groups(coords, (3, 3), 0, np.ones(6, bool), np.random.default_rng(0), target_group_size=3, min_group_size=1)
    assert frozenset({3}) in g1.as_sets()


def test_random_groups_are_near_equal_and_cover_the_available():
    avail = np.ones(1000, bool)
    avail[::7] = False
    g = random_groups(avail, 32, np.random.default_rng(0))
    assert sorted(g.members.tolist()) == np.flatnonzero(avail).tolist()
    assert g.sizes.max() - g.sizes.min() <= 1 and g.sizes.max() <= 32


def test_ring_gossip_is_metropolis_and_keeps_the_mean():
    x = np.array([0.0, 3.0, 6.0, 3.0])
    np.testing.assert_allclose(ring_gossip(x, np.ones(4, bool)), [2.0, 3.0, 4.0, 3.0])
    avail = np.array([True, True, False, True])
    y = ring_gossip(x, avail)
    assert y[2] == 6.0  # unavailable: unchanged; its edges carry nothing
    np.testing.assert_allclose(y, [2.0, 2.0, 6.0, 2.0])  # edges (3,0) and (0,1) are up
    assert np.isclose(y.sum(), x.sum())


def test_allreduce_all_or_nothing():
    x = np.arange(5.0)
    y, ok = allreduce_all_or_nothing(x, np.ones(5, bool))
    assert ok and np.allclose(y, 2.0)
    avail = np.ones(5, bool)
    avail[3] = False
    y, ok = allreduce_all_or_nothing(x, avail)
    assert not ok and np.array_equal(y, x)


def test_explicit_groups_are_validated():
    rng = np.random.default_rng(0)
    coords = np.array([(i % 4, i // 4) for i in range(16)])
    s = RoundLevelSwarm(rng.standard_normal(16), "moshpit", rng, grid=(4, 4), coords=coords, group_size=4)
    with pytest.raises(ValueError, match="different lines"):
        s.step(groups=Groups.from_lists([[0, 4]]))
    with pytest.raises(ValueError, match="two groups"):
        s.step(groups=Groups.from_lists([[0, 1], [1, 2]]))
    avail = np.ones(16, bool)
    avail[1] = False
    with pytest.raises(ValueError, match="unavailable"):
        s.step(available=avail, groups=Groups.from_lists([[0, 1]]))


def test_a_million_peers_run_every_method():
    n = 1_000_000
    for method in Method:
        rng = np.random.default_rng(0)
        s = RoundLevelSwarm(rng.standard_normal(n), method, rng, p_unavailable=0.01, group_size=32,
                            grid=(32, 32, 32, 32) if method is Method.MOSHPIT else ())
        before = s.metric()[0]
        rec = s.step()
        assert rec.mse <= before
        assert abs(float(s.values.mean()) - float(s.truth)) < 1e-12
        if method in (Method.MOSHPIT, Method.RANDOM_GROUPS, Method.RING):
            assert rec.participants > 0.9 * n


def test_distance_to_truth_on_vectors():
    v = np.array([[1.0, 0.0], [0.0, 2.0], [0.0, 0.0]])
    mse, mx = distance_to_truth(v, np.zeros(2))
    assert mse == pytest.approx(5 / 3) and mx == 4.0


# ============================================================================ the experiment
def test_rounds_to_threshold_counts_the_cap():
    curves = np.array([[1.0, 1e-3, 1e-10, 0.0], [1.0, 0.5, 0.4, 0.3]])
    first, reached = rounds_to(curves, 1e-9)
    assert first.tolist() == [2, 3] and reached.tolist() == [True, False]


def test_experiment_table_is_a_function_of_the_seed_and_has_the_expected_shape():
    specs = (MethodSpec("moshpit", Method.MOSHPIT, grid=(32, 32)), MethodSpec("allreduce", Method.ALL_REDUCE))
    a = moshpit_table((1024,), (0.0, 0.01), specs, restarts=2, cap=20, seed=4)
    b = moshpit_table((1024,), (0.0, 0.01), specs, restarts=2, cap=20, seed=4)
    assert a == b
    cell = {(r["p"], r["method"]): r for r in a}
    assert cell[(0.0, "moshpit")]["rounds_1e-9"] == 2.0  # the full 32x32 grid: exact in d = 2 rounds
    assert cell[(0.0, "allreduce")]["rounds_1e-9"] == 1.0
    assert cell[(0.01, "allreduce")]["reached_1e-4"] < 1.0  # 1024 peers at p=0.01: almost never all there


def test_cli_prints_json_and_table(capsys):
    import json
    assert moshpit_main(["--restarts", "1", "--cap", "10", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert len(data["rows"]) == 4 * 3 * 4
    assert moshpit_main(["--restarts", "1", "--cap", "10"]) == 0
    out = capsys.readouterr().out
    assert "moshpit" in out and "ring" in out and "1024" in out


@pytest.mark.parametrize("m", [4, 40, 1000])
def test_distinct_indices_are_distinct_and_uniform(m):
    """Both paths (whole permutations when lines are short, redraw-on-collision when long) give uniform injections."""
    from sim.roundlevel import distinct_indices
    sizes = np.array([min(4, m)] * 5000 + [1] * 100)
    groups = Groups(np.arange(sizes.sum()), sizes)
    vals = distinct_indices(np.random.default_rng(m), groups, m)
    assert vals.min() >= 0 and vals.max() < m
    for members in np.split(vals, np.cumsum(sizes)[:-1]):
        assert len(set(members.tolist())) == len(members)
    counts = np.bincount(vals[: 5000 * min(4, m)], minlength=m)
    expected = 5000 * min(4, m) / m
    assert np.abs(counts - expected).max() < 6 * np.sqrt(expected)  # ~6 sigma: uniform over indices
    first = np.bincount(vals[: 5000 * min(4, m)].reshape(5000, -1)[:, 0], minlength=m)  # rank 0 alone is uniform too
    assert np.abs(first - 5000 / m).max() < 6 * np.sqrt(5000 / m)


@pytest.mark.parametrize("placement", ["full", "distinct", "random"])
def test_cli_round_level_takes_every_placement_it_offers(capsys, placement):
    # `python -m sim moshpit --level round --placement random|full` failed: the round-level model
    # names them "iid" and (grid order) coordinates, and refused the CLI's names
    import json

    from sim.__main__ import main as sim_main

    argv = ["moshpit", "--level", "round", "--peers", "16", "--grid", "4x4", "--group-size", "4", "--rounds", "2",
            "--placement", placement, "--json"]
    assert sim_main(argv) == 0
    rounds = json.loads(capsys.readouterr().out)["rounds"]
    assert len(rounds) == 2
    if placement != "random":  # a full 4x4 grid in lines of 4: exact after d = 2 rounds
        assert rounds[-1]["mse"] < 1e-25
    assert sim_main(argv[:4] + ["20"] + argv[5:]) == (2 if placement == "full" else 0)  # 20 peers, 16 cells
    capsys.readouterr()


def test_cli_message_level_keeps_random_placement_on_a_grid_the_peers_fill(capsys):
    # with peers == cells (the default 1,024 on 32x32) `--placement random` was replaced by full,
    # so i.i.d. coordinates (overfull lines) could not be run at message level from the CLI
    import json

    from sim.__main__ import main as sim_main

    argv = ["moshpit", "--peers", "16", "--grid", "4x4", "--group-size", "4", "--rounds", "2", "--json"]
    out = {}
    for placement in ("full", "distinct", "random"):
        assert sim_main(argv + ["--placement", placement]) == 0
        out[placement] = json.loads(capsys.readouterr().out)
    assert out["random"]["scenario"]["placement"] == "random"
    assert out["random"]["rounds"] != out["full"]["rounds"]
    assert out["distinct"]["rounds"] == out["full"]["rounds"]  # every cell taken: the same swarm


@pytest.mark.parametrize("over, expect", [
    ({"group_size": "x"}, "group_size must be a whole number, not 'x'"),
    ({"group_size": 2.5}, "group_size must be a whole number, not 2.5"),
    ({"grid": [0]}, "grid must be a list of whole numbers >= 1, e.g. [32, 32], not (0,)"),
    ({"grid": "8x8"}, "grid must be a list of whole numbers >= 1, e.g. [32, 32], not '8x8'"),
])
def test_a_moshpit_sweep_run_names_a_bad_method_setting(over, expect):
    """A `kind = "moshpit"` sweep passes group_size and grid to the round-level swarm unchecked: "x" said
    "'<=' not supported between instances of 'int' and 'str'", 2.5 "Cannot cast array data", grid = [0]
    raised a ZeroDivisionError (which `python -m sim` does not turn into one line) and "8x8" "invalid literal
    for int()"."""
    from sim.sweep import _moshpit_run

    with pytest.raises(ValueError, match=re.escape(expect)):
        _moshpit_run({"n": 16, "p": 0.0, "method": "moshpit", "seed": 0, "restart": 0, "cap": 1, **over})
