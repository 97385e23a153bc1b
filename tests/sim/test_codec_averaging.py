"""Averaging with wire codecs, on both transports: within each codec's bound of the float32 mean,
bit-identical on every member, NaN in a compressed part excluded as documented, error feedback
converging over rounds, compressed state download."""
from __future__ import annotations

import numpy as np
import pytest

import zgossip
from harness import TRANSPORTS, make
from sim import NetworkModel, SimCluster
from zgossip import codecs as C
from zgossip.node import DownloadDone, NodeConfig

# one tensor per codec; parts of 4 KiB cross the tensors' boundaries, so some parts are mixed
CODECS = ["none", "fp16", "bf16", "int8"]
SIZES = [1500, 2500, 2000, 5000]


def _tolerance(codec: str, peers_data: list[np.ndarray]) -> float:
    """The members' terms each lose at most the codec's bound at the largest magnitude, the result as
    much again; float32 rounding on top."""
    a = max(float(np.max(np.abs(x))) for x in peers_data)
    return 2 * float(C.error_bound(C.CODECS[codec], np.array([a]))[0]) + 1e-6 * a


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_each_codec_averages_within_its_bound_and_bit_identically(transport):
    rng = np.random.default_rng(11)
    data = [[(rng.standard_normal(n) * (1 + k)).astype(np.float32) for k, n in enumerate(SIZES)] for _ in range(3)]
    h = make(transport, [[t.copy() for t in ts] for ts in data], target_group_size=3, min_group_size=3,
             part_size_bytes=4096, compression=CODECS)
    try:
        results = h.step_all(timeout=3.0)
        assert all(isinstance(r, zgossip.StepResult) and r.complete for r in results), results
        for k, codec in enumerate(CODECS):
            terms = [d[k] for d in data]
            mean = np.mean(np.stack(terms).astype(np.float64), axis=0)
            got = [h.tensors(i)[k] for i in range(3)]
            for g in got[1:]:  # every member applied the same decoded bytes
                assert np.array_equal(g.view(np.uint32), got[0].view(np.uint32)), codec
            err = float(np.max(np.abs(got[0] - mean)))
            assert err <= _tolerance(codec, terms), (codec, err)
            if codec != "none":
                assert err > 0  # it was compressed
        raw = 4 * sum(SIZES) * 2 * 2 / 3  # float32 bytes a member sends: its parts for 2 owners and its results
        assert max(r.bytes_sent for r in results) < 0.75 * raw
    finally:
        h.close()


def test_an_fp16_tensor_travels_as_fp16():
    rng = np.random.default_rng(2)
    data = [rng.standard_normal(6000).astype(np.float16) for _ in range(3)]
    h32 = make("sim", [[d.astype(np.float32)] for d in data], target_group_size=3, min_group_size=3)
    h16 = make("sim", [[d.copy()] for d in data], target_group_size=3, min_group_size=3)
    r32, r16 = h32.step_all(timeout=3.0), h16.step_all(timeout=3.0)
    assert r16[0].bytes_sent * 2 == r32[0].bytes_sent  # half the bytes, as the tensor's own dtype
    # exact: fp16 values travel losslessly, the float32 mean is rounded to fp16 once, as before
    assert np.array_equal(h16.tensors(0)[0], h32.tensors(0)[0].astype(np.float16))


@pytest.mark.parametrize("state", [False, True])
def test_an_fp16_tensor_named_bf16_keeps_its_largest_values_finite(state):
    """compression="bf16" (or state_compression) over a model with fp16 tensors: bf16 rounded fp16
    values above 65408 to 65536, which the fp16 tensor then held as inf -- on every member, in a step
    reported complete (and in a downloaded state). Such a tensor travels as fp16 (exact, 2 bytes too)."""
    x = np.array([65504, 65440, 1.0, -65504] * 300, np.float16)
    if state:
        cl = SimCluster(seed=0, network=NetworkModel(latency=0.001))
        cfg = dict(prefix="st", gossip_interval=0.05, peer_timeout=3.0, part_size_bytes=4096)
        donor = cl.add_peer(NodeConfig(**cfg), tensors=[x.copy()], state_compression="bf16")
        donor.node.set_state_sharing(1.0)
        new = cl.add_peer(NodeConfig(**cfg), tensors=None, known=[donor])
        cl.run(until=cl.env.now + 0.5)
        ev = new.load_state()
        cl.run(until=ev)
        assert isinstance(ev.value, DownloadDone) and np.array_equal(ev.value.arrays[0], x)
        return
    h = make("sim", [[x.copy()] for _ in range(3)], target_group_size=3, min_group_size=3, compression="bf16")
    res = h.step_all(timeout=3.0)
    assert all(isinstance(r, zgossip.StepResult) and r.complete for r in res)
    assert all(np.array_equal(h.tensors(i)[0], x) for i in range(3))


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_nan_in_a_compressed_part_excludes_its_sender_from_that_span(transport):
    rng = np.random.default_rng(5)
    data = [rng.standard_normal(8192).astype(np.float32) for _ in range(3)]
    bad = data[2].copy()
    bad[10] = np.nan  # span 0; int8 makes its whole 1,024-block NaN, which the owner refuses
    h = make(transport, [[data[0].copy()], [data[1].copy()], [bad.copy()]], target_group_size=3, min_group_size=3,
             compression="int8")
    try:
        _check_nan_exclusion(h, data, bad)
    finally:
        h.close()


def _check_nan_exclusion(h, data, bad):
    results = h.step_all(timeout=3.0)
    ids = [(h.avgs[i] if hasattr(h, "avgs") else h.peers[i].averager).peer_id for i in range(3)]
    owner0 = results[0].spans[0]  # the first span (element 10 is in it), whoever owns it
    assert ids[2] not in owner0.contributors and set(owner0.contributors) == set(ids[:2])
    lo, hi = 0, 8192 // 3  # about span 0 (bandwidths are equal)
    for i in range(2):
        t = h.tensors(i)[0]
        assert np.isfinite(t).all()
        two = (data[0][:1000].astype(np.float64) + data[1][:1000]) / 2
        assert np.max(np.abs(t[:1000] - two)) <= _tolerance("int8", [data[0], data[1]])
    mine = h.tensors(2)[0]
    assert np.isnan(mine[10]) and np.array_equal(mine[lo:hi], bad[lo:hi], equal_nan=True)  # unchanged there
    assert not np.array_equal(mine[-100:], bad[-100:])  # the other spans were averaged over all three


def test_error_feedback_time_average_converges_to_the_float32_mean():
    rng = np.random.default_rng(7)
    x = [rng.standard_normal(4096).astype(np.float32) * s for s in (1.0, 3.0, 0.1)]
    mean = np.mean(np.stack(x).astype(np.float64), axis=0)

    def time_average(ef: bool, rounds: int) -> dict[int, float]:
        """Max distance of the average over rounds 1..T of peer 0's result to the mean, for T = 12, 24."""
        h = make("sim", [[v.copy()] for v in x], target_group_size=3, min_group_size=3, compression="int8",
                 error_feedback=ef)
        acc, out = np.zeros(4096), {}
        for t in range(1, rounds + 1):
            for i, v in enumerate(x):  # a fresh gradient each step: the same values every round
                h.tensors(i)[0][...] = v
            res = h.step_all(timeout=3.0)
            assert all(isinstance(r, zgossip.StepResult) and r.complete for r in res)
            acc += h.tensors(0)[0]
            if t in (12, 24):
                out[t] = float(np.max(np.abs(acc / t - mean)))
        return out

    plain, fed = time_average(False, 24), time_average(True, 24)
    # without feedback the quantization error repeats every round: the time average keeps it
    assert plain[24] == plain[12] > 0
    # with it, what a round lost (members' parts, and the owner's result) is sent in the next round,
    # so the error of the time average falls like 1/T
    assert fed[24] <= 0.6 * fed[12], fed
    assert fed[24] < 0.1 * plain[24], (fed, plain)


@pytest.mark.parametrize("codec,bad", [("int8", float("nan")), ("fp16", 1e5)])
def test_error_feedback_carries_nothing_the_codec_could_not_carry(codec, bad):
    """One step with a value the codec cannot carry (NaN; fp16's out-of-range 1e5, sent as inf): the
    owner excludes that sender from the span for that step only. The residual of the block was
    NaN/inf (x - decode(encode(x))), and added to every later snapshot it kept the peer excluded there
    for good, with finite data."""
    rng = np.random.default_rng(5)
    data = [rng.standard_normal(8192).astype(np.float32) for _ in range(3)]
    h = make("sim", [[d.copy()] for d in data], target_group_size=3, min_group_size=3, compression=codec,
             error_feedback=True)
    for step in range(3):
        for i in range(3):
            h.tensors(i)[0][...] = data[i]
        if step == 0:
            h.tensors(2)[0][10] = bad
        res = h.step_all(timeout=3.0)
        assert all(isinstance(r, zgossip.StepResult) for r in res)
        assert [r.complete for r in res] == [step > 0] * 3, (step, res)
        assert np.isfinite(h.peers[2].averager._residual).all()
    assert all(np.isfinite(h.tensors(i)[0]).all() for i in range(3))


@pytest.mark.parametrize("codec", ["fp16", "int8"])
def test_state_download_with_state_compression(codec):
    cl = SimCluster(seed=0, network=NetworkModel(latency=0.001))
    rng = np.random.default_rng(0)
    cfg = dict(prefix="st", gossip_interval=0.05, peer_timeout=3.0, part_size_bytes=4096)
    state = [rng.standard_normal((64, 33)), rng.standard_normal(3000).astype(np.float32)]
    donor = cl.add_peer(NodeConfig(**cfg), tensors=[a.copy() for a in state], state_compression=codec)
    donor.node.set_state_sharing(1.0)
    new = cl.add_peer(NodeConfig(**cfg), tensors=None, known=[donor])
    cl.run(until=cl.env.now + 0.5)
    ev = new.load_state()
    cl.run(until=ev)
    act = ev.value
    assert isinstance(act, DownloadDone)
    for got, want in zip(act.arrays, state):
        assert got.dtype == want.dtype and got.shape == want.shape
        err = np.abs(got.astype(np.float64) - want)
        assert (err <= C.error_bound(C.CODECS[codec], want.reshape(-1)).reshape(want.shape) + 1e-300).all() \
            if codec == "fp16" else float(err.max()) <= float(np.abs(want).max()) / 250
        assert err.max() > 0  # it did travel compressed


def test_a_scheduled_step_travels_compressed_and_carries_the_residual():
    """Held steps (step(scheduled_time=...)) snapshot at their trigger: the codec and error feedback apply too."""
    cl = SimCluster(seed=3, network=NetworkModel(latency=0.002, bandwidth=1e8))
    rng = np.random.default_rng(3)
    data = [rng.standard_normal(3000).astype(np.float32) for _ in range(3)]
    cfg = NodeConfig(prefix="held", target_group_size=3, min_group_size=3, matchmaking_time=0.3,
                     part_size_bytes=4096, gossip_interval=0.1, peer_timeout=3.0)
    peers: list = []
    for d in data:
        peers.append(cl.add_peer(cfg, tensors=[d.copy()], known=list(peers), compression="int8",
                                 error_feedback=True))
    cl.run(until=0.5)
    at = cl.env.now + 1.0
    ctls = [p.averager.step(scheduled_time=at, wait=False) for p in peers]
    while not all(c.done() for c in ctls) and cl.env.now < 10:
        cl.run(until=cl.env.now + 0.05)
    assert all(c.result().complete for c in ctls)
    mean = np.mean(np.stack(data).astype(np.float64), axis=0)
    got = [p.tensors[0] for p in peers]
    assert all(np.array_equal(g, got[0]) for g in got[1:])
    assert 0 < float(np.max(np.abs(got[0] - mean))) <= _tolerance("int8", data)
    assert all(np.any(p.averager._residual != 0) for p in peers)  # what int8 lost waits for the next step


def test_float16_tensors_at_the_edge_of_their_range_stay_finite_under_int8_with_error_feedback():
    """float16 tensors near +-65504 averaged with int8 and error feedback: each member sends value +
    residual, which can lie up to half an int8 step (~260) beyond 65504, and the mean came back above
    float16's range -- hundreds of elements turned inf from the third round on. A mean of float16
    values is within the range; a result beyond it is now set to +-65504 when written back."""
    rng = np.random.default_rng(1)
    x = [(65504 - np.abs(rng.standard_normal(4096)) * 3000).astype(np.float16) for _ in range(3)]
    for v in x:
        v[::7] = 65504
        v[3::11] = -65504
    mean = np.mean(np.stack(x).astype(np.float64), axis=0)
    h = make("sim", [[v.copy()] for v in x], target_group_size=3, min_group_size=3, compression="int8",
             error_feedback=True)
    for _ in range(5):
        for i, v in enumerate(x):
            h.tensors(i)[0][...] = v
        res = h.step_all(timeout=3.0)
        assert all(isinstance(r, zgossip.StepResult) and r.complete for r in res)
        for i in range(3):
            t = h.tensors(i)[0]
            assert np.isfinite(t).all(), f"peer {i}: {int(np.isinf(t).sum())} elements inf"
            # and near the mean: a few int8 half-steps (each at most 65504 / 254), those of this round
            # and the residuals carried into it (an owner's scaled by the group's weight over its own)
            assert np.max(np.abs(t.astype(np.float64) - mean)) <= 6 * 65504 / 254
