"""Overlapped averaging: what the collaborative optimizer keeps while an update runs behind the next batches.

With hivemind's ``delay_optimizer_step`` (and ``delay_grad_averaging``) the end of an epoch
-- averaging the gradients, the optimizer step -- runs on a worker while the training
thread computes the next batches; the result is applied at the next step boundary. Two
things make that safe, and they live here:

* `OffloadedParams`: the optimizer steps its own copy of the parameters (hivemind's
  ``offload_optimizer``), not the tensors the model computes with, so a background
  optimizer step never changes a parameter in the middle of a forward or backward pass.
  The model's tensors are overwritten from that copy in the training thread, between two
  batches (`copy_to_model`). The copy is authoritative: it is what newcomers download.
* `PendingUpdate`: the one update in flight (there is never more than one, so the model
  is at most one global step behind its optimizer), how many local batches were computed
  on the parameters it will replace (its staleness), and the worker's future.

Nothing here waits or starts a thread: the optimizer submits the work to its clock's
executor and commits the result itself (`zgossip.collaborative`).
"""
from __future__ import annotations

import concurrent.futures as cf
from collections.abc import MutableMapping
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

__all__ = ["OffloadedParams", "PendingUpdate", "ModelParamGroup"]


class ModelParamGroup(MutableMapping):
    """One of the optimizer's param groups as the model sees it: ``"params"`` are the model's tensors
    (which hold ``.grad``), every other entry (``lr``, ``weight_decay``...) is the optimizer's own,
    read and written through. Code that walks ``param_groups`` for the gradients (Lightning's gradient
    clipping, ``clip_grad_norm_`` over the groups' params) finds them there, not on the copies the
    optimizer steps, whose ``.grad`` is None; a scheduler or a user setting ``lr`` still reaches the
    optimizer."""

    def __init__(self, group: dict, params: list) -> None:
        self._group = group
        self._params = params

    def __getitem__(self, key: str) -> Any:
        return self._params if key == "params" else self._group[key]

    def __setitem__(self, key: str, value: Any) -> None:
        if key == "params":
            raise KeyError("the parameters of an offloaded optimizer's group are fixed")
        self._group[key] = value

    def __delitem__(self, key: str) -> None:
        if key == "params":
            raise KeyError("the parameters of an offloaded optimizer's group are fixed")
        del self._group[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._group)

    def __len__(self) -> int:
        return len(self._group)

    def __repr__(self) -> str:
        return f"ModelParamGroup({dict(self)!r})"


class OffloadedParams:
    """Give `optimizer` copies of its parameters to step (its state moves with them).

    ``model_params`` are the original tensors (forward, backward, ``.grad``); ``masters``
    the copies, now in ``optimizer.param_groups``. Standard optimizers key their state by
    the parameter object and find their parameters through ``param_groups`` only, so the
    swap is invisible to them, and an LR scheduler (which holds the optimizer) keeps working.
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.model_params: list[torch.Tensor] = []
        self.masters: list[torch.Tensor] = []
        self._optimizer = optimizer
        self._model_groups: list[list[torch.Tensor]] = []  # the model's tensors, group by group
        for group in optimizer.param_groups:
            swapped = []
            self._model_groups.append(list(group["params"]))
            for p in group["params"]:
                m = p.detach().clone().requires_grad_(p.requires_grad)
                state = optimizer.state.pop(p, None)
                if state is not None:
                    optimizer.state[m] = state
                self.model_params.append(p)
                self.masters.append(m)
                swapped.append(m)
            group["params"] = swapped

    @property
    def model_param_groups(self) -> list[ModelParamGroup]:
        """The optimizer's param groups with the model's tensors as ``"params"`` (looked up afresh: loading
        an optimizer state dict replaces the group dicts)."""
        return [ModelParamGroup(g, ps) for g, ps in zip(self._optimizer.param_groups, self._model_groups)]

    def copy_to_model(self) -> None:
        """Overwrite the model's tensors with the optimizer's (call between batches)."""
        with torch.no_grad():
            for p, m in zip(self.model_params, self.masters):
                p.copy_(m)

    def copy_to_optimizer(self) -> None:
        """Overwrite the optimizer's copies with the model's tensors (the model's state was loaded from a
        checkpoint: the model is where a user's ``model.load_state_dict`` writes)."""
        with torch.no_grad():
            for p, m in zip(self.model_params, self.masters):
                m.copy_(p)

    def zero_model_grads(self, set_to_none: bool = True) -> None:
        for p in self.model_params:
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.detach_().zero_()


@dataclass
class PendingUpdate:
    """The update of epoch `epoch` (from `samples` local samples), running on the worker since `started`."""

    epoch: int
    samples: int
    started: float
    future: cf.Future | None = None  # the worker's: its result is the round record
    stale_batches: int = 0  # local batches computed, meanwhile, on the parameters this update replaces
    info: dict[str, Any] = field(default_factory=dict)

    def done(self) -> bool:
        return self.future is None or self.future.done()
