"""CUDA tensors for real: averaged through pinned host mirrors with asynchronous copies ordered
against the training stream (zgossip.staging). Skipped without a CUDA device; the CPU-side
supplement (same staging code on CPU tensors, and the stream ordering against a fake) is
tests/real/test_staging.py."""
from __future__ import annotations

import time

import numpy as np
import pytest
import torch

import zgossip
from harness import FAST
from zgossip import StepStage

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _wait_for_sharer(avg):
    """Until `avg` learned (by gossip) that its peer shares state: bounded, no fixed sleep."""
    deadline = time.monotonic() + 10
    while not avg._ask_node(lambda node: node.membership.donors()):
        assert time.monotonic() < deadline, "the donor's sharing never reached the downloader"
        time.sleep(0.02)


def _pair(ta, tb, **kw):
    a = zgossip.Averager(ta, prefix="cuda", target_group_size=2, seed=1, **{**FAST, **kw})
    b = zgossip.Averager(tb, prefix="cuda", target_group_size=2, initial_peers=[a.endpoint], seed=2,
                         **{**FAST, **kw})
    deadline = time.monotonic() + 10
    while not (a.peers() and b.peers()):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    return a, b


def _both(a, b, **kw):
    fa, fb = a.step(wait=False, **kw), b.step(wait=False, **kw)
    return fa.result(20), fb.result(20)


def test_cuda_tensors_are_averaged_where_they_live_through_pinned_mirrors():
    ta = [torch.zeros(1000, device="cuda", requires_grad=True), torch.full((3, 4), 4.0, device="cuda",
                                                                           dtype=torch.float16),
          np.zeros(3, np.float32)]
    tb = [torch.full((1000,), 2.0, device="cuda", requires_grad=True), torch.zeros(3, 4, device="cuda",
                                                                                 dtype=torch.float16),
          np.full(3, 6.0, np.float32)]
    a, b = _pair(ta, tb)
    with a, b:
        assert a._staging is not None and all(h.is_pinned() for h in a._staging._host.values())
        ra, rb = _both(a, b)
        assert ra.complete and rb.complete
        torch.cuda.synchronize()
        for t in (ta, tb):
            assert t[0].device.type == "cuda" and t[1].device.type == "cuda"
            assert torch.all(t[0] == 1.0) and torch.all(t[1] == 2.0)
            np.testing.assert_allclose(t[2], 3.0)
        with a.get_tensors() as ts:
            assert ts[0] is ta[0] and ts[0].is_cuda


def test_bf16_cuda_tensors_get_float32_pinned_mirrors_and_the_rounded_mean():
    """Written without a GPU at hand (see README, "bfloat16"): a bfloat16 CUDA tensor is staged through a
    pinned float32 mirror; the result is the float32 mean rounded to bfloat16, on the device."""
    ga, gb = torch.Generator().manual_seed(0), torch.Generator().manual_seed(1)
    xa = (torch.randint(-255, 256, (5000,), generator=ga).float() / 32).to(torch.bfloat16)
    xb = (torch.randint(-255, 256, (5000,), generator=gb).float() / 32).to(torch.bfloat16)
    want = ((xa.float() + xb.float()) / 2).to(torch.bfloat16)
    ta, tb = [xa.cuda()], [xb.cuda()]
    a, b = _pair(ta, tb)
    with a, b:
        host = a._staging._host[0]
        assert host.dtype == torch.float32 and host.is_pinned()
        ra, rb = _both(a, b)
        assert ra.complete and rb.complete
        torch.cuda.synchronize()
        for t in (ta, tb):
            assert t[0].is_cuda and t[0].dtype == torch.bfloat16 and torch.equal(t[0].cpu(), want)


def test_snapshot_waits_for_queued_training_work_and_later_work_sees_the_average():
    n = 1 << 20
    xa, xb = torch.zeros(n, device="cuda"), torch.full((n,), 2.0, device="cuda")
    a, b = _pair([xa], [xb])
    with a, b:
        torch.cuda._sleep(100_000_000)  # ~50-100 ms of GPU time queued on the training stream...
        xa.add_(1.0)  # ...and then an update the snapshot must include (the CPU reaches step() long before)
        ra, rb = _both(a, b)
        y = xa * 2  # queued after the copy back: the training stream waited for it
        assert torch.all(y == 3.0).item()  # (1 + 2) / 2 * 2
        assert torch.all(xb == 1.5).item()


def test_the_training_stream_keeps_running_while_the_group_averages():
    """A step whose groupmate triggers 0.5 s late: meanwhile the training stream runs kernels freely
    (the averager holds it only for its copies, never for the network round)."""
    xa, xb = torch.zeros(1 << 18, device="cuda"), torch.ones(1 << 18, device="cuda")
    w = torch.randn(512, 512, device="cuda")
    torch.tanh(w @ w.T).sum().item()  # warm up (cuBLAS handles, kernels) before anything is timed
    a, b = _pair([xa], [xb])
    with a, b:
        ca, cb = a.step(require_trigger=True, wait=False), b.step(require_trigger=True, wait=False)
        while ca.stage is not StepStage.AWAITING_TRIGGER or cb.stage is not StepStage.AWAITING_TRIGGER:
            time.sleep(0.005)
        ca.trigger()  # snapshot taken, all-reduce running, waiting for b's data
        t0 = time.monotonic()
        w = torch.randn(512, 512, device="cuda")
        for _ in range(20):
            w = torch.tanh(w @ w.T / 512)
        torch.cuda.current_stream().synchronize()
        busy = time.monotonic() - t0
        assert busy < 0.4 and not ca.done()  # the training stream finished its work while the round waits
        time.sleep(0.5 - busy)
        cb.trigger()
        ca.result(20), cb.result(20)
        torch.cuda.synchronize()
        assert torch.all(xa == 0.5).item() and torch.all(xb == 0.5).item()


def test_cancel_before_the_all_reduce_leaves_cuda_tensors_untouched_and_alpha_uses_current_values():
    xa, xb = torch.zeros(64, device="cuda"), torch.full((64,), 4.0, device="cuda")
    a, b = _pair([xa], [xb], averaging_alpha=0.5)
    with a, b:
        ca, cb = a.step(require_trigger=True, wait=False), b.step(require_trigger=True, wait=False)
        while ca.stage is not StepStage.AWAITING_TRIGGER:
            time.sleep(0.005)
        assert ca.cancel() is True
        with pytest.raises(zgossip.ZGossipError):
            cb.result(10)
        torch.cuda.synchronize()
        assert torch.all(xa == 0.0).item() and torch.all(xb == 4.0).item()
        _both(a, b)
        torch.cuda.synchronize()
        assert torch.all(xa == 1.0).item() and torch.all(xb == 3.0).item()


def test_state_download_to_and_from_cuda_tensors():
    xa, xb = torch.zeros(100, device="cuda"), torch.arange(100, device="cuda", dtype=torch.float32)
    a, b = _pair([xa], [xb])
    with a, b:
        xb.mul_(2)  # the donor's current device values are what it serves
        _wait_for_sharer(a)
        a.load_state_from_peers(timeout=10)
        torch.cuda.synchronize()
        assert torch.equal(xa, xb)
