"""Held steps (step control) on one protocol node fed by hand: phases, deadlines, the trigger, and
what the node reports to its owner (`StepProgress`)."""
from __future__ import annotations

import numpy as np
import pytest

from handfed import ep, pid
from zgossip.actions import StepFailed, StepProgress
from zgossip.errors import IllegalTransition, ProtocolError, RoundTimeout
from zgossip.node import Node, NodeConfig, StepPhase, StepRequest


def _node() -> Node:
    node = Node(pid(1), ep(1), NodeConfig(prefix="h", matchmaking_time=0.5), np.random.default_rng(0))
    node.start(0.0)
    node.take_actions()
    return node


def _req(**kw) -> StepRequest:
    return StepRequest("s1", None, 1.0, None, 5.0, "layout", held=True, **kw)


def test_a_held_step_needs_no_buffer_and_any_other_step_does():
    with pytest.raises(ProtocolError):
        StepRequest("s", None, 1.0, None, 1.0, "l")
    with pytest.raises(ProtocolError):
        StepRequest("s", np.zeros(2), 1.0, None, 1.0, "l", held=True)


def test_scheduled_step_waits_for_begin_at_then_matchmakes_and_reports_each_phase():
    node = _node()
    node.submit_step(_req(begin_at=2.0, due_at=2.5), 0.0)
    assert node.phase is StepPhase.SCHEDULED and node.next_deadline() <= 2.0
    assert [a for a in node.take_actions() if type(a) is StepProgress] == [StepProgress("s1", "scheduled")]
    node.on_timer(1.0)
    assert node.phase is StepPhase.SCHEDULED
    node.on_timer(2.0)
    assert node.phase is StepPhase.MATCHMAKING and node.step.started == 2.0
    node.on_timer(2.5)  # due, untriggered: the owner is asked to trigger (once)
    acts = [a for a in node.take_actions() if type(a) is StepProgress]
    assert StepProgress("s1", "matchmaking") in acts and StepProgress("s1", "matchmaking", True) in acts
    node.on_timer(2.6)
    assert not [a for a in node.take_actions() if type(a) is StepProgress and a.due]


def test_trigger_of_a_scheduled_step_starts_matchmaking_at_once_and_only_once():
    node = _node()
    node.submit_step(_req(begin_at=10.0), 0.0)
    buf = np.zeros(4, np.float32)
    assert node.trigger_step("s1", buf, 1.0, None, 1.0) is True
    assert node.phase is StepPhase.MATCHMAKING and node.step.buffer is buf
    assert node.trigger_step("s1", buf, 1.0, None, 1.1) is False  # already triggered
    assert node.trigger_step("other", buf, 1.0, None, 1.1) is False
    with pytest.raises(ProtocolError):  # what matchmaking announced must hold
        node2 = _node()
        node2.submit_step(_req(), 0.0)
        node2.trigger_step("s1", buf, 1.0, {"g": 1}, 0.1)


def test_cancelling_a_scheduled_step_does_not_advance_the_round():
    node = _node()
    r = node.round_index
    node.submit_step(_req(begin_at=10.0), 0.0)
    assert node.cancel_matchmaking("s1", 1.0, "caller") is True
    assert node.phase is StepPhase.IDLE and node.round_index == r
    failed = [a for a in node.take_actions() if type(a) is StepFailed]
    assert len(failed) == 1 and isinstance(failed[0].error, RoundTimeout)


def test_phase_moves_are_checked():
    node = _node()
    with pytest.raises(IllegalTransition):
        node._move(StepPhase.GROUPED)
