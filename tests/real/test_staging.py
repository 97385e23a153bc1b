"""Device staging on a machine without a GPU: a supplement to tests/real/test_cuda.py, not a substitute.

* Real torch CPU tensors treated as device tensors go through the very staging path device
  tensors take (host mirrors, pull before a snapshot, push of the averaged ranges after), in an
  Averager pair on loopback: averaging, ``averaging_alpha``, state download and scheduled steps.
* The CUDA copy engine's ordering (side stream waits for the training stream, non-blocking copies,
  the training stream waits for the copy) is checked against a recording fake of ``torch.cuda``.
* Importing zgossip loads no torch at all, and averaging CPU tensors never initialises CUDA.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import zgossip
from harness import FAST
from zgossip import staging
from zgossip.staging import BlockingCopies, CudaCopies, DeviceStaging

ROOT = Path(__file__).resolve().parents[2]


class CountingCopies(BlockingCopies):
    """Plain copies that count what they moved (elements), to check pushes copy only averaged ranges."""

    def __init__(self) -> None:
        self.to_host_elems = 0
        self.to_device_elems = 0

    def to_host(self, pairs):
        self.to_host_elems += sum(h.numel() for h, _ in pairs)
        super().to_host(pairs)

    def to_device(self, pairs):
        self.to_device_elems += sum(d.numel() for d, _ in pairs)
        super().to_device(pairs)


def test_staging_mirrors_pull_and_push_only_the_averaged_ranges():
    ts = [torch.arange(6, dtype=torch.float32), torch.arange(4, dtype=torch.float32).reshape(2, 2) + 100]
    eng = CountingCopies()
    st = DeviceStaging(ts, copies=lambda dev: eng, staged=[0, 1])
    host = st.host_tensors(ts)
    assert all(h is not t and h.data_ptr() != t.data_ptr() for h, t in zip(host, ts))
    st.pull()
    assert torch.equal(host[0], ts[0]) and torch.equal(host[1], ts[1]) and eng.to_host_elems == 10
    host[0].fill_(-1)
    host[1].fill_(-2)
    offsets = (0, 6, 10)
    # two ranges, one across the boundary of the tensors, plus overlapping pieces that merge
    assert st.push([(4, 7), (1, 2), (5, 6)], offsets) == 4
    assert ts[0].tolist() == [0, -1, 2, 3, -1, -1]
    assert ts[1].reshape(-1).tolist() == [-2, 101, 102, 103]
    assert eng.to_device_elems == 4
    assert st.push_all(offsets) == 10 and torch.equal(ts[0], host[0])


def test_non_contiguous_device_tensors_are_refused():
    t = torch.zeros(4, 4)[:, 1]
    with pytest.raises(TypeError, match="contiguous"):
        DeviceStaging([t], staged=[0])


# ---------------------------------------------------------------------------- the CUDA engine against a fake
class _Log(list):
    pass


class _Stream:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def wait_event(self, ev):
        self.log.append(("wait", self.name, ev.name))


class _Event:
    count = 0

    def __init__(self, log):
        _Event.count += 1
        self.log, self.name, self.stream = log, f"ev{_Event.count}", None

    def record(self, stream):
        self.log.append(("record", self.name, stream.name))

    def synchronize(self):
        self.log.append(("sync", self.name))


class FakeCuda:
    """What CudaCopies uses of torch.cuda, recording every call in order."""

    def __init__(self):
        self.log = _Log()
        self.current = "train"

    def current_stream(self, device):
        return _Stream(self.log, "train")

    def Stream(self, device):  # noqa: N802 - torch's name
        return _Stream(self.log, "side")

    def Event(self):  # noqa: N802
        return _Event(self.log)

    def stream(self, s):
        fake = self

        class Ctx:
            def __enter__(self):
                fake.log.append(("enter", s.name))
                fake.current = s.name

            def __exit__(self, *exc):
                fake.log.append(("exit", s.name))
                fake.current = "train"

        return Ctx()


class FakeTensor:
    def __init__(self, cuda, name):
        self.cuda, self.name = cuda, name

    def copy_(self, src, non_blocking=False):
        self.cuda.log.append(("copy", src.name, self.name, self.cuda.current, non_blocking))


def test_cuda_engine_orders_copies_against_the_training_stream():
    cuda = FakeCuda()
    eng = CudaCopies("cuda:0", cuda=cuda)
    h, d = FakeTensor(cuda, "host"), FakeTensor(cuda, "dev")
    eng.to_host([(h, d)])
    ready, done = eng._ready.name, eng._done.name
    assert cuda.log == [
        ("record", ready, "train"),  # what the training stream queued so far...
        ("wait", "side", ready),  # ...is waited for by the side stream, not by this thread
        ("enter", "side"), ("copy", "dev", "host", "side", True), ("exit", "side"),
        ("record", done, "side"),
        ("sync", done),  # this thread waits for the copy only; the training stream is not held
    ]
    cuda.log.clear()
    eng.to_device([(d, h)])
    assert cuda.log == [
        ("record", ready, "train"), ("wait", "side", ready),
        ("enter", "side"), ("copy", "host", "dev", "side", True), ("exit", "side"),
        ("record", done, "side"),
        ("wait", "train", done),  # later training work sees the averaged values; it waits for the copy only
        ("sync", done),
    ]


# ---------------------------------------------------------------------------- an Averager pair through staging
@pytest.fixture
def staged(monkeypatch):
    """Every torch tensor is treated as a device tensor: the Averager takes the staging path."""
    monkeypatch.setattr(staging, "on_device", lambda t: isinstance(t, torch.Tensor))


def _wait_for_sharer(avg):
    """Until `avg` learned (by gossip) that its peer shares state: bounded, no fixed sleep."""
    deadline = time.monotonic() + 10
    while not avg._ask_node(lambda node: node.membership.donors()):
        assert time.monotonic() < deadline, "the donor's sharing never reached the downloader"
        time.sleep(0.02)


def _pair(ta, tb, **kw):
    a = zgossip.Averager(ta, prefix="stg", target_group_size=2, seed=1, **{**FAST, **kw})
    b = zgossip.Averager(tb, prefix="stg", target_group_size=2, initial_peers=[a.endpoint], seed=2,
                         **{**FAST, **kw})
    deadline = time.monotonic() + 10
    while not (a.peers() and b.peers()):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    return a, b


def test_averager_through_staging_averages_device_tensors_and_keeps_get_tensors(staged):
    ta = [torch.zeros(5, requires_grad=True), torch.full((2, 3), 4.0, dtype=torch.float64)]
    tb = [torch.full((5,), 2.0, requires_grad=True), torch.zeros(2, 3, dtype=torch.float64)]
    a, b = _pair(ta, tb)
    with a, b:
        assert a._staging is not None and not a._in_place  # staged: never averaged where it lies
        assert a._arrays[0].ctypes.data != ta[0].data_ptr()  # the protocol sees the mirror, not the tensor
        fa, fb = a.step(wait=False), b.step(wait=False)
        fa.result(10), fb.result(10)
        for t in (ta, tb):
            np.testing.assert_allclose(t[0].detach().numpy(), 1.0)
            np.testing.assert_allclose(t[1].numpy(), 2.0)
        with a.get_tensors() as ts:
            assert ts[0] is ta[0]  # the user's tensors, not the mirrors
        # changes made on the "device" after a step are pulled into the next snapshot
        with torch.no_grad():
            ta[0].add_(10.0)
        ca = a.step(require_trigger=True, wait=False)
        cb = b.step(require_trigger=True, wait=False)
        ca.trigger()
        cb.trigger()
        ca.result(10), cb.result(10)
        np.testing.assert_allclose(ta[0].detach().numpy(), 6.0)
        # a downloader receives the current device values (pulled), and a state load pushes them back
        with torch.no_grad():
            tb[1].fill_(7.0)
        _wait_for_sharer(a)
        meta, arrays = a.load_state_from_peers(timeout=10, apply=True)
        np.testing.assert_allclose(arrays[1], 7.0)
        np.testing.assert_allclose(ta[1].numpy(), 7.0)


def test_averaging_alpha_through_staging_starts_from_current_device_values(staged):
    ta, tb = [torch.zeros(4)], [torch.full((4,), 4.0)]
    a, b = _pair(ta, tb, averaging_alpha=0.5)
    with a, b:
        fa, fb = a.step(wait=False), b.step(wait=False)
        fa.result(10), fb.result(10)
    np.testing.assert_allclose(ta[0].numpy(), 1.0)  # 0 + 0.5 * (2 - 0)
    np.testing.assert_allclose(tb[0].numpy(), 3.0)


IMPORTS = r'''
import json, sys
import zgossip, zgossip.staging, zgossip.averager, zgossip.step_control
light = "torch" not in sys.modules
import numpy as np, torch, time
a = zgossip.Averager([torch.zeros(8)], prefix="cpu", target_group_size=2, seed=1, gossip_interval=0.05)
b = zgossip.Averager([torch.ones(8)], prefix="cpu", target_group_size=2, seed=2, gossip_interval=0.05,
                     initial_peers=[a.endpoint])
end = time.monotonic() + 10
while not (a.peers() and b.peers()) and time.monotonic() < end:
    time.sleep(0.02)
fa, fb = a.step(wait=False), b.step(wait=False)
fa.result(10), fb.result(10)
print(json.dumps({"light": light, "staging": a._staging is not None,
                  "cuda_initialized": torch.cuda.is_initialized()}))
a.shutdown(); b.shutdown()
'''


def test_cpu_tensors_load_no_torch_at_import_and_never_touch_cuda():
    out = subprocess.run([sys.executable, "-c", IMPORTS], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"light": True, "staging": False, "cuda_initialized": False}
