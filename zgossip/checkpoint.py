"""What a training wrapper's ``state_dict()`` holds, and the checks a loaded one must pass.

A user checkpoints a zgossip wrapper the way torch code checkpoints any optimizer
(``torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, path)``, later
``opt.load_state_dict(...)``), and Lightning or a user loop may hand the wrapper any dict at
all. This module owns the layout of that dict and its validation, so that a wrong one is
refused with a message saying what to do *before* anything is written:

    {"optimizer": <the wrapped optimizer's state_dict()>,
     "scheduler": <the wrapper's LR scheduler's state_dict(), or None>,
     "zgossip":   {"format": 1, "wrapper": class name, "kind": "collaborative" | "decentralized" | "diloco",
                   "optimizer_class": ..., "scheduler_class": ... | None,
                   "layout": [[name, shape, dtype], ...],   # the parameters the optimizer steps
                   "progress": {"local_epoch": E, "in_sync": bool, ...}}}   # wrapper-specific counters

A `DiLoCoOptimizer`'s dict also holds ``"diloco": {"anchor": [tensors], "outer": <its outer
optimizer's state_dict()>}``, checked by the wrapper itself (`zgossip.diloco`).

Plain Python and tensors only, so ``torch.load(weights_only=True)`` reads it back. Like
torch's own ``Optimizer.state_dict()``, it holds no parameters (the model's ``state_dict()``
does) and references, not copies, of the optimizer's tensors: save it before the next `step`.
What each wrapper keeps in "progress", and what it deliberately leaves out, is documented on
its ``state_dict`` (docs/training.md, "Checkpoints").
"""
from __future__ import annotations

import operator
from typing import Any, Mapping

import torch

from .training_state import LayoutMismatch, ModelLayout

__all__ = ["FORMAT", "checkpoint_dict", "check_checkpoint", "check_state_keys", "nonfinite_state", "whole_number"]

FORMAT = 1
_TOP = ("optimizer", "scheduler", "zgossip")
_META = ("format", "wrapper", "kind", "optimizer_class", "scheduler_class", "layout", "progress")


def whole_number(name: str, value: Any, least: int = 0) -> int:
    """`value` as an int >= `least` (ints, numpy and 0-d torch integers; not bools), or ValueError naming it."""
    n = None
    if not isinstance(value, (bool, str, float)):
        try:
            n = operator.index(value)
        except TypeError:
            pass
    if n is None or n < least:
        raise ValueError(f"{name} must be a whole number >= {least}, not {value!r}")
    return n


def nonfinite_state(state: Mapping, layout: ModelLayout) -> str | None:
    """Which entry of an optimizer state dict's ``"state"`` holds a floating-point tensor with NaN or inf
    (e.g. "'exp_avg' of tensor 0 '0.weight' ..."), or None. Training never puts one there (the wrappers
    drop non-finite batches): it comes from a checkpoint saved after the run diverged, or a damaged one."""
    for key, entry in state.items():
        if not isinstance(entry, Mapping):
            continue
        for name, value in entry.items():
            if (isinstance(value, torch.Tensor) and value.layout == torch.strided and value.is_floating_point()
                    and value.numel() and not bool(torch.isfinite(value).all())):
                where = layout.describe(key) if isinstance(key, int) and 0 <= key < len(layout.names) else repr(key)
                return f"{str(name)!r} of {where}"
    return None


def check_state_keys(opt_sd: Mapping, whose: str) -> None:
    """ValueError if an optimizer state dict (its "state" a Mapping, its "param_groups" a list of dicts with
    "params" lists) holds state under an id that no param group lists. torch maps the state to the
    parameters through those ids and keeps the others unused: the optimizer would silently start those
    parameters' state afresh (e.g. int keys turned into strings by a trip through JSON)."""
    try:
        ids = {i for g in opt_sd["param_groups"] for i in g["params"]}
        strays = [k for k in opt_sd["state"] if k not in ids]
    except TypeError:
        strays = ["an unhashable id"]
    if strays:
        raise ValueError(f"{whose} state has entries for {', '.join(map(repr, strays[:3]))}, which no param group "
                         "lists: they would be ignored, and the optimizer would start those parameters' state afresh "
                         "(keys converted on the way, e.g. ints to strings through JSON?). Pass what state_dict() "
                         "returned")


def checkpoint_dict(*, wrapper: str, kind: str, optimizer: torch.optim.Optimizer, scheduler: Any,
                    layout: ModelLayout, progress: dict) -> dict:
    """The wrapper's state dict (see the module docstring); call it under the wrapper's lock."""
    return {
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "zgossip": {"format": FORMAT, "wrapper": wrapper, "kind": kind,
                    "optimizer_class": type(optimizer).__name__,
                    "scheduler_class": type(scheduler).__name__ if scheduler is not None else None,
                    "layout": layout.as_meta(), "progress": dict(progress)},
    }


def check_checkpoint(sd: Any, *, wrapper: str, kind: str, optimizer: torch.optim.Optimizer, scheduler: Any,
                     layout: ModelLayout, progress_keys: Mapping[str, type]) -> dict:
    """Check `sd` against the wrapper that is to load it; its "progress" entries, converted (ints >= 0, bools).

    Raises TypeError (not a dict), ValueError (missing or malformed entries; another kind of wrapper,
    optimizer or scheduler; NaN/inf in the optimizer's state) or `LayoutMismatch` (other parameters, or the same ones split into other
    param groups). The wrapped optimizer's and scheduler's own checks run later, when they load."""
    if not isinstance(sd, Mapping):
        raise TypeError(f"{wrapper}.load_state_dict expects the dict {wrapper}.state_dict() returned, "
                        f"not a {type(sd).__name__}")
    if "zgossip" not in sd and {"state", "param_groups"} <= set(sd):
        raise ValueError(f"this is a plain optimizer state dict (no 'zgossip' entry), not what {wrapper}.state_dict() "
                         f"returns: load it into the wrapped optimizer (opt.opt.load_state_dict(sd)) and pass the "
                         f"epoch it was saved at as {wrapper}(..., local_epoch=E); or save opt.state_dict()")
    missing = [k for k in _TOP if k not in sd]
    meta = sd.get("zgossip")
    if not missing and isinstance(meta, Mapping):
        missing = [f"zgossip.{k}" for k in _META if k not in meta]
        progress = meta.get("progress")
        if not missing and isinstance(progress, Mapping):
            missing = [f"zgossip.progress.{k}" for k in progress_keys if k not in progress]
    if missing or not isinstance(meta, Mapping) or not isinstance(meta.get("progress"), Mapping):
        raise ValueError(f"not a {wrapper} state dict: {', '.join(missing) or 'its zgossip entries are not a dict'} "
                         f"missing. Pass what {wrapper}.state_dict() returned")
    if meta["format"] != FORMAT:
        raise ValueError(f"state dict format {meta['format']!r}: this zgossip reads format {FORMAT} "
                         "(saved by another zgossip version?)")
    if meta["kind"] != kind:
        raise ValueError(f"this state dict was saved by a {meta['wrapper']} (a {meta['kind']!r} wrapper); "
                         f"a {wrapper} ({kind!r}) cannot load it: resume with the wrapper that saved it")
    mine = type(optimizer).__name__
    if meta["optimizer_class"] != mine:
        raise ValueError(f"this state dict holds the state of optimizer class {meta['optimizer_class']}; this "
                         f"{wrapper} wraps class {mine}: build the optimizer the checkpoint was saved with")
    if scheduler is None and sd["scheduler"] is not None:
        raise ValueError(f"this state dict holds the state of an LR scheduler ({meta['scheduler_class']}) and this "
                         f"{wrapper} has none: pass scheduler= as when it was saved (or set sd['scheduler'] = None "
                         "to drop it)")
    if scheduler is not None and sd["scheduler"] is None:
        raise ValueError(f"this {wrapper} has an LR scheduler ({type(scheduler).__name__}) but the state dict holds "
                         "none: build the wrapper without a scheduler, as when it was saved (or load the scheduler's "
                         "own state with opt.scheduler.load_state_dict)")
    if scheduler is not None and meta["scheduler_class"] != type(scheduler).__name__:
        raise ValueError(f"this state dict holds the state of scheduler class {meta['scheduler_class']}; this "
                         f"{wrapper}'s is a {type(scheduler).__name__}: build the scheduler the checkpoint was saved "
                         "with")
    try:
        theirs = ModelLayout.from_meta(meta["layout"])
    except ValueError:
        raise ValueError("the state dict's zgossip.layout is malformed (expected [[name, shape, dtype], ...])") from None
    diff = layout.difference(theirs, here="this optimizer", there="the checkpoint")
    if diff is not None:
        raise LayoutMismatch(f"cannot load this state dict: {diff}. It belongs to another model: build the model "
                             "it was saved with")
    opt_sd = sd["optimizer"]
    groups = opt_sd.get("param_groups") if isinstance(opt_sd, Mapping) else None
    if not isinstance(groups, list) or not all(isinstance(g, Mapping) and isinstance(g.get("params"), list)
                                               for g in groups) or not isinstance(opt_sd.get("state"), Mapping):
        raise ValueError("the state dict's 'optimizer' entry is not an optimizer state dict "
                         "(expected {'state': {...}, 'param_groups': [{'params': [...], ...}, ...]})")
    check_state_keys(opt_sd, "the state dict's optimizer")
    bad = nonfinite_state(opt_sd["state"], layout)
    if bad is not None:
        raise ValueError(f"the state dict's optimizer state {bad} holds NaN/inf: it was saved after the training "
                         "diverged, or it is damaged. Resume from an earlier checkpoint")
    if sd["scheduler"] is not None and not isinstance(sd["scheduler"], Mapping):
        raise ValueError(f"the state dict's 'scheduler' entry must be a scheduler's state dict or None, "
                         f"not a {type(sd['scheduler']).__name__}")
    sizes = [len(g["params"]) for g in optimizer.param_groups]
    saved = [len(g["params"]) for g in groups]
    if sizes != saved:
        raise LayoutMismatch(f"cannot load this state dict: its optimizer's param groups hold {saved} tensors, this "
                             f"optimizer's {sizes}. Build the optimizer with the param groups it was saved with")
    out = {}
    for key, typ in progress_keys.items():
        value = meta["progress"][key]
        if typ is bool:
            if not isinstance(value, bool):
                raise ValueError(f"the state dict's zgossip.progress.{key} must be True or False, not {value!r}")
            out[key] = value
        else:
            out[key] = whole_number(f"the state dict's zgossip.progress.{key}", value)
    return out
