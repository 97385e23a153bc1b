"""Helpers the training-wrapper tests share (tests/real/test_optim.py, test_diloco.py, test_checkpoint.py,
test_overlap.py): a tiny model and its local steps, peers started on loopback until they see each other,
and calls run side by side in threads. Every wait is bounded."""
from __future__ import annotations

import threading
import time
from typing import Any, Callable

import torch

#: averager settings of a fast loopback swarm (the training classes set their own matchmaking window)
FAST = dict(gossip_interval=0.05, peer_timeout=2.0, request_timeout=0.3, part_timeout=2.0)


def tiny_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))


def local_steps(model: torch.nn.Module, opt: Any, seed: int, steps: int, inner: bool = False) -> None:
    """`steps` regression batches from a generator seeded with `seed`; `inner`: step the wrapped optimizer
    (`opt.opt`) alone, as local progress the wrapper does not see."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x, y = torch.randn(16, 8, generator=g), torch.randn(16, 2, generator=g)
        ((model(x) - y) ** 2).mean().backward()
        (opt.opt if inner else opt).step()
        opt.zero_grad()


def in_threads(fns: list[Callable[[], Any]], timeout: float = 60.0) -> list:
    """Call every function in its own thread; what each returned, once all are done (any error re-raised
    as an assertion naming them all)."""
    out: list = [None] * len(fns)
    errors: list = []

    def run(i: int) -> None:
        try:
            out[i] = fns[i]()
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not errors, errors
    return out


def live_swarm(n: int, make: Callable[[int, list[str]], Any], timeout: float = 10.0) -> list:
    """`n` peers built by ``make(i, initial_peers)`` (all but the first bootstrap from the first), returned
    once each sees all `n`; if that fails, every one built is shut down."""
    peers: list = []
    try:
        for i in range(n):
            peers.append(make(i, [peers[0].endpoint] if peers else []))
        deadline = time.monotonic() + timeout
        while any(p.num_peers < n for p in peers):
            assert time.monotonic() < deadline, "peers did not see each other"
            time.sleep(0.02)
    except BaseException:
        for p in peers:
            p.shutdown()
        raise
    return peers
