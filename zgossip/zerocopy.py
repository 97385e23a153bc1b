"""Zero-copy payloads: encoding a message's tensor frames for libzmq and tracking the loans.

Payloads of 64 KiB and more (`TRACK_BYTES`) are lent to libzmq without a copy -- through the C
sender (`zgossip.fast_send`) where it is built, else through pyzmq with a MessageTracker. The
bytes must not change until libzmq is done with them: `LentPayloads.pending` says whether any
loan is still out, and `wait` waits (bounded) until the given loans are released. A step that
snapshots the tensors reuses its snapshot buffer only when nothing is pending; an in-place
step waits for its loans before it hands the tensor back (`ZmqTransport.settle_sends`); what a
slow receiver still waits for then is dropped, and the RESULTs among it are sent again from a copy
(`settle`).
"""
from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
import time
from typing import Any, Callable

import zmq

from . import wire

__all__ = ["TRACK_BYTES", "LentPayloads"]

log = logging.getLogger(__name__)

TRACK_BYTES = 1 << 16  # payloads at least this large are sent zero-copy and tracked


class LentPayloads:
    """The loans of one transport: (tracker, endpoint) pairs until libzmq releases them."""

    def __init__(self, zsend: Any) -> None:
        self._zsend = zsend  # `_zsend` or None (pyzmq)
        # MessageTracker or _zsend.Payload, by endpoint, with the message when it is a RESULT (`settle`)
        self._lent: list[tuple[Any, str, Any]] = []
        self._lock = threading.Lock()  # the I/O thread adds, user threads ask
        self._prune_at = 64

    def encode(self, msg: wire.Message, batch: dict) -> tuple[Any, bool]:
        """Frames for `msg`, and whether its payload goes zero-copy and tracked.

        The protocol sends one message object to several peers in a row (a RESULT to every
        contributor, a GROUP to every member): it is encoded once per batch, and its payload
        becomes one `zmq.Frame` that every send shares by reference count, so libzmq releases
        it once -- one wake-up of pyzmq's garbage-collector thread instead of one per peer.
        The batch's frames are dropped when the batch is done, so a tracker finishes as soon
        as libzmq has sent the last copy.
        """
        hit = batch.get(id(msg))
        if hit is not None and hit[0] is msg:
            return hit[1], hit[2]
        frames = wire.encode(msg)
        big = bool(msg.payload) and msg.payload[-1].nbytes >= TRACK_BYTES
        zs = self._zsend
        if zs is not None:
            frames = tuple(f if isinstance(f, bytes) else zs.Payload(f) if f.nbytes >= TRACK_BYTES
                           else f.tobytes() for f in frames)
        elif big:
            frames = [frames[0], *(zmq.Frame(a, copy=False, track=True) for a in frames[1:])]
        batch[id(msg)] = (msg, frames, big)
        return frames, big

    def send(self, sock: zmq.Socket, frames: Any, big: bool, endpoint: str, msg: Any = None,
             track: bool = True) -> None:
        """Send encoded `frames` on `sock` without blocking, tracking what was lent (with `msg`, the
        message they encode, kept with the loan when it is a RESULT: `settle` may send it again;
        ``track=False``: the payload is a private copy, whose loan nobody needs to wait for).
        Raises OSError / zmq.ZMQError as the socket does (a `_zsend` error may cut a message short)."""
        keep = msg if msg is not None and msg.type is wire.MsgType.RESULT else None
        zs = self._zsend
        if zs is not None:
            zs.send(sock.underlying, frames)
            if track:
                self._track([(f, endpoint, keep) for f in frames if isinstance(f, zs.Payload)])
        elif big and not track:
            sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
        elif big:
            tracker = sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False, track=True)
            if len(frames) > 2:  # several payload frames: pending until libzmq released them all
                tracker = zmq.MessageTracker(*frames[1:])
            self._track([(tracker, endpoint, keep)])
        else:
            sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=len(frames) == 1)

    def _track(self, lent: list[tuple[Any, str, Any]]) -> None:
        if not lent:
            return
        with self._lock:
            self._lent.extend(lent)
            if len(self._lent) >= self._prune_at:
                # nobody may ask `pending` for a long time (in-place steps never do):
                # drop finished loans here so the list stays as short as what is in flight
                self._lent = [e for e in self._lent if not e[0].done]
                self._prune_at = max(64, 2 * len(self._lent))

    def pending(self) -> list[tuple[Any, str, Any]]:
        """The loans libzmq has not released yet, as (tracker, endpoint, RESULT message or None)."""
        with self._lock:
            self._lent = [e for e in self._lent if not e[0].done]
            return list(self._lent)

    def released(self, tracker: Any, timeout: float) -> bool:
        """Wait up to `timeout` until libzmq released the payload of `tracker`; True if it did."""
        if tracker.done:
            return True
        if timeout <= 0:
            return False
        zs = self._zsend
        if zs is not None and isinstance(tracker, zs.Payload):
            return bool(tracker.wait(timeout))
        try:
            tracker.wait(timeout)
        except zmq.NotDone:
            return False
        return True

    def settle(self, timeout: float, release_timeout: float,
               drop: Callable[[list[str], list[tuple[str, Any]]], None], who: str,
               gone: frozenset[str] = frozenset()) -> int:
        """Wait (at most `timeout`) until libzmq released every loan; then ``drop(endpoints, resend)``:
        close the connections whose loans are still queued and send `resend` -- the RESULTs among
        them, as (endpoint, message), in the order they were sent -- again from a copy; then wait (at
        most `release_timeout`) until libzmq let go of the tensor.

        A step that averaged the user's tensor in place calls this before handing the tensor back:
        bytes still waiting for a slow or dead peer must never leave after the user changed them.
        A PART such a peer misses leaves us out of its span, by the protocol's rules; a RESULT is
        what a slower groupmate still needs to finish its round, so it goes again from a copy (the
        transport sends it only to a member still owed one: not to one that said DONE or died).
        Loans to the endpoints in `gone` (members done with the round: they gave us up, left, or their
        connection dropped; `Node.gone`) are not waited for: nothing queued for them is of use, and
        a member cut off one way would otherwise hold the step for the whole `timeout`. They are
        dropped with the rest.
        Returns the number of peers whose data was dropped.
        """
        deadline, pending = time.monotonic() + timeout, self.pending()
        for t, ep, _ in pending:
            if ep not in gone and not self.released(t, deadline - time.monotonic()):
                break
        stuck = sorted({ep for t, ep, _ in pending if not t.done})
        if not stuck:
            return 0
        # a payload sent to several peers is one loan per send: each of its sends still pending is sent
        # again (one that had left already arrives twice; the receiver counts the copy late)
        resend, seen = [], set()
        for t, ep, msg in pending:
            if msg is not None and not t.done and (ep, id(msg)) not in seen:
                seen.add((ep, id(msg)))
                resend.append((ep, msg))
        until = time.monotonic() + release_timeout
        try:
            drop(stuck, resend)
        except RuntimeError:  # the transport is stopping: its sockets close anyway
            return 0
        except cf.TimeoutError:  # a busy I/O thread: the closing may still come; wait for the release below
            pass
        for ep in stuck:
            log.warning("zgossip node %s: dropped unsent data for %s (the step is over)", who, ep)
        # closing is asynchronous in libzmq: only once it released the payloads has it stopped reading them
        if not all(self.released(t, until - time.monotonic()) for t, _, _ in pending):
            log.warning("zgossip node %s: libzmq still holds parts of the tensor %.1f s after their "
                        "connections were closed", who, release_timeout)
        return len(stuck)

    def reap(self) -> None:
        """Release buffers libzmq finished with whose senders already let go (C sender only)."""
        if self._zsend is not None:
            self._zsend.reap()
