"""A moolib-style gradient `Accumulator`, decentralized: no broker, gradients weighted by samples.

moolib users write this loop (its documentation's, unchanged apart from construction)::

    group = zgossip.accumulator.Group("foo_group", initial_peers=[...])
    accumulator = zgossip.accumulator.Accumulator("bar", model.parameters(), model.buffers(), group=group)
    opt = torch.optim.Adam(model.parameters(), lr=0.001)
    while True:
        group.update()
        accumulator.update()
        if not accumulator.connected():
            time.sleep(0.25)
            continue
        if accumulator.wants_state():
            accumulator.set_state({"optimizer": opt.state_dict()})
        if accumulator.has_new_state():
            opt.load_state_dict(accumulator.state()["optimizer"])
        if accumulator.wants_gradients():
            loss = ...; loss.backward()
            accumulator.reduce_gradients(batch_size)
        if accumulator.has_gradients():
            opt.step()
            accumulator.zero_gradients()

How the pieces map without a broker:

* **Membership and the leader.** Peers find each other by the averager's gossip and
  publish a progress record (model version, samples held, flags). The leader is the
  ready peer with the highest model version, ties to the lowest peer id -- every peer
  computes the same answer from the same records. `connected` is true once this peer
  has its initial state: it is the first (nobody else ready after `discovery_time`), or
  it downloaded the state of the swarm.
* **The model version names the parameters.** Peers at the same model version hold
  identical parameters (given the same `opt.step` on the same reduced gradients): a
  version advances only through a complete round in which no member was ahead, or on a
  peer that is alone; a newcomer takes the version together with the state it downloads.
* **State.** A peer that needs state (new, or behind the swarm) raises a flag in its
  record; the leader's `wants_state` turns true, the user's `set_state` snapshots the
  user state plus parameters and buffers at this model version, and the newcomer
  downloads it (best version first, checksummed, falling back to other donors) in the
  background. When it is applied, `has_new_state` is true and `state()`
  returns the user state once. If the swarm moved on during the download, the peer asks again.
* **Gradients.** `reduce_gradients(batch_size)` adds ``p.grad * batch_size`` to a local
  accumulator and zeroes ``p.grad`` (so the next backward starts clean). When the peers
  at this model version together hold `set_virtual_batch_size` samples (any samples, if
  it is 0), every ready peer joins one averaging round contributing its mean gradient
  with weight = its samples: the result is the mean gradient over every sample, written
  into ``p.grad``; `has_gradients` turns true. `zero_gradients` clears them and
  increments the model version. A peer that skipped (or had NaN/inf gradients, which
  are dropped and logged) joins with weight ~0 and still receives the mean. A round that
  fails changes nothing: the peer logs it, keeps its gradients (`wants_gradients` stays true)
  and joins the next round -- or resynchronises if the others finished without it. It never
  steps on its local gradients while other peers are ready: that step would give it a model
  version the others reach with other parameters (and, being the highest version, make it
  the leader whose state newcomers copy). A partial round (a member was lost midway, so
  some elements hold local values that differ from peer to peer) is dropped the same way,
  with its gradients; a round in which a member was at a higher version means this peer is
  behind: it resynchronises instead of stepping.

`set_parallel_gradients` is accepted for compatibility; one round runs at a time.
"""
from __future__ import annotations

import concurrent.futures as cf
import contextlib
import logging
import operator
from enum import Enum
from typing import Any, Iterable, Sequence

import numpy as np
import torch

from .collaborative import _count
from .errors import ZGossipError
from .progress import PeerProgress, SwarmView, progress_record, run_digest
from .trainer import TRAINING_DEFAULTS, ServingAverager, clock_of, first_nonfinite, refuse_auxiliary
from .training_state import (LayoutMismatch, ModelLayout, bf16_state_compression, copy_arrays, named_tensors,
                             pack_state, unpack_state)

__all__ = ["Accumulator", "Group"]

log = logging.getLogger(__name__)

_NOTHING = 1e-9  # the weight of a member that contributes no samples


def _endpoint(address: str) -> str:
    return address if "://" in address else f"tcp://{address}"


class Group:
    """Where accumulators meet: moolib's ``Group`` without a broker. ``initial_peers`` are the
    endpoints of any running peers (``host:port`` or ``tcp://host:port``); the remaining
    keyword arguments go to each accumulator's `Averager`."""

    def __init__(self, name: str = "zgossip", *, initial_peers: Sequence[str] = (),
                 listen: str = "tcp://127.0.0.1:0", **averager_opts: Any) -> None:
        self.name = name
        self.initial_peers = [_endpoint(a) for a in initial_peers]
        self.listen = listen
        self.averager_opts = averager_opts

    def connect(self, address: str) -> None:
        """Add a peer to bootstrap from (before the accumulators' first `update`)."""
        self.initial_peers.append(_endpoint(address))

    def update(self) -> None:
        """Kept so moolib loops run unchanged: gossip runs on each averager's own I/O thread."""


class _Phase(Enum):
    NEW = "new"  # not started: connect() may still add peers
    DISCOVERING = "discovering"  # listening for peers before deciding whether to download state
    SYNCING = "syncing"  # waiting for, or downloading, the swarm's state
    READY = "ready"


class Accumulator:
    """See the module docstring. ``virtual_batch_size`` (also `set_virtual_batch_size`) is the number
    of samples the swarm accumulates per update; ``model`` (optional) names tensors in messages;
    ``discovery_time`` is how long a starting peer listens for a running swarm (default
    ``max(1 s, 5 gossip intervals)``); while a peer downloads the swarm's state, the others start no
    new round for up to ``catchup_pause`` seconds, so that it can catch up; other keyword arguments
    go to the `Averager`."""

    def __init__(
        self,
        name: str,
        parameters: Iterable[torch.Tensor],
        buffers: Iterable[torch.Tensor] = (),
        group: Group | None = None,
        *,
        virtual_batch_size: int = 0,
        model: torch.nn.Module | None = None,
        discovery_time: float | None = None,
        matchmaking_time: float = 0.5,
        target_group_size: int = 64,
        state_timeout: float = 60.0,
        catchup_pause: float = 5.0,
        **averager_opts: Any,
    ) -> None:
        self.name = name
        self.group = group if group is not None else Group(name)
        self.params = [p for p in parameters]
        self.buffers = [b for b in buffers]
        if not self.params:
            raise ValueError("the accumulator needs at least one parameter")
        self.param_names = named_tensors(self.params, model)
        self.buffer_names = named_tensors(self.buffers, model) if self.buffers else []
        self.layout = ModelLayout.of(self.params, self.param_names)
        self.prefix = f"moolib/{self.group.name}/{name}"
        self._run = run_digest(self.prefix)
        opts = {**TRAINING_DEFAULTS, "matchmaking_time": matchmaking_time, "target_group_size": target_group_size,
                **self.group.averager_opts, **averager_opts}
        refuse_auxiliary(opts, "Accumulator")
        if opts.get("client_mode") or self.group.listen is None:
            # the leader is whoever holds the highest model version (lowest id on ties), a client too, and
            # newcomers wait for the leader's state: nobody can connect to a client to download it
            raise ValueError("an Accumulator cannot run in client mode: it could become the leader, whose state "
                             "newcomers download, and nobody can connect to a client-mode peer to download from it. "
                             "Give it a listen address the other peers can reach")
        bf16_state_compression(opts, self.params + self.buffers)  # the state served begins with these
        self._opts = opts
        self.clock = clock_of(opts)  # every reading of the time and every wait (virtual in the simulator)
        self._gossip = float(opts.get("gossip_interval", 0.5))
        self._mm_timeout = float(opts["matchmaking_time"]) + 2 * float(opts.get("request_timeout", 0.5)) + 0.5
        self.discovery_time = discovery_time if discovery_time is not None else max(1.0, 5 * self._gossip)
        self.state_timeout = float(state_timeout)
        self.catchup_pause = float(catchup_pause)
        self._want_seen: dict[str, float] = {}
        self._vbs = _count("virtual_batch_size", virtual_batch_size, 0)
        self._parallel = 1
        self._version = 0
        self._phase = _Phase.NEW
        self._closed = False
        self._averager: ServingAverager | None = None
        self._grads: list[torch.Tensor] = [torch.zeros(p.shape, dtype=p.dtype) for p in self.params]
        # the batches' sums: in the averaged tensors themselves, but in float32 for float16/bfloat16 parameters
        # (a bfloat16 sum stops growing at 256 times a batch's gradient, 2**8; a float16 one overflows past
        # 65504): a round starts from their mean, rounded to the parameters' dtype once
        self._sums: list[torch.Tensor] = [torch.zeros(g.shape, dtype=torch.float32)
                                          if g.dtype in (torch.float16, torch.bfloat16) else g for g in self._grads]
        self._samples = 0
        self._rate = 0.0
        self._last_reduce: float | None = None
        self._skipped = False
        self._has_grads = False
        self._holding = False  # a peer is catching up: no new round for now
        self._next_round = 0.0  # after a failed round: retry once fresh records arrived
        self._round: cf.Future | None = None
        self._round_meta: dict = {}
        self._view: SwarmView | None = None
        self._next_view = 0.0
        self._deadline = 0.0
        self._stash: tuple[int, Any, list[np.ndarray]] | None = None
        self._stash_lock = self.clock.lock()
        self._user_state: Any = None
        self._new_state = False
        self._download: cf.Future | None = None
        self._downloader = self.clock.executor("zgossip-acc-state")
        self._next_download = 0.0
        self._warned: set[str] = set()
        self._published: dict | None = None
        self._stats = {"batch_size": 0, "num_updates": 0, "num_skipped": 0, "num_local_fallbacks": 0,
                       "num_failed_rounds": 0, "num_nonfinite_batches": 0, "num_state_downloads": 0}

    # ------------------------------------------------------------------ moolib API
    def connect(self, address: str) -> None:
        """Bootstrap from the peer at `address` (moolib connects to a broker; here any peer will do)."""
        if self._phase is not _Phase.NEW:
            raise ZGossipError("connect() must come before the first update(); or give the Group initial_peers")
        self.group.connect(address)

    def connected(self) -> bool:
        """True once this peer holds the swarm's state (or is the first) and may train."""
        return self._phase is _Phase.READY

    def update(self) -> None:
        """Advance: start up, read the swarm's records, run state sync and gradient rounds. Call it often."""
        self._require_open()
        if self._phase is _Phase.NEW:
            self._start()
        now = self.clock.now()
        if self._round is not None and not self._round.done():
            self.clock.wait(self._round, 0.002)  # spare the CPU while a round runs
        if self._round is not None and self._round.done():
            self._finish_round()
        if now >= self._next_view or self._view is None:
            self._next_view = now + min(0.02, self._gossip / 4)  # reading records is a round trip to the I/O thread
            self._view = SwarmView.of(self._me(), self._averager.peer_infos(), self._run)
            self._check_layouts(self._view)
        else:
            self._view = self._refresh_me()
        view = self._view
        if self._phase is _Phase.DISCOVERING:
            self._discover(view, now)
        elif self._phase is _Phase.SYNCING:
            self._sync(view, now)
        elif self._phase is _Phase.READY:
            if self._round is None and not self._has_grads and self._behind(view):
                log.info("%s: model version %d is behind the swarm's %d: synchronising", self.peer_id[:8],
                         self._version, view.max_epoch)
                self._enter_sync()
            else:
                self._maybe_start_round(view)
        self._publish()
        if self._phase is _Phase.READY and self._holding and not self.wants_gradients() and not self._has_grads:
            self.clock.sleep(0.002)  # nothing to do until the newcomer caught up: do not spin

    def wants_state(self) -> bool:
        """True on the leader when some peer waits for state newer than the last `set_state`."""
        if self._phase is not _Phase.READY or self._view is None or not self.is_leader():
            return False
        if not any(p.wants_state for p in self._view.others()):
            return False
        return self._stash is None or self._stash[0] != self._version

    def set_state(self, state: Any) -> None:
        """Snapshot the user `state` (tensors, numbers, strings, lists, tuples, dicts -- never pickled),
        with the parameters and buffers, for peers that need it."""
        self._require_started()
        meta, arrays = pack_state(state)
        params = copy_arrays(self.params)
        bufs = copy_arrays(self.buffers)
        full = {"kind": "accumulator", "version": self._version, "layout": self.layout.as_meta(),
                "buffers": len(bufs), "user": meta}
        with self._stash_lock:
            self._stash = (self._version, full, params + bufs + arrays)
        self._averager.state_sharing_priority = float(self._version)
        self._averager.allow_state_sharing = True
        self._publish()

    def has_new_state(self) -> bool:
        """True after this peer adopted a downloaded state, until `state()` is read."""
        return self._new_state

    def state(self) -> Any:
        """The user state (as given to `set_state` on the donor); reading it clears `has_new_state`."""
        self._new_state = False
        return self._user_state

    def wants_gradients(self) -> bool:
        """True when `reduce_gradients` or `skip_gradients` may be called (not while a round runs, while
        reduced gradients wait for `zero_gradients`, or while holding a full batch during a catch-up pause)."""
        return self._can_reduce() and not (self._holding and self._samples >= max(1, self._vbs))

    def _why_no_gradients(self) -> str:
        """Why `wants_gradients` is False, in words for an error message."""
        if self._phase is _Phase.NEW:
            return "the accumulator is not running yet: call update() first, and train once connected() is True"
        if self._phase is not _Phase.READY:
            return ("it is not connected: it is looking for the swarm or downloading its state "
                    "(call update() until connected() is True)")
        if self._round is not None:
            return "a gradient round is running (call update() until has_gradients() or wants_gradients())"
        if self._has_grads:
            return "reduced gradients await zero_gradients() (after opt.step())"
        return "a peer is catching up and this one already holds a full batch (call update() meanwhile)"

    def _can_reduce(self) -> bool:
        return self._phase is _Phase.READY and self._round is None and not self._has_grads

    def reduce_gradients(self, batch_size: int) -> None:
        """Contribute ``p.grad`` (from a loss averaged over `batch_size` samples); zeroes ``p.grad``."""
        # checked before anything is touched: a negative or fractional size used to be accumulated as a
        # weight (negating the gradients, or weighting 2.5 while counting 2 samples), a NaN or a string
        # was accumulated before failing -- gradients corrupted either way
        batch_size = _count("batch_size", batch_size, 0)
        self._require_open()
        if not self.wants_gradients():
            raise ZGossipError(f"reduce_gradients() called while wants_gradients() is False (check it first): "
                               f"{self._why_no_gradients()}")
        grads = [p.grad for p in self.params]
        bad = first_nonfinite(grads)
        if bad is not None:
            self._stats["num_nonfinite_batches"] += 1
            log.warning("%s: NaN/inf in the gradient of %s: this batch of %d samples is dropped, not reduced",
                        self.peer_id[:8], self.layout.describe(bad), batch_size)
        else:
            with torch.no_grad(), self._averager.get_tensors():
                for acc, g in zip(self._sums, grads):
                    if g is not None:
                        acc.add_(g, alpha=float(batch_size))
            self._samples += int(batch_size)
        now = self.clock.now()
        if self._last_reduce is not None and now > self._last_reduce:
            inst = batch_size / (now - self._last_reduce)
            self._rate = inst if self._rate == 0 else 0.8 * self._rate + 0.2 * inst
        self._last_reduce = now
        with torch.no_grad():
            for g in grads:
                if g is not None:
                    g.zero_()
        if self._view is not None:
            self._maybe_start_round(self._refresh_me())

    def skip_gradients(self) -> None:
        """Contribute nothing to this round (still receive the others' gradients)."""
        self._require_open()
        if not self.wants_gradients():
            raise ZGossipError(f"skip_gradients() called while wants_gradients() is False (check it first): "
                               f"{self._why_no_gradients()}")
        self._stats["num_skipped"] += 1
        self._skipped = True
        if self._view is not None:
            self._maybe_start_round(self._refresh_me())

    def has_gradients(self) -> bool:
        """True when ``p.grad`` holds reduced gradients, until `zero_gradients`."""
        return self._has_grads

    def zero_gradients(self) -> None:
        """Zero the gradients and the accumulator; after an update (`has_gradients` was true), increment
        the model version (moolib increments on every call; here a stray call does not make this peer
        look ahead of the swarm)."""
        with torch.no_grad():
            for p in self.params:
                if p.grad is not None:
                    p.grad.zero_()
        self._reset_accumulation()
        was = self._has_grads
        self._has_grads = False
        if was:
            self._version += 1
        self._publish()

    def model_version(self) -> int:
        return self._version

    def set_model_version(self, n: int) -> None:
        try:
            v = None if isinstance(n, bool) else operator.index(n)  # int, numpy and 0-d torch integers
        except TypeError:
            v = None
        if v is None or v < 0:
            raise ValueError(f"the model version must be an int >= 0, not {n!r}")
        self._version = v
        self._publish()

    def set_virtual_batch_size(self, n: int) -> None:
        """Samples the swarm accumulates per update (0: each round takes whatever peers hold)."""
        self._vbs = _count("virtual batch size", n, 0)

    def set_parallel_gradients(self, n: int) -> None:
        """Accepted for moolib compatibility; zgossip runs one round at a time."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"set_parallel_gradients() takes a whole number of rounds >= 1, not {n!r}")
        self._parallel = n

    def get_gradient_stats(self) -> dict:
        """``batch_size`` (samples in the last reduction), ``num_updates``, ``num_skipped``, plus
        ``num_local_fallbacks`` (updates on local gradients alone: no other peer was ready),
        ``num_failed_rounds`` (failed or partial rounds: no update, see the module docstring),
        ``num_nonfinite_batches``, ``num_state_downloads``, ``num_peers``."""
        return {**self._stats, "num_peers": self._view.num_peers if self._view is not None else 1,
                "virtual_batch_size": self._vbs}

    def is_leader(self) -> bool:
        return self.get_leader() == self.peer_id

    def get_leader(self) -> str:
        """Peer id of the leader: the ready peer with the highest model version (lowest id on ties), from
        the records as this peer last read them (they spread by gossip, so views agree within moments)."""
        if self._averager is None:
            return self.peer_id
        if self._view is None or self.clock.now() >= self._next_view:
            self._next_view = self.clock.now() + min(0.02, self._gossip / 4)
            self._view = SwarmView.of(self._me(), self._averager.peer_infos(), self._run)
        return self._refresh_me().leader().peer_id

    @property
    def peer_id(self) -> str:
        return self._averager.peer_id if self._averager is not None else "(not started)"

    @property
    def endpoint(self) -> str:
        self._require_started()
        return self._averager.endpoint

    def shutdown(self) -> None:
        self._closed = True
        if self._averager is not None:
            self._averager.shutdown()
        self._downloader.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> "Accumulator":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ start-up and state
    def start(self) -> None:
        """Start the averager now (the first `update` does it otherwise): `endpoint` becomes known."""
        self._require_open()
        if self._phase is _Phase.NEW:
            self._start()

    def _start(self) -> None:
        g = self.group
        self._averager = ServingAverager(self._grads, state_fn=self._serve, prefix=self.prefix, listen=g.listen,
                                         initial_peers=list(g.initial_peers), allow_state_sharing=False,
                                         **self._opts)
        self._deadline = self.clock.now() + self.discovery_time
        self._phase = _Phase.DISCOVERING if g.initial_peers else _Phase.READY
        self._publish()

    def _require_open(self) -> None:
        if self._closed:
            raise ZGossipError("this accumulator was shut down: build a new one to train again")

    def _require_started(self) -> None:
        self._require_open()
        if self._averager is None:
            raise ZGossipError("call update() (or start()) first: the accumulator is not running yet")

    def _serve(self) -> tuple[Any, list[np.ndarray]]:
        with self._stash_lock:
            if self._stash is None:
                raise ZGossipError("no state set yet")
            _, meta, arrays = self._stash
            return meta, arrays

    def _discover(self, view: SwarmView, now: float) -> None:
        ready = [p for p in view.others() if p.ready]
        if ready:
            self._enter_sync()
            return
        everyone = [p.peer_id for p in view.peers]
        if now >= self._deadline and (min(everyone) == self.peer_id or now >= self._deadline + 3 * self.discovery_time):
            log.info("%s: no ready peer found: starting the run here", self.peer_id[:8])
            self._phase = _Phase.READY

    def _enter_sync(self) -> None:
        log.debug("%s: synchronising", self.peer_id[:8])
        self._phase = _Phase.SYNCING
        self._reset_accumulation()
        self._publish()

    def _behind(self, view: SwarmView) -> bool:
        return any(p.ready and p.epoch > self._version for p in view.others())

    def _sync(self, view: SwarmView, now: float) -> None:
        if self._download is None:
            ready = [p for p in view.others() if p.ready]
            if not ready:
                if now >= self._deadline + 3 * self.discovery_time:
                    log.warning("%s: no ready peer to synchronise with: carrying on alone", self.peer_id[:8])
                    self._phase = _Phase.READY
                return
            top = max(p.epoch for p in ready)
            fresh = any(p.state_version >= top for p in ready)
            # the peers pause for us while a fresh state is on offer (see _paused); if nobody offers
            # one for a while, take the newest there is and ask again if it turns out stale
            stale_ok = now >= self._deadline + self.discovery_time and any(p.state_version >= 0 for p in ready)
            if (fresh or stale_ok) and now >= self._next_download:
                log.debug("%s: downloading state (swarm at %d, fresh=%s)", self.peer_id[:8], top, fresh)
                self._deadline = now
                self._download = self._downloader.submit(
                    self._averager.load_state_from_peers, timeout=self.state_timeout, apply=False)
            return
        if not self._download.done():
            return
        fut, self._download = self._download, None
        try:
            meta, arrays = fut.result()
            self._adopt(meta, arrays)
        except (ZGossipError, ValueError) as e:
            if isinstance(e, LayoutMismatch):
                raise
            self._next_download = self.clock.now() + max(0.5, 2 * self._gossip)
            log.warning("%s: state download failed, retrying: %s", self.peer_id[:8], e)

    def _adopt(self, meta: Any, arrays: Sequence[np.ndarray]) -> None:
        # everything the donor sent is checked before anything is written: a malformed state (a missing key,
        # a version that is no int, too few tensors, a tensor of another shape) used to be half written, or
        # broadcast into the parameters, or to escape update() as a KeyError; it is a failed download now
        if not isinstance(meta, dict) or meta.get("kind") != "accumulator":
            raise ZGossipError("the donor sent a state that is not an accumulator's")
        missing = {"version", "layout", "buffers", "user"} - set(meta)
        if missing:
            raise ZGossipError(f"the donor's state lacks {sorted(missing)}")
        version, nb = meta["version"], meta["buffers"]
        if type(version) is not int or version < 0 or type(nb) is not int or nb < 0:
            raise ZGossipError(f"the donor's state has model version {version!r} and {nb!r} buffers: "
                               "expected whole numbers >= 0")
        diff = self.layout.difference(ModelLayout.from_meta(meta["layout"]))  # ValueError if malformed
        if diff is not None:
            raise LayoutMismatch(f"cannot adopt the swarm's state: {diff}. Every peer must build the same model.")
        n = len(self.params)
        if nb != len(self.buffers):
            raise LayoutMismatch(f"the donor has {nb} buffers, this peer {len(self.buffers)}")
        if len(arrays) < n + nb:
            raise ZGossipError(f"the donor's state holds {len(arrays)} tensors, fewer than the {n} parameters "
                               f"and {nb} buffers it describes")
        for i, (p, a) in enumerate(zip(self.params, arrays[:n])):
            if tuple(p.shape) != tuple(np.shape(a)):
                raise ZGossipError(f"the donor sent {self.layout.describe(i)} with shape {tuple(np.shape(a))}, "
                                   f"not {tuple(p.shape)}")
        for i, (b, a) in enumerate(zip(self.buffers, arrays[n:n + nb])):
            if tuple(b.shape) != tuple(a.shape):
                raise LayoutMismatch(f"buffer {i} {self.buffer_names[i]!r}: shape {tuple(b.shape)} here, "
                                     f"{tuple(a.shape)} at the donor")
        try:
            user = unpack_state(meta["user"], arrays[n + nb:])
        except (KeyError, IndexError, TypeError) as e:
            raise ZGossipError(f"the donor's user state is malformed: {e}") from None
        with torch.no_grad():
            for p, a in zip(self.params, arrays[:n]):
                p.copy_(torch.from_numpy(np.asarray(a)))
            for b, a in zip(self.buffers, arrays[n:n + nb]):
                b.copy_(torch.from_numpy(np.asarray(a)))
        self._user_state = user
        self._new_state = True
        self._version = int(meta["version"])
        self._stats["num_state_downloads"] += 1
        self._phase = _Phase.READY
        log.info("%s: adopted the swarm's state at model version %d", self.peer_id[:8], self._version)

    # ------------------------------------------------------------------ gradient rounds
    def _reset_accumulation(self) -> None:
        # before start (or after shutdown) no round can read the tensors: there is no averager to lock
        idle = self._averager is None or self._closed
        with torch.no_grad(), (contextlib.nullcontext() if idle else self._averager.get_tensors()):
            for g, acc in zip(self._grads, self._sums):
                g.zero_()
                if acc is not g:
                    acc.zero_()
        self._samples = 0
        self._skipped = False

    def _paused(self, view: SwarmView, now: float) -> bool:
        """Hold off new rounds while a peer is catching up (at most `catchup_pause` s per request):
        otherwise a swarm that updates faster than a state download never lets a newcomer in."""
        wanting = {p.peer_id for p in view.others() if p.wants_state}
        for pid in list(self._want_seen):
            if pid not in wanting:
                del self._want_seen[pid]
        for pid in wanting:
            self._want_seen.setdefault(pid, now)
        return any(now - t < self.catchup_pause for t in self._want_seen.values())

    def _maybe_start_round(self, view: SwarmView) -> None:
        if not self._can_reduce():
            return
        now = self.clock.now()
        self._holding = self._paused(view, now) and not view.averaging_at(self._version)
        if self._holding:
            return
        have = view.estimate_at(self._version, self.clock.wall_time(), 4 * self._gossip)
        joining = view.averaging_at(self._version)
        if not joining and not (have > 0 and have >= self._vbs):
            return
        if not joining and now < self._next_round:
            return  # our last round failed: start the next one on records at least a gossip interval newer
        if not joining and self._samples == 0 and not self._skipped:
            return  # wait until we contributed (or skipped) once: the loop calls us again
        ready = [p for p in view.peers if p.ready]
        n = self._samples
        with torch.no_grad(), self._averager.get_tensors():
            for g, acc in zip(self._grads, self._sums):
                if acc is not g:  # a float32 sum: its mean, rounded once (the sum stays for a round that fails)
                    torch.div(acc, max(n, 1), out=g)
                elif n > 0:
                    g.div_(n)
        self._round_meta = {"version": self._version, "samples": n, "t0": self.clock.now(),
                            "expected": len(ready)}
        if len(ready) <= 1:
            self._round = cf.Future()
            self._round.set_exception(ZGossipError("alone"))
            self._round_meta["alone"] = True
            return
        self._publish(averaging=True)
        self._round = self._averager.step(weight=n if n > 0 else _NOTHING, gather={"ep": self._version, "n": n},
                                          timeout=self._mm_timeout, wait=False)

    def _finish_round(self) -> None:
        fut, self._round = self._round, None
        meta = self._round_meta
        n = meta["samples"]
        if meta.get("alone"):
            # nobody else is ready: this peer alone is the swarm, and whoever joins later downloads its state
            if n > 0:
                self._stats["num_local_fallbacks"] += 1
                self._step_on_grads(float(n))
            else:
                self._reset_accumulation()
            return
        try:
            result = fut.result()
        except ZGossipError as e:
            self._round_failed(f"failed ({e})", keep=n)
            return
        if not result.complete:
            # the elements whose owner was lost kept each member's local values: stepping on them
            # would give every member a different model at the same version
            self._round_failed(f"was partial (lost {', '.join(p[:8] for p in result.lost) or 'none'})", keep=0)
            return
        eps = [g.get("ep") for c, g in result.gathered.items() if c in result.contributors and isinstance(g, dict)]
        ahead = [e for e in eps if type(e) is int and e > self._version]
        if ahead:
            # rounds are keyed by the prefix alone: peers that already reached a later version met this
            # one; they step from their parameters, which are not ours -- catch up with them instead
            log.warning("%s: the round for version %d met peers at version %d: synchronising",
                        self.peer_id[:8], meta["version"], max(ahead))
            self._stats["num_failed_rounds"] += 1
            self._enter_sync()
            return
        total = sum(float(g.get("n", 0)) for c, g in result.gathered.items()
                    if c in result.contributors and isinstance(g, dict) and type(g.get("n", 0)) in (int, float))
        bad = first_nonfinite(self._grads)
        if bad is not None:
            log.error("%s: the reduced gradient of %s is NaN/inf (a peer sent non-finite values unflagged): "
                      "this update is skipped", self.peer_id[:8], self.layout.describe(bad))
            self._reset_accumulation()
            return
        self._step_on_grads(total)

    def _round_failed(self, what: str, keep: int) -> None:
        """A round that did not reduce every element over every member: no update. With `keep` > 0
        samples (a failed round leaves the tensors untouched) the gradients are kept for the next
        round; otherwise they are dropped. If the swarm moved on meanwhile, synchronise."""
        self._stats["num_failed_rounds"] += 1
        version = self._round_meta["version"]
        view = SwarmView.of(self._me(), self._averager.peer_infos(), self._run)
        if self._behind(view):
            log.warning("%s: the round for version %d %s and the swarm moved on: synchronising",
                        self.peer_id[:8], version, what)
            self._enter_sync()
            return
        self._next_round = self.clock.now() + self._gossip
        if keep > 0:
            with torch.no_grad(), self._averager.get_tensors():
                for g, acc in zip(self._grads, self._sums):
                    if acc is g:
                        g.mul_(keep)  # back to the sum of batch gradients (the round started from their mean)
            log.warning("%s: the round for version %d %s; no update: the %d samples wait for the next round",
                        self.peer_id[:8], version, what, keep)
        else:
            log.warning("%s: the round for version %d %s; no update: its gradients are dropped",
                        self.peer_id[:8], version, what)
            self._reset_accumulation()

    def _step_on_grads(self, total: float) -> None:
        with torch.no_grad():
            for p, g in zip(self.params, self._grads):
                if p.grad is None:
                    p.grad = g.clone()
                elif p.grad.layout != torch.strided:  # sparse (Embedding(sparse=True)): handed back sparse, as
                    p.grad = g.to_sparse(p.grad.sparse_dim())  # the user's optimizer (SparseAdam) expects
                else:
                    p.grad.copy_(g)
        self._stats["batch_size"] = total
        self._stats["num_updates"] += 1
        self._has_grads = True
        log.debug("%s: version %d reduced over %s samples", self.peer_id[:8], self._version, total)

    # ------------------------------------------------------------------ records
    def _me(self, averaging: bool = False) -> PeerProgress:
        return PeerProgress(
            self.peer_id, self._version, float(self._samples), self._rate, self.layout.fingerprint, self.layout.signature,
            len(self.layout.shapes), in_sync=True, ready=self._phase is _Phase.READY,
            wants_state=self._phase in (_Phase.DISCOVERING, _Phase.SYNCING),
            state_version=self._stash[0] if self._stash is not None else -1,
            nonfinite=self._stats["num_nonfinite_batches"], time=self.clock.wall_time(),
            averaging=averaging or (self._round is not None and not self._round.done()),
        )

    def _refresh_me(self) -> SwarmView:
        assert self._view is not None
        me = self._me()
        return SwarmView(me, tuple(me if p.peer_id == me.peer_id else p for p in self._view.peers),
                         self._view.mismatched)

    def _publish(self, averaging: bool = False) -> None:
        if self._averager is None or self._closed:
            return
        rec = progress_record(self._run, self._me(averaging))
        key = {k: v for k, v in rec.items() if k not in ("t", "sps")}
        if key != self._published:
            self._published = key
            self._averager.publish(**rec)

    def _check_layouts(self, view: SwarmView) -> None:
        for p in view.mismatched:
            if p.peer_id not in self._warned:
                self._warned.add(p.peer_id)
                log.error("%s: peer %s trains a different model: %s; never averaging with it", self.peer_id[:8],
                          p.peer_id[:8], self.layout.difference_from_digest(p.tensors, p.signature))
        if view.mismatched and len(view.peers) == 1 and any(p.epoch >= self._version for p in view.mismatched):
            p = view.mismatched[0]
            raise LayoutMismatch(f"this peer's model differs from every other peer's in {self.prefix!r}: "
                                 f"{self.layout.difference_from_digest(p.tensors, p.signature)}")
