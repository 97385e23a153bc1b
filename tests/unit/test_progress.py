"""Training progress records fed by hand (`zgossip.progress`), and the choices the collaborative optimizer
makes from them where a client-mode peer is among the records: it counts, but serves no state."""
from __future__ import annotations

from types import SimpleNamespace

from zgossip.collaborative import CollaborativeOptimizer
from zgossip.progress import PeerProgress, SwarmView, progress_record, run_digest

RUN = run_digest("run")


def rec(pid: str, epoch: int, samples: float = 0.0, **kw) -> PeerProgress:
    return PeerProgress(pid, epoch, samples, 0.0, "lay", "sig", 2, **kw)


def view(me: PeerProgress, *others: PeerProgress) -> SwarmView:
    return SwarmView.of(me, {p.peer_id: progress_record(RUN, p) for p in others}, RUN)


def test_a_client_counts_in_the_swarm_but_is_no_epoch_to_download():
    v = view(rec("b", 3, 8.0), rec("a", 3, 16.0, client=True), rec("c", 3, 4.0))
    assert [p.client for p in v.peers] == [True, False, False]  # the flag survives the record
    assert v.num_peers == 3 and v.samples_at(3) == 28.0
    v = view(rec("b", 3), rec("a", 5, client=True), rec("c", 4))
    assert v.max_epoch == 5 and v.donor_epoch == 4
    assert view(rec("a", 2, client=True), rec("b", 1)).donor_epoch == 2  # its own, when nobody is ahead of it


class _Peer:
    """What `_compare_digests` / `_resync_if_needed` read and write of a CollaborativeOptimizer."""

    def __init__(self, me: PeerProgress) -> None:
        self.peer_id, self.local_epoch, self._param_digest, self.in_sync = me.peer_id, me.epoch, me.digest, me.in_sync
        self.averager = SimpleNamespace(config=SimpleNamespace(target_group_size=2))
        self.loads: list[str] = []

    def _update_sharing(self) -> None:
        pass

    def _publish(self) -> None:
        pass

    def _try_load_state(self, view: SwarmView, why: str) -> bool:
        self.loads.append(why)
        return True

    def _compare_digests(self, view: SwarmView) -> None:
        CollaborativeOptimizer._compare_digests(self, view)  # type: ignore[arg-type]


def test_a_client_is_never_the_reference_others_would_download_from():
    # digests differ, one each: the tie went to the lowest id, here a client nobody can download from
    me = rec("b", 4, digest="mine")
    peer = _Peer(me)
    peer._compare_digests(view(me, rec("a", 4, digest="theirs", client=True)))
    assert peer.in_sync  # the listening peer's parameters are the reference
    client_me = rec("a", 4, digest="theirs", client=True)
    client = _Peer(client_me)
    client._compare_digests(view(client_me, rec("b", 4, digest="mine")))
    assert not client.in_sync  # the client resynchronises with the listening peer instead
    # out of sync, with only a client in sync: no download from it; the lowest listening id becomes the reference
    me = rec("b", 4, in_sync=False)
    peer = _Peer(me)
    assert not CollaborativeOptimizer._resync_if_needed(peer, view(me, rec("a", 4, client=True)))  # type: ignore
    assert peer.in_sync and peer.loads == []
    # a client ahead is no epoch to download; a listening peer ahead is
    me = rec("b", 4)
    peer = _Peer(me)
    CollaborativeOptimizer._resync_if_needed(peer, view(me, rec("a", 6, client=True)))  # type: ignore[arg-type]
    assert peer.loads == []
    CollaborativeOptimizer._resync_if_needed(peer, view(me, rec("c", 5)))  # type: ignore[arg-type]
    assert peer.loads == ["behind: epoch 4 < swarm's 5"]


def test_a_downloading_peer_is_not_expected_and_is_paused_for_once_per_catch_up():
    """A peer that downloads the state says so (``wants_state``); a peer that holds for it says that too
    (``holding``). The others expect no downloading peer in a round, and hold off their next global step
    for it for at most ``catchup_pause`` seconds per catch-up: a new pause only once it was seen caught up
    (done, at their epoch) or gone -- not at each new download of a peer that keeps falling behind."""
    v = view(rec("b", 3), rec("a", 0, wants_state=True), rec("c", 3, holding=True))
    assert [(p.wants_state, p.holding) for p in v.peers] == [(True, False), (False, False), (False, True)]
    assert CollaborativeOptimizer._expected_peers(v) == 2
    now = [100.0]
    peer = SimpleNamespace(catchup_pause=5.0, _catchup_seen={}, local_epoch=3,
                           clock=SimpleNamespace(now=lambda: now[0]))

    def paused(*others: PeerProgress) -> bool:
        return CollaborativeOptimizer._paused(peer, view(rec("b", 3), *others))  # type: ignore[arg-type]

    assert paused(rec("a", 0, wants_state=True))
    now[0] = 104.9
    assert paused(rec("a", 0, wants_state=True))
    now[0] = 105.0  # its pause is spent
    assert not paused(rec("a", 0, wants_state=True))
    now[0] = 106.0  # between two downloads, still behind: its next download gets no new pause
    assert not paused(rec("a", 1))
    assert not paused(rec("a", 1, wants_state=True))
    now[0] = 107.0  # caught up: a later catch-up of it is paused for again
    assert not paused(rec("a", 3))
    assert paused(rec("a", 3, wants_state=True))
    now[0] = 108.0  # gone: forgotten
    assert not paused() and peer._catchup_seen == {}
    peer.catchup_pause = 0.0  # off
    assert not paused(rec("a", 0, wants_state=True))
