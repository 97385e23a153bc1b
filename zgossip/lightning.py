"""A Lightning strategy for collaborative training over zgossip (``pip install zgossip[lightning]``).

    from zgossip.lightning import ZGossipStrategy
    trainer = Trainer(strategy=ZGossipStrategy(target_batch_size=8192), accelerator="cpu")

This module owns the glue between Lightning's training loop and
`zgossip.collaborative.CollaborativeOptimizer`: it takes the arguments of Lightning's
``HivemindStrategy`` with the same meanings (``target_batch_size``, ``run_id``,
``batch_size``, the ``delay_*`` options, ``offload_optimizer``, ``reuse_grad_buffers``,
``scheduler_fn``, ``matchmaking_time``, ``averaging_timeout``, ``verbose``,
``averager_opts``, ``initial_peers`` or the ``PL_INITIAL_PEERS`` environment variable) and
``listen`` for ``host_maddrs``, plus zgossip's ``secret_key`` / ``allowed_keys`` and
``compression`` / ``error_feedback`` / ``state_compression``. On the first
training batch it wraps the LightningModule's optimizer, joins the swarm (downloading its
state if the run is ahead) and prints the address other machines should pass as their
initial peer. Every ``optimizer.step`` of Lightning's loop then accumulates; the swarm takes
one optimizer step per ``target_batch_size`` samples. The module's LR scheduler (one at most) steps
once per global step, inside the optimizer, and a newcomer downloads its state with the rest.

Works with whichever of ``lightning`` (``lightning.pytorch``) or ``pytorch_lightning`` is
installed; `strategy_for` builds the class on the other one where both are. Nothing else in
zgossip imports this module, so zgossip imports fine without Lightning.
"""
from __future__ import annotations

import logging
import math
import numbers
import os
from typing import Any, Callable, Sequence

import torch

from .collaborative import CollaborativeOptimizer, _count

__all__ = ["ZGossipStrategy", "strategy_for", "INITIAL_PEERS_ENV"]

log = logging.getLogger(__name__)

INITIAL_PEERS_ENV = "PL_INITIAL_PEERS"  # as HivemindStrategy: comma-separated initial peers
EPOCH_KEY = "zgossip_local_epoch"  # the swarm's global step, saved beside the optimizer's state in a checkpoint
SCHEDULER_KEY = "zgossip_scheduler"  # scheduler_fn's scheduler's state, saved there too (Lightning saves the module's)


def _import(package: str | None) -> Any:
    names = [package] if package else ["lightning.pytorch", "pytorch_lightning"]
    for name in names:
        try:
            return __import__(name, fromlist=["strategies"])
        except ImportError:
            continue
    raise ImportError("zgossip.lightning needs Lightning 2.x: pip install 'zgossip[lightning]' "
                      "(or install pytorch_lightning)")


class _SteppedPerGlobalStep:
    """Stands in for a LightningModule's LR scheduler in Lightning's loop: the `CollaborativeOptimizer`
    steps the real one once per global (swarm-wide) step, so Lightning's calls to `step` do nothing."""

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler

    def __getattr__(self, name: str) -> Any:
        # the real scheduler's attributes, read now (``last_epoch``, ``_last_lr``, ``optimizer``, ...): a copy taken
        # when it was wrapped stayed at 0 and the initial rate while the real one stepped
        if name == "scheduler":  # not set yet (copy, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.scheduler, name)

    def step(self, *args: Any, **kwargs: Any) -> None:
        pass

    def get_last_lr(self) -> list:
        return self.scheduler.get_last_lr()

    def state_dict(self) -> dict:
        return self.scheduler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.scheduler.load_state_dict(state)


#: hivemind's names for what zgossip offers under another name (HivemindStrategy passes them on to
#: hivemind.Optimizer): where a migrating user finds it here
_HIVEMIND_NAMES = {
    "host_maddrs": "pass listen='tcp://HOST:PORT' (port 0: any free one)",
    "batch_size_per_step": "pass batch_size=",
    "grad_compression": "pass compression= (e.g. 'fp16', 'int8'; zgossip.codecs)",
    "state_averaging_compression": "pass state_compression=",
    "load_state_compression": "pass state_compression=",
    "client_mode": "pass averager_opts={'client_mode': True}",
    "auxiliary": "pass averager_opts={'auxiliary': True}",
    "use_local_updates": "zgossip has no local-updates mode under the strategy; "
                         "zgossip.optim.DecentralizedOptimizer steps locally and averages parameters",
}
#: CollaborativeOptimizer arguments the strategy fills in itself
_SET_BY_STRATEGY = {"prefix": "run_id", "target_batch_size": "target_batch_size", "batch_size": "batch_size",
                    "scheduler": "scheduler_fn", "model": "(the LightningModule)",
                    "initial_peers": "initial_peers", "listen": "listen",
                    "local_epoch": "(the checkpoint's, with fit(ckpt_path=...))"}


def _check_optimizer_kwargs(kwargs: dict) -> None:
    """Refuse, when the strategy is made, keyword arguments `CollaborativeOptimizer` would refuse at the first
    training batch (a misspelt name, or one of hivemind's), saying where to put them instead."""
    for name in kwargs:
        if name in _HIVEMIND_NAMES:
            raise TypeError(f"ZGossipStrategy does not take {name!r} (hivemind's name): {_HIVEMIND_NAMES[name]}")
    _refuse_names(kwargs, CollaborativeOptimizer.__init__, _SET_BY_STRATEGY, "optimizer",
                  "ZGossipStrategy got an unexpected keyword argument {name!r}: its own arguments and those of "
                  "CollaborativeOptimizer are taken ({known})")


def _refuse_names(names: Any, fn: Any, set_by_strategy: dict[str, str], whose: str, unknown: str) -> None:
    """Refuse the names the strategy fills in itself (saying which of its arguments to use instead) and those
    `fn` does not take (`unknown`, formatted with the name and the names it takes)."""
    import inspect

    known = set(inspect.signature(fn).parameters) - {"self", "optimizer"}
    for name in names:
        if name in set_by_strategy:
            raise TypeError(f"ZGossipStrategy sets the {whose}'s {name!r} itself: use {set_by_strategy[name]}")
        if name not in known:
            raise TypeError(unknown.format(name=name, known=", ".join(sorted(known - set(set_by_strategy)))))


#: Averager arguments the strategy fills in itself (in `averager_opts` they clashed at the first training batch)
_AVERAGER_SET_BY_STRATEGY = {"tensors": "(the model's gradients)", "prefix": "run_id", "listen": "listen",
                             "initial_peers": "initial_peers", "state_fn": "(the optimizer's state)"}


def _seconds(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"ZGossipStrategy({name}=...) must be a positive, finite number of seconds, not {value!r}")
    return float(value)


def _check_options(run_id: Any, averager_opts: Any, peers: Any, listen: Any, scheduler_fn: Any) -> list[str]:
    """Refuse, when the strategy is made, the options that `CollaborativeOptimizer` and the `Averager` refused
    only at the first training batch, inside ``trainer.fit`` (some as an ``AttributeError`` or a ``TypeError``
    about ``encode`` or iteration); return the initial peers as a list."""
    from .averager import Averager
    from .endpoints import check_endpoint
    from .identity import split_peer

    if not isinstance(run_id, str) or not 1 <= len(run_id) <= 200:
        raise ValueError(f"ZGossipStrategy(run_id=...) must be a string of 1..200 characters, not {run_id!r}")
    if averager_opts is not None and not isinstance(averager_opts, dict):
        raise TypeError(f"ZGossipStrategy(averager_opts=...) must be a dict of zgossip.Averager keyword arguments, "
                        f"not {type(averager_opts).__name__}")
    opts = averager_opts or {}
    _refuse_names(opts, Averager.__init__, _AVERAGER_SET_BY_STRATEGY, "averager",
                  "ZGossipStrategy(averager_opts=...) got {name!r}, which zgossip.Averager does not take ({known})")
    if isinstance(peers, str):
        peers = [p.strip() for p in peers.split(",") if p.strip()]
    elif peers is None:
        peers = []
    elif isinstance(peers, (list, tuple)) and all(isinstance(p, str) for p in peers):
        peers = list(peers)
    else:
        raise TypeError(f"initial_peers must be 'tcp://HOST:PORT', a comma-separated string of them or a list, "
                        f"not {peers!r}")
    if opts.get("transport") is None:  # another transport names peers its own way
        for p in peers:
            check_endpoint(split_peer(p)[0], "initial peer address")
        if listen is not None and not opts.get("client_mode"):  # None: client mode (zgossip.Averager)
            check_endpoint(listen, "listen address", listen=True)
    if scheduler_fn is not None and not callable(scheduler_fn) and not hasattr(scheduler_fn, "step"):
        raise TypeError(f"ZGossipStrategy(scheduler_fn=...) must be a callable optimizer -> LR scheduler, or a "
                        f"scheduler, not {scheduler_fn!r}")
    return peers


def strategy_for(package: str | None = None) -> type:
    """The strategy class built on `package` ("lightning.pytorch" or "pytorch_lightning"; None: the first
    installed). Trainers of one package refuse strategies of the other."""
    pl = _import(package)
    cached = _CLASSES.get(pl.__name__)
    if cached is not None:
        return cached
    from importlib import import_module

    Base = import_module(pl.__name__ + ".strategies").SingleDeviceStrategy
    rank_zero = import_module(pl.__name__ + ".utilities.rank_zero")
    data_utils = import_module(pl.__name__ + ".utilities.data")
    exceptions = import_module(pl.__name__ + ".utilities.exceptions")

    class ZGossipStrategy(Base):  # type: ignore[misc, valid-type]
        """Collaborative training with zgossip: peers train one model with a global batch of
        ``target_batch_size`` samples (see the module docstring; arguments as Lightning's HivemindStrategy).

        ``listen`` is where this peer accepts connections (hivemind's ``host_maddrs``; the default takes
        every interface and advertises this host's address). ``secret_key`` / ``allowed_keys``: CURVE keys
        (`zgossip.Averager`). ``compression`` (e.g. ``"fp16"``, ``"int8"``), ``error_feedback`` and
        ``state_compression``: how the gradients travel in a round and the state to newcomers
        (`zgossip.codecs`; every peer of a run must use the same). ``optimizer_kwargs`` go to `CollaborativeOptimizer` (e.g.
        ``target_group_size``, ``min_group_size``, ``load_state_timeout``)."""

        INITIAL_PEERS_ENV = INITIAL_PEERS_ENV

        def __init__(
            self,
            target_batch_size: int,
            run_id: str = "lightning_run",
            batch_size: int | None = None,
            delay_state_averaging: bool = False,
            delay_optimizer_step: bool | None = None,
            delay_grad_averaging: bool = False,
            offload_optimizer: bool | None = None,
            reuse_grad_buffers: bool = False,
            scheduler_fn: Callable | None = None,
            matchmaking_time: float = 5.0,
            averaging_timeout: float = 30.0,
            verbose: bool = False,
            averager_opts: dict | None = None,
            initial_peers: str | Sequence[str] | None = None,
            listen: str = "tcp://0.0.0.0:0",
            secret_key: Any = None,
            allowed_keys: Any = None,
            compression: Any = None,
            error_feedback: bool = False,
            state_compression: Any = None,
            **optimizer_kwargs: Any,
        ) -> None:
            super().__init__(device=torch.device("cpu"))
            target_batch_size = _count("target_batch_size", target_batch_size, 1)  # refused here, not at the first batch
            if batch_size is not None:
                batch_size = _count("batch_size", batch_size, 0)
            if delay_grad_averaging and delay_optimizer_step is False:
                raise ValueError("delay_grad_averaging needs delay_optimizer_step")
            matchmaking_time = _seconds("matchmaking_time", matchmaking_time)
            averaging_timeout = _seconds("averaging_timeout", averaging_timeout)
            self._initial_peers = _check_options(run_id, averager_opts, os.environ.get(INITIAL_PEERS_ENV) or initial_peers,
                                                 listen, scheduler_fn)
            self._target_batch_size = int(target_batch_size)
            self._batch_size = batch_size
            self._scheduler_fn = scheduler_fn
            self._run_id = run_id
            self._listen = listen
            self._verbose = verbose
            if reuse_grad_buffers:
                # hivemind accumulates in p.grad to save memory; zgossip always accumulates in buffers of its
                # own (one gradient-sized copy), so Lightning's zero_grad stays as it is
                rank_zero.rank_zero_warn("ZGossipStrategy(reuse_grad_buffers=True) has no effect: zgossip "
                                         "accumulates gradients in its own buffers")
            opts = dict(averager_opts or {})
            if secret_key is not None:
                opts["secret_key"] = secret_key
            if allowed_keys is not None:
                opts["allowed_keys"] = allowed_keys
            if compression is not None:
                opts["compression"] = compression
            if error_feedback:
                opts["error_feedback"] = True
            if state_compression is not None:
                opts["state_compression"] = state_compression
            self._optimizer_kwargs = dict(
                matchmaking_time=matchmaking_time, allreduce_timeout=averaging_timeout,
                delay_optimizer_step=delay_optimizer_step, delay_grad_averaging=delay_grad_averaging,
                delay_state_averaging=delay_state_averaging, offload_optimizer=offload_optimizer,
                averager_opts=opts, **optimizer_kwargs)
            _check_optimizer_kwargs(optimizer_kwargs)
            self._batch_size_given = batch_size is not None
            self._opt: CollaborativeOptimizer | None = None
            self._live = False  # `_opt` wraps this fit's optimizer (teardown shuts it down; the next fit builds anew)
            self._raw_optimizer: torch.optim.Optimizer | None = None
            self._batches = 0  # batches since the last optimizer.step (accumulate_grad_batches > 1)
            self._samples = 0  # their samples
            self._last_peers: list[str] = []  # addresses of the run's peers when the previous fit ended
            self._final_num_peers = 1  # the run's peers (this one included) when the previous fit ended
            self._restored_epoch = 0  # the global step of the checkpoint this fit resumes from (0: none)
            self._restored_scheduler: dict | None = None  # and the state of scheduler_fn's scheduler it saved
            if verbose:
                logging.getLogger("zgossip").setLevel(logging.INFO)

        # ---------------------------------------------------------------- what users read
        @property
        def zgossip_optimizer(self) -> CollaborativeOptimizer | None:
            """The `CollaborativeOptimizer` (from the first training batch on; after `fit` ends it stays readable,
            shut down, until the next `fit`'s first batch replaces it)."""
            return self._opt

        @property
        def endpoint(self) -> str | None:
            """The address other peers pass as their initial peer (from the first training batch on)."""
            return self._opt.endpoint if self._opt is not None else None

        @property
        def num_peers(self) -> int:
            """Live peers of the run, this one included (1 before the first training batch; after `fit`, as many
            as there were when it ended: the shut-down averager sees nobody)."""
            if self._opt is None:
                return 1
            return self._opt.num_peers if self._live else self._final_num_peers

        # ---------------------------------------------------------------- Lightning hooks
        def _infer_batch_size(self, batch: Any) -> int:
            try:
                return data_utils.extract_batch_size(batch)
            except (exceptions.MisconfigurationException, RecursionError) as e:
                raise exceptions.MisconfigurationException(
                    "ZGossipStrategy could not infer the batch size from a batch: pass "
                    "ZGossipStrategy(batch_size=...)") from e

        def on_train_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
            if not self._live:
                # every fit: Lightning re-creates the module's optimizer in each `fit`, so a strategy reused for
                # a second one wraps the new optimizer in a new CollaborativeOptimizer (it joins the swarm again,
                # downloading its state if the run is ahead); the previous one was shut down by `teardown`
                if not self._batch_size_given:
                    self._batch_size = self._infer_batch_size(batch)
                    log.info("ZGossipStrategy: local batch size %d (from the first batch)", self._batch_size)
                self._batches = 0
                self._samples = 0
                self._start()
            elif batch_idx == 0:
                # Lightning steps at the last batch of every epoch, so nothing is pending when one begins, unless
                # the previous epoch was cut short (on_train_batch_start returned -1): that batch, counted here,
                # never reached optimizer.step, and its samples were added to the next step's
                self._batches = self._samples = 0
            self._batches += 1
            # inferred, every batch counts its own size: the last batch of an epoch is often smaller, and counted
            # as a full one it was over-weighted in the mean and swelled the global batch's count
            self._samples += self._batch_size if self._batch_size_given else self._infer_batch_size(batch)
            super().on_train_batch_start(batch, batch_idx)

        def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
            inner = getattr(optimizer, "_optimizer", optimizer)
            if isinstance(inner, CollaborativeOptimizer) and "batch_size" not in kwargs:
                # with accumulate_grad_batches=k, Lightning steps once per k batches (the last of an epoch may
                # hold fewer) and its loss is their mean: the step holds the samples of every batch since the last
                kwargs["batch_size"] = self._samples if self._batches else self._batch_size
                self._batches = self._samples = 0
            return super().optimizer_step(optimizer, closure, model, **kwargs)

        def _start(self) -> None:
            module = self.lightning_module
            if module is not None and not module.automatic_optimization:
                raise exceptions.MisconfigurationException(
                    "ZGossipStrategy supports automatic optimization only (the strategy calls the optimizer)")
            if len(self.optimizers) != 1:
                raise exceptions.MisconfigurationException("ZGossipStrategy trains with exactly one optimizer")
            raw = self.optimizers[0]
            raw = getattr(raw, "_optimizer", raw)  # unwrap a LightningOptimizer
            self._raw_optimizer = raw
            scheduler = self._scheduler_fn
            if scheduler is not None and self.lr_scheduler_configs:
                # Lightning would go on stepping the module's (at every local batch or epoch) on the same optimizer
                raise exceptions.MisconfigurationException(
                    "ZGossipStrategy(scheduler_fn=...) and a scheduler from configure_optimizers would both change "
                    "the learning rate: pass one (the module's also steps once per global step)")
            if scheduler is None and self.lr_scheduler_configs:
                # the module's scheduler steps once per global step, inside the optimizer, and travels with the
                # state a newcomer downloads; Lightning's own calls to it do nothing
                if len(self.lr_scheduler_configs) > 1:
                    raise exceptions.MisconfigurationException("ZGossipStrategy supports one LR scheduler")
                config = self.lr_scheduler_configs[0]
                if isinstance(config.scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
                    raise exceptions.MisconfigurationException("ZGossipStrategy does not support ReduceLROnPlateau")
                scheduler = config.scheduler
                config.scheduler = _SteppedPerGlobalStep(scheduler)
            elif scheduler is not None:
                # scheduler_fn's: Lightning neither saves nor restores it, so the checkpoint carries its state (it
                # restarted at step 0 on resume: a warm-up ran again, LambdaLR or OneCycleLR went back to the start)
                if not isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler):
                    scheduler = scheduler(raw)
                if self._restored_scheduler is not None:
                    scheduler.load_state_dict(self._restored_scheduler)
            self._restored_scheduler = None
            # a later fit also tries the peers the previous one trained with (this peer's address changed, so
            # a first peer, which has no initial peers, would otherwise come back alone)
            peers = self._initial_peers + [p for p in self._last_peers if p not in self._initial_peers]
            opt = CollaborativeOptimizer(
                raw, prefix=self._run_id, target_batch_size=self._target_batch_size, batch_size=self._batch_size,
                scheduler=scheduler, model=module, initial_peers=peers,
                listen=self._listen, local_epoch=self._restored_epoch, **self._optimizer_kwargs)
            self._restored_epoch = 0
            self._opt = opt
            self._live = True
            self.optimizers = [opt]
            joined = ""
            if self._initial_peers:
                # what the averager actually reached, not what it was given (an initial peer may be down)
                others = opt.num_peers - 1
                joined = (f"given {len(self._initial_peers)} initial peer(s), "
                          + (f"sees {others} other peer(s), " if others else "none reachable yet (training alone), "))
            if getattr(opt.averager, "client_mode", False):
                # nobody can connect to a client: its endpoint (client://ID) is no address to join at
                join = ("It runs in client mode: other machines cannot connect to it, they join through a peer "
                        "that listens")
            else:
                join = (f"Other machines can join with:\n{INITIAL_PEERS_ENV}={opt.endpoint} python ...\nor "
                        f"ZGossipStrategy(initial_peers='{opt.endpoint}')")
            rank_zero.rank_zero_info(f"ZGossipStrategy: run {self._run_id!r}, {joined}epoch {opt.local_epoch}. {join}")

        def on_validation_start(self) -> None:
            # validation in the middle of a fit evaluates the newest parameters, not those an update in flight
            # (delay_optimizer_step) is replacing: a checkpoint saved after it (ModelCheckpoint on a validation
            # metric) applies that update, and would hold parameters other than the ones the metric measured
            if self._opt is not None and self._live:
                self._opt.apply_pending(wait=True)
            super().on_validation_start()

        def optimizer_state(self, optimizer: Any) -> dict:
            inner = getattr(optimizer, "_optimizer", optimizer)
            if inner is not None and inner is self._raw_optimizer and self._opt is not None:
                inner = self._opt  # after `fit` (teardown gave Lightning its optimizer back): the one it wrapped
            if isinstance(inner, CollaborativeOptimizer):
                inner.apply_pending(wait=True)  # a checkpoint holds the newest parameters
                # and the global step they belong to (as hivemind's Optimizer.state_dict): a resumed fit starts
                # there, not at 0, where a fresh peer's initial parameters could win the digest vote over them
                extra = ({SCHEDULER_KEY: inner.scheduler.state_dict()}
                         if self._scheduler_fn is not None and inner.scheduler is not None else {})
                return {**inner.opt.state_dict(), EPOCH_KEY: inner.local_epoch, **extra}
            return super().optimizer_state(optimizer)

        def load_optimizer_state_dict(self, checkpoint: Any) -> None:
            states = []
            for state in checkpoint["optimizer_states"]:
                if isinstance(state, dict) and EPOCH_KEY in state:
                    state = dict(state)
                    self._restored_epoch = _count(EPOCH_KEY, state.pop(EPOCH_KEY), 0)  # the next `_start` takes it
                if isinstance(state, dict) and SCHEDULER_KEY in state:
                    state = dict(state)
                    self._restored_scheduler = state.pop(SCHEDULER_KEY)
                states.append(state)
            super().load_optimizer_state_dict({**checkpoint, "optimizer_states": states})

        def _run_peer_endpoints(self) -> list[str]:
            """The addresses of the live peers of this run (best effort: [] if the averager cannot say)."""
            opt = self._opt
            try:
                ids = {p.peer_id for p in opt._view().others()}
                table = opt.averager._ask_node(lambda node: {i: r.endpoint for i, r in node.membership.peers.items()})
                return sorted(ep for i, ep in table.items() if i in ids)
            except Exception:
                return []

        def teardown(self) -> None:
            if self._opt is not None and self._live:
                try:
                    self._opt.apply_pending(wait=True)
                except Exception as e:  # a failed last update must not hide the training's own outcome
                    log.warning("ZGossipStrategy: the last delayed update was not applied: %s", e)
                self._last_peers = self._run_peer_endpoints()
                try:
                    self._final_num_peers = self._opt.num_peers
                except Exception:  # best effort, as the endpoints: the averager may have failed
                    self._final_num_peers = 1
                self._opt.shutdown()
                self._live = False  # the next fit (if any) wraps its own optimizer
                if self._raw_optimizer is not None:
                    self.optimizers = [self._raw_optimizer]
            super().teardown()

    _CLASSES[pl.__name__] = ZGossipStrategy
    return ZGossipStrategy


_CLASSES: dict[str, type] = {}


def __getattr__(name: str) -> Any:
    if name == "ZGossipStrategy":  # built on first use, on the first Lightning package installed
        return strategy_for()
    raise AttributeError(name)
