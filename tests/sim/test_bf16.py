"""bfloat16 tensors: averaged through float32 mirrors, carried by the bf16 wire codec.

What a bfloat16 tensor gets from a step is the owner's float32 mean rounded to bfloat16 once (to
nearest even, as torch rounds), bit-identical on every member; float32 / float16 tensors beside it
average as before; an element whose span is lost (or whose term held NaN) stays as it was; a peer
holding a float32 version of the tensor is told the dtypes differ; the tensor travels in half the
bytes of float32; its state downloads exactly.

Test data lie on a grid of values bfloat16 holds exactly (k/32, |k| < 256), so every float32 sum
of a few of them is exact in any order: the reference mean does not depend on the owner's order.
"""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

import zgossip
from harness import TRANSPORTS, make
from sim import NetworkModel, SimCluster
from zgossip.node import DownloadDone, NodeConfig, StepDone


def _grid(gen: torch.Generator, *shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return (torch.randint(-255, 256, shape, generator=gen).float() / 32).to(dtype)


def _rounded_mean(terms: list[torch.Tensor]) -> torch.Tensor:
    """torch's bfloat16 rounding of the float32 mean (exact sum, one float32 division)."""
    return (sum(t.float() for t in terms) / len(terms)).to(torch.bfloat16)


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.int16).numpy() if t.dtype == torch.bfloat16 else t.numpy().view(np.uint8)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_bf16_among_float32_and_float16_averages_to_the_rounded_float32_mean_on_every_member(transport):
    gen = torch.Generator().manual_seed(3)
    kinds = [torch.bfloat16, torch.float32, torch.float16, torch.bfloat16]
    shapes = [(1500,), (700,), (900,), (6, 50)]
    data = [[_grid(gen, *s, dtype=k) for k, s in zip(kinds, shapes)] for _ in range(3)]
    mine = [[t.clone() for t in ts] for ts in data]
    # parts of 4 KiB: some cross tensor boundaries, so bf16, raw and fp16 pieces share a part
    h = make(transport, mine, target_group_size=3, min_group_size=3, part_size_bytes=4096)
    try:
        results = h.step_all(timeout=3.0)
        assert all(isinstance(r, zgossip.StepResult) and r.complete for r in results), results
        for k, kind in enumerate(kinds):
            got = [h.tensors(i)[k] for i in range(3)]
            assert all(g is mine[i][k] and g.dtype == kind for i, g in enumerate(got))  # written in place
            for g in got[1:]:
                assert np.array_equal(_bits(g), _bits(got[0])), kind
            want = (sum(d[k].float() for d in data) / 3).to(kind)  # float32 mean, rounded once to the dtype
            assert torch.equal(got[0], want), kind
        assert torch.equal(h.tensors(0)[0], _rounded_mean([d[0] for d in data]))
        assert not torch.equal(h.tensors(0)[0], data[0][0])
    finally:
        h.close()


def test_a_blocking_step_on_one_bf16_tensor_takes_the_snapshot_path_not_in_place():
    """in_place (the default) needs a float32/float64 host tensor: a single bf16 tensor's blocking step
    averages its float32 mirror instead, and gets the same rounded mean (real peers on loopback)."""
    import concurrent.futures as cf

    gen = torch.Generator().manual_seed(8)
    data = [_grid(gen, 3000) for _ in range(2)]
    h = make("zmq", [[d.clone()] for d in data], target_group_size=2, min_group_size=2)
    try:
        assert not any(a._in_place for a in h.avgs)
        with cf.ThreadPoolExecutor(2) as pool:
            results = list(pool.map(lambda a: a.step(timeout=5.0), h.avgs))
        assert all(r.complete for r in results)
        assert all(torch.equal(h.tensors(i)[0], _rounded_mean(data)) for i in range(2))
    finally:
        h.close()


def test_a_bf16_tensor_travels_in_half_the_bytes_of_float32_and_defaults_to_the_bf16_codec():
    gen = torch.Generator().manual_seed(4)
    data = [_grid(gen, 6000) for _ in range(3)]
    h32 = make("sim", [[d.float()] for d in data], target_group_size=3, min_group_size=3)
    h16 = make("sim", [[d.clone()] for d in data], target_group_size=3, min_group_size=3)
    assert h16.peers[0].averager.layout.codecs == (zgossip.codecs.BF16,)
    r32, r16 = h32.step_all(timeout=3.0), h16.step_all(timeout=3.0)
    assert all(r.complete for r in r32 + r16)
    assert [r.bytes_sent * 2 for r in r16] == [r.bytes_sent for r in r32]
    # the same mean: float32 values averaged raw, rounded to bfloat16 by hand, equal the bf16 result
    assert torch.equal(h16.tensors(0)[0], h32.tensors(0)[0].to(torch.bfloat16))


def test_a_bf16_element_whose_span_is_lost_stays_unchanged():
    """Peer 1 pauses right after the round began (no disconnect: nobody can rescue its span in time):
    the survivors' elements outside `result.updated` keep their bits; the rest is a rounded mean over
    a set of members including the survivor."""
    n, numel = 4, 4096
    cl = SimCluster(seed=0, network=NetworkModel(latency=0.001, bandwidth=2e6))
    cfg = NodeConfig(prefix="lost", target_group_size=n, min_group_size=2, part_size_bytes=1024, part_timeout=1.0,
                     part_timeout_floor=None, allreduce_timeout=0.3, gossip_interval=0.05, peer_timeout=3.0,
                     matchmaking_time=0.3, request_timeout=0.2)
    gen = torch.Generator().manual_seed(1)
    peers = []
    for _ in range(n):
        peers.append(cl.add_peer(cfg, tensors=[_grid(gen, numel)], known=peers))
    before = [p.tensors[0].clone() for p in peers]
    evs = [p.step_tensors() for p in peers]
    while not all(p.node.step is not None and p.node.step.round is not None for p in peers):
        cl.run(until=cl.env.now + 0.0005)
    cl.run(until=cl.env.now + 0.0005)
    peers[1].pause()
    survivors = [0, 2, 3]
    cl.run(until=cl.env.all_of([evs[i] for i in survivors]))
    for me in survivors:
        act = evs[me].value
        assert isinstance(act, StepDone), act
        mask = np.zeros(numel, bool)
        for lo, hi in act.result.updated:
            mask[lo:hi] = True
        assert 0 < mask.sum() < numel, act.result.updated  # a span was lost, the others averaged
        after = peers[me].tensors[0]
        assert after.dtype == torch.bfloat16
        assert np.array_equal(_bits(after)[~mask], _bits(before[me])[~mask])  # bit for bit unchanged
        others = [i for i in range(n) if i != me]
        means = [_rounded_mean([before[i] for i in (me, *s)])
                 for k in range(1, n) for s in itertools.combinations(others, k)]
        ok = np.zeros(numel, bool)
        for m in means:
            ok |= _bits(after) == _bits(m)
        assert ok[mask].all(), f"{(~ok[mask]).sum()} averaged elements are no rounded mean over a set with me"


def test_nan_in_a_bf16_term_excludes_its_sender_from_that_span_only():
    gen = torch.Generator().manual_seed(5)
    data = [_grid(gen, 8192) for _ in range(3)]
    bad = data[2].clone()
    bad[10] = float("nan")
    h = make("sim", [[data[0].clone()], [data[1].clone()], [bad.clone()]], target_group_size=3, min_group_size=3)
    results = h.step_all(timeout=3.0)
    ids = [h.peers[i].averager.peer_id for i in range(3)]
    span0 = results[0].spans[0]  # element 10 lies in the first span, whoever owns it
    assert set(span0.contributors) == set(ids[:2])
    two = _rounded_mean([data[0][:1000], data[1][:1000]])
    for i in range(2):
        assert torch.isfinite(h.tensors(i)[0]).all() and torch.equal(h.tensors(i)[0][:1000], two)
    mine = h.tensors(2)[0]
    assert torch.isnan(mine[10]) and torch.equal(mine[:1000].nan_to_num(7.0), bad[:1000].nan_to_num(7.0))
    assert torch.equal(mine[-100:], _rounded_mean([d[-100:] for d in data]))  # the other spans: all three


def test_bf16_and_float32_versions_of_a_tensor_are_refused_naming_the_dtypes():
    gen = torch.Generator().manual_seed(6)
    x = _grid(gen, 8)
    h = make("sim", [[x.clone()], [x.float()]], target_group_size=2, min_group_size=2, matchmaking_time=0.3)
    results = h.step_all(timeout=1.0)
    for r, mine, theirs in zip(results, ("bfloat16", "float32"), ("float32", "bfloat16")):
        assert isinstance(r, zgossip.GroupNotFound), r
        assert f"tensor 0 dtype: yours {mine} (8,), theirs {theirs} (8,)" in str(r), str(r)
    assert torch.equal(h.tensors(0)[0], x)


def _download(x: torch.Tensor, state_compression) -> tuple[torch.Tensor, int, object]:
    """A donor holding `x` serves a newcomer: (what the newcomer's tensor holds after `set_tensors`,
    the bytes the donor sent meanwhile, the newcomer's averager)."""
    cl = SimCluster(seed=0, network=NetworkModel(latency=0.001))
    cfg = NodeConfig(prefix="st", gossip_interval=0.05, peer_timeout=3.0)
    donor = cl.add_peer(cfg, tensors=[x.clone()], state_compression=state_compression)
    donor.node.set_state_sharing(1.0)
    new = cl.add_peer(cfg, tensors=[torch.zeros(x.shape, dtype=torch.bfloat16)], known=[donor])
    cl.run(until=cl.env.now + 0.5)
    sent = cl.network.sent_bytes.get(donor.endpoint, 0)
    ev = new.load_state()
    cl.run(until=ev)
    assert isinstance(ev.value, DownloadDone), ev.value
    new.averager.set_tensors(ev.value.arrays)
    return new.tensors[0], cl.network.sent_bytes[donor.endpoint] - sent, new.averager


def test_bf16_state_downloads_exactly_in_half_the_bytes_and_a_float32_state_is_refused():
    x = torch.randn(20000, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)  # any bf16 values
    got, sent, avg = _download(x, None)  # the default: the state's bf16 tensors travel as bf16
    assert got.dtype == torch.bfloat16 and torch.equal(got, x)
    raw, sent_raw, _ = _download(x, "none")  # float32, as the mirror holds them
    assert torch.equal(raw, x)
    assert 0.45 < sent / sent_raw < 0.55, (sent, sent_raw)
    # float32 values a bfloat16 cannot hold (a float32 peer's state) are refused, nothing written
    with pytest.raises(zgossip.ZGossipError, match="bfloat16 cannot hold exactly"):
        avg.set_tensors([np.full(20000, 0.1, np.float32)])
    assert torch.equal(got, x)
    # so int8 (it decodes to such values) is refused when the donor is made: every download from it used
    # to fail, with "peers sharing state must hold the same dtypes" although they did
    with pytest.raises(ValueError, match=r"state_compression int8 for bfloat16 tensor\(s\) \[0\]"):
        _download(x, "int8")


def test_decentralized_adam_on_a_bf16_model_late_joiner_loads_state_and_peers_stay_identical():
    """A bf16 `nn.Linear` under DecentralizedAdam in virtual time: peer 0 trains alone to epoch 3, peer 1
    joins then and downloads parameters and Adam statistics (bf16 through the state stream), then both
    step and average (parameters and statistics) three times: bf16 throughout, bit-identical after each."""
    from harness import virtual_swarm
    from zgossip.optim import DecentralizedAdam

    models = [torch.nn.Linear(8, 4).to(torch.bfloat16) for _ in range(2)]  # different initialisations
    seen: dict = {}

    def make(i, peers, averager_opts):
        return DecentralizedAdam(models[i].parameters(), lr=0.01, prefix="bf16", average_every=None,
                                 average_period=3600.0, steps_per_epoch=2, matchmaking_time=0.3, target_group_size=2,
                                 initial_peers=peers, averager_opts=averager_opts)

    def local_step(i, opt, gen):
        x, y = torch.randn(16, 8, generator=gen).to(torch.bfloat16), torch.randn(16, 4, generator=gen)
        ((models[i](x).float() - y) ** 2).mean().backward()
        opt.step()
        opt.opt.zero_grad()

    def body(i, opt):
        gen = torch.Generator().manual_seed(10 + i)
        clock = opt.clock
        if i == 0:
            for _ in range(6):
                local_step(i, opt, gen)
            assert opt.local_epoch == 3
            deadline = clock.now() + 10
            while "joined" not in seen and clock.now() < deadline:
                clock.sleep(0.05)
        else:
            seen["joined"] = opt.local_epoch
            seen["after_load"] = [(a.dtype, torch.equal(a, b)) for a, b in
                                  zip(models[1].state_dict().values(), models[0].state_dict().values())]
            st0, st1 = (o.opt.state[p] for o, p in ((peers_ref[0], peers_ref[0].params[0]), (opt, opt.params[0])))
            seen["adam"] = st1["exp_avg"].dtype == torch.bfloat16 and torch.equal(st0["exp_avg"], st1["exp_avg"])
        results = []
        for _ in range(3):
            local_step(i, opt, gen)
            results.append(opt.average(wait=True, timeout=5.0))
        out = ([p.detach().clone() for p in models[i].parameters()], results)
        clock.sleep(0.5)  # the other may still need this peer's results
        opt.shutdown()
        return out

    peers_ref: list = []

    def make_and_track(i, peers, averager_opts):
        opt = make(i, peers, averager_opts)
        peers_ref.append(opt)
        return opt

    _, out = virtual_swarm(2, make_and_track, body, seed=4, start_at=[0.0, 1.0])
    assert seen["joined"] == 3  # it loaded the swarm's state on joining
    assert seen["after_load"] == [(torch.bfloat16, True)] * 2 and seen["adam"]
    assert peers_ref[1].averager._state_compression == {0: "bf16", 1: "bf16"}  # the parameters served as bf16
    (p0, r0), (p1, r1) = out
    assert all(r is not None and len(r.members) == 2 for r in r0 + r1), (r0, r1)
    for a, b in zip(p0, p1):
        assert a.dtype == b.dtype == torch.bfloat16 and torch.equal(a, b)
