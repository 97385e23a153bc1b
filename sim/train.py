"""Simulated training: N real zgossip trainers on the simulated network, in virtual time.

`python -m sim train SCENARIO` runs, for every peer, a plain blocking training loop --
forward, backward, ``opt.step()``, ``opt.zero_grad()`` -- with the real training classes
(`zgossip.optim.DecentralizedSGD`, `zgossip.collaborative.CollaborativeOptimizer`,
`zgossip.optim.DiLoCoOptimizer`) on a
`sim.driver.SimTransport`. Each loop is a simulated thread (`SimCluster.spawn`), so its
waits (matchmaking, rounds, state downloads, the compute time of a step) happen in virtual
time; one seed gives one trace, bit for bit (torch runs on one thread, on CPU).

The task is synthetic and comes from the seed: a random two-layer teacher network maps
``d_in`` Gaussian inputs to ``d_out`` targets (plus noise); every trainer fits a student MLP
``d_in -> hidden -> d_out`` (``hidden`` chosen so that the model holds about ``params``
values) on its own stream of samples, and all start from the same initialisation.
The held-out loss is measured on a fixed set of samples.

A scenario reuses the keys of `sim.scenario` that describe the world -- ``seed``, ``peers``
or ``[[hosts]]``, ``profiles``, ``[network]``, ``cpu``, ``membership``, ``[[faults]]``,
``[churn]``, ``bootstrap_time``, ``encode`` -- plus ``[protocol]`` (Averager settings)
and a ``[train]`` table:

    [train]
    optimizer = "moshpit"   # moshpit: DecentralizedSGD averaging on a Moshpit grid
                            # allreduce: DecentralizedSGD averaging with a group of all
                            # gossip: DecentralizedSGD averaging in groups of 2
                            # collaborative: CollaborativeOptimizer, one global batch of
                            #   peers * batch_size samples per step (gradient all-reduce)
                            # diloco: DiLoCoOptimizer, inner SGD (lr, momentum) for
                            #   average_every steps, then an outer SGD step on the mean
                            #   pseudo-gradient, a group of all (up to twice the initial
                            #   peers; steps: a multiple of average_every)
    params = 100000         # model size (approximate: the hidden width is rounded)
    d_in = 32
    d_out = 8
    batch_size = 32
    lr = 0.05
    momentum = 0.0
    steps = 50              # local steps of each initial trainer
    average_every = 1       # local steps per averaging round (decentralized kinds, diloco)
    outer_lr = 0.7          # diloco: the outer SGD's lr
    outer_momentum = 0.9    # diloco: its (Nesterov) momentum; 0 = plain SGD
    step_time = 0.2         # virtual seconds of compute per step
    grid = []               # moshpit grid; [] = the squarest 2-d grid that holds the peers (one
                            # dimension for up to 3 peers)
    eval_every = 5          # held-out loss of every live trainer every k steps
    eval_samples = 256
    noise = 0.1             # std of the target noise
    final_round = true      # after the last step, one more averaging round (decentralized kinds)
    steps_per_epoch = 0     # swarm-wide steps per epoch (0: 10 * peers * average_every); a
                            # trainer more than one epoch behind downloads state

Trainers that arrive (churn) or come back (``crash_rejoin``) join late: they bootstrap
from a live trainer and download its state (parameters, optimizer state, epoch) when the
swarm is ahead. Initial trainers make ``steps`` steps. Decentralized trainers never wait
for a round, so the swarm steps on a schedule (step k at ``bootstrap_time + k * step_time``)
and a late joiner falls in with it at the next step; a late collaborative trainer takes up
the swarm's step count, and a late DiLoCo trainer the step count of the anchor it downloaded
(its outer step times ``average_every``: the others wait for its inner steps at the next
outer step). So all curves share one step axis, and late joiners stop at
``steps`` too (or when the last initial trainer finished). Crashed trainers stop. After the
last step, ``final_round`` runs one more averaging round, pinned to its own round number so
that only trainers that finished meet in it.

The result (`TrainResult.to_json`, byte-identical from a seed whatever PYTHONHASHSEED
is; wall-clock times are reported beside it) holds, per evaluation point, each live
trainer's held-out loss, virtual time and bytes sent and received so far; per trainer its
totals; the final parameters' agreement; a hash of every loss value and the network trace.
"""
from __future__ import annotations

import hashlib
import math
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Callable

import numpy as np

from zgossip.grid import MoshpitGrid, seed_from

from .driver import Departed, SimCluster, SimPeer
from .faults import Churn, SimFaultContext, fault_from_dict, warn_unfired
from .network import PROFILES, NetworkModel
from .scenario import (HostSpec, _is_number, json_text, read_file, check_fault_peers, check_grid, check_network_peers,
                       check_network_values, check_profile_fractions, check_slow_faults)

__all__ = ["TrainScenario", "TrainSpec", "TrainRun", "TrainResult", "run_train", "load_train_scenario",
           "OPTIMIZERS"]

OPTIMIZERS = ("moshpit", "allreduce", "gossip", "collaborative", "diloco")

# Averager settings of simulated trainers unless [protocol] says otherwise: gossip a little less
# often than zgossip.trainer.TRAINING_DEFAULTS (it is most of the simulator's events at 64 peers)
_SIM_PROTOCOL = dict(gossip_interval=0.5, peer_timeout=5.0, request_timeout=0.3, matchmaking_time=0.5,
                     part_timeout=2.0, allreduce_timeout=20.0)
_AVERAGER_KEYS = {"gossip_interval", "peer_timeout", "request_timeout", "matchmaking_time", "part_timeout",
                  "allreduce_timeout", "target_group_size", "min_group_size", "part_size_bytes", "bandwidth",
                  "averaging_alpha"}


@dataclass(frozen=True)
class TrainSpec:
    """The ``[train]`` table (see the module docstring)."""

    optimizer: str = "moshpit"
    params: int = 100_000
    d_in: int = 32
    d_out: int = 8
    batch_size: int = 32
    lr: float = 0.05
    momentum: float = 0.0
    steps: int = 50
    average_every: int = 1
    step_time: float = 0.2
    grid: tuple = ()
    eval_every: int = 5
    eval_samples: int = 256
    noise: float = 0.1
    final_round: bool = True
    steps_per_epoch: int = 0
    outer_lr: float = 0.7
    outer_momentum: float = 0.9

    @classmethod
    def from_dict(cls, d: dict) -> "TrainSpec":
        if not isinstance(d, dict):
            raise ValueError(f"[train] must be a table of settings, not {d!r}")
        unknown = set(d) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"unknown [train] keys {sorted(unknown)} (known: {sorted(f.name for f in fields(cls))})")
        d = dict(d)
        # types first: params = 2.5 loaded, steps = "x" said "could not convert string to float: 'x'" and
        # grid = "4x4" "invalid literal for int()", naming no key
        for name in ("params", "d_in", "d_out", "batch_size", "steps", "average_every", "eval_every", "eval_samples",
                     "steps_per_epoch"):
            if name in d and not _is_whole(d[name]):
                raise ValueError(f"[train] {name} must be a whole number, not {d[name]!r}")
        for name in ("lr", "momentum", "step_time", "noise"):
            if name in d and not _is_number(d[name]):
                raise ValueError(f"[train] {name} must be a number, not {d[name]!r}")
        if "final_round" in d and not isinstance(d["final_round"], bool):
            raise ValueError(f"[train] final_round must be true or false, not {d['final_round']!r}")
        if "grid" in d:
            d["grid"] = tuple(check_grid(d["grid"]))
        t = cls(**d)
        if t.optimizer not in OPTIMIZERS:
            raise ValueError(f"[train] optimizer must be one of {OPTIMIZERS}, not {t.optimizer!r}")
        if min(t.params, t.d_in, t.d_out, t.batch_size, t.average_every, t.eval_every, t.eval_samples) < 1:
            raise ValueError("[train] params, d_in, d_out, batch_size, average_every, eval_every and "
                             "eval_samples must be >= 1")
        finite = all(math.isfinite(float(v)) for v in (t.steps, t.step_time, t.lr, t.noise, t.steps_per_epoch))
        if not finite or t.steps < 0 or t.step_time < 0 or not t.lr > 0 or t.noise < 0 or t.steps_per_epoch < 0:
            raise ValueError("[train] needs finite steps >= 0, step_time >= 0, lr > 0, noise >= 0, steps_per_epoch >= 0")
        if not (math.isfinite(float(t.outer_lr)) and t.outer_lr > 0 and 0 <= float(t.outer_momentum) < 1):
            raise ValueError("[train] needs a finite outer_lr > 0 and 0 <= outer_momentum < 1")
        if t.optimizer == "diloco" and t.steps % t.average_every:
            raise ValueError(f"[train] diloco: steps ({t.steps}) must be a multiple of average_every "
                             f"({t.average_every}), so that the run ends on an outer step")
        return t

    @property
    def hidden(self) -> int:
        """The hidden width that gives about `params` values: (d_in + 1) h + (h + 1) d_out."""
        return max(1, round((self.params - self.d_out) / (self.d_in + 1 + self.d_out)))


@dataclass
class TrainScenario:
    seed: int = 0
    peers: int = 8
    profiles: dict = field(default_factory=dict)
    hosts: list = field(default_factory=list)
    network: dict = field(default_factory=dict)
    protocol: dict = field(default_factory=dict)
    cpu: Any = None
    membership: str = "gossip"
    encode: bool = True
    bootstrap_time: float = 1.0
    faults: list = field(default_factory=list)
    churn: dict = field(default_factory=dict)
    train: dict = field(default_factory=dict)

    @classmethod
    def from_dict(cls, d: dict) -> "TrainScenario":
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown train scenario keys: {sorted(unknown)} (known: {sorted(known)})")
        d = dict(d)
        if d.get("hosts"):
            d["hosts"] = [HostSpec.from_dict(h).to_dict() for h in d["hosts"]]
            n = sum(h["count"] for h in d["hosts"])
            if "peers" in d and d["peers"] != n:
                raise ValueError(f"peers = {d['peers']} but [[hosts]] lists {n} hosts")
            d["peers"] = n
        sc = cls(**d)
        sc.validate()
        return sc

    def validate(self) -> None:
        # types first, as `sim.scenario.Scenario.validate` does: seed = "x", peers = 2.5, encode = "no" or
        # bootstrap_time = -1 loaded, and failed (or ran with the codec on) only later
        for name in ("seed", "peers"):
            if not _is_whole(getattr(self, name)):
                raise ValueError(f"{name} must be a whole number, not {getattr(self, name)!r}")
        if self.seed < 0 or self.peers < 1:
            raise ValueError(f"seed >= 0 and peers >= 1 are required, not seed = {self.seed}, peers = {self.peers}")
        if not _is_number(self.bootstrap_time) or not 0 <= self.bootstrap_time < math.inf:
            raise ValueError(f"bootstrap_time must be a finite number of seconds >= 0, not {self.bootstrap_time!r}")
        if not isinstance(self.encode, bool):
            raise ValueError(f"encode must be true or false, not {self.encode!r}")
        for name in ("profiles", "protocol", "network", "churn"):
            if not isinstance(getattr(self, name), dict):
                raise ValueError(f"{name} must be a table of settings, not {getattr(self, name)!r}")
        if not isinstance(self.faults, list):
            raise ValueError(f"faults must be a list of tables ([[faults]]), not {self.faults!r}")
        if self.hosts and self.profiles:
            raise ValueError("give either [[hosts]] or profiles, not both")
        bad = set(self.profiles) - set(PROFILES)
        if bad:
            raise ValueError(f"unknown profiles {sorted(bad)}; known: {sorted(PROFILES)}")
        check_profile_fractions(self.profiles)
        check_network_values(self.network)
        Churn(**self.churn)
        bad = set(self.protocol) - _AVERAGER_KEYS
        if bad:
            raise ValueError(f"unknown [protocol] settings for training {sorted(bad)} (known: {sorted(_AVERAGER_KEYS)})")
        if self.membership not in ("gossip", "static"):
            raise ValueError("membership must be gossip or static")
        check_fault_peers(self.faults, self.peers, self.churn)
        from .cpu import CpuSpec

        CpuSpec.check(self.cpu)
        check_slow_faults(self.faults, self.network, self.profiles, self.hosts)
        check_network_peers(self.network, self.peers, bool(self.profiles), bool(self.hosts),
                            bool(self.churn.get("arrival_rate")))
        spec = self.spec
        if spec.grid and spec.optimizer == "moshpit" and int(np.prod(spec.grid)) < self.peers:
            raise ValueError(f"{self.peers} peers do not fit the grid {list(spec.grid)}")

    @property
    def spec(self) -> TrainSpec:
        return TrainSpec.from_dict(self.train)

    def to_dict(self) -> dict:
        return asdict(self)


def load_train_scenario(path: str | Path) -> TrainScenario:
    return TrainScenario.from_dict(read_file(path))


def _is_whole(v: Any) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def _square_grid(n: int) -> tuple[int, ...]:
    """The default Moshpit grid of `n` trainers: the squarest 2-d grid that holds them, or one
    dimension for up to 3. (2 trainers got (1, 2): alone along the first axis, each GroupNotFound
    waited out the matchmaking window, the steps meanwhile skipped their rounds, and the two never
    averaged once; 3 got (2, 2), where one of them is alone along each axis.)"""
    if n <= 1:
        return ()  # a lone trainer: no grid (a dimension of size 1 is refused by NodeConfig)
    if n <= 3:
        return (n,)
    a = max(1, int(math.isqrt(n)))
    while a * a < n and a * (a + 1) < n:
        a += 1
    return (a, a) if a * a >= n else (a, a + 1)


# ---------------------------------------------------------------------------------------------- the task
class Task:
    """The synthetic regression task of a seed: a teacher, one sample stream per trainer, a held-out set."""

    def __init__(self, seed: int, spec: TrainSpec) -> None:
        self.spec = spec
        self.seed = seed
        rng = np.random.default_rng([seed, seed_from("teacher")])
        h = 64
        self.w1 = (rng.standard_normal((spec.d_in, h)) / math.sqrt(spec.d_in)).astype(np.float32)
        self.w2 = (rng.standard_normal((h, spec.d_out)) / math.sqrt(h)).astype(np.float32)
        self.heldout = self._samples(np.random.default_rng([seed, seed_from("heldout")]), spec.eval_samples)

    def _samples(self, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
        x = rng.standard_normal((n, self.spec.d_in)).astype(np.float32)
        y = np.tanh(x @ self.w1) @ self.w2
        y = y + self.spec.noise * rng.standard_normal(y.shape).astype(np.float32)
        return x, y.astype(np.float32)

    def stream(self, slot: int) -> Callable[[], tuple[np.ndarray, np.ndarray]]:
        rng = np.random.default_rng([self.seed, seed_from("data"), slot])
        return lambda: self._samples(rng, self.spec.batch_size)

    def initial_params(self) -> list[np.ndarray]:
        """The student's initialisation (every trainer starts from it), as torch.nn.Linear would draw it."""
        s, rng = self.spec, np.random.default_rng([self.seed, seed_from("init")])
        out = []
        for fan_in, fan_out in ((s.d_in, s.hidden), (s.hidden, s.d_out)):
            b = 1.0 / math.sqrt(fan_in)
            out.append(rng.uniform(-b, b, (fan_out, fan_in)).astype(np.float32))
            out.append(rng.uniform(-b, b, fan_out).astype(np.float32))
        return out


def _make_model(task: Task) -> Any:
    import torch

    s = task.spec
    model = torch.nn.Sequential(torch.nn.Linear(s.d_in, s.hidden), torch.nn.Tanh(), torch.nn.Linear(s.hidden, s.d_out))
    with torch.no_grad():
        for p, a in zip(model.parameters(), task.initial_params()):
            p.copy_(torch.from_numpy(a))
    return model


# ---------------------------------------------------------------------------------------------- the run
@dataclass
class TrainResult:
    scenario: dict
    evals: list[dict]  # one per (trainer, evaluation): slot, step, t, loss, sent, received
    trainers: list[dict]  # per slot
    curve: list[dict]  # per evaluation step: means over the live trainers evaluated there
    final: dict
    loss_hash: str
    trace: str
    delivered: int
    lost: int
    wall_seconds: float = 0.0  # NOT part of to_json()

    def to_json(self) -> str:
        data = {k: v for k, v in asdict(self).items() if k != "wall_seconds"}
        return json_text(data, sort_keys=True, indent=1)


class _RoundsKept:
    """What the results read of a finished trainer's optimizer (its ``rounds`` when it counts them,
    its ``last_round``), without its model, optimizer state and averager."""

    def __init__(self, opt: Any) -> None:
        if hasattr(opt, "rounds"):
            self.rounds = opt.rounds
        self.last_round = opt.last_round


class TrainRun(SimFaultContext):
    """One simulated training run (see the module docstring)."""

    def __init__(self, sc: TrainScenario) -> None:
        import torch

        torch.set_num_threads(1)  # one thread: bit-identical results, and simulated threads take turns anyway
        self.sc = sc
        self.spec = spec = sc.spec
        transfer = "tcp" if sc.hosts else "fifo"
        self.network = NetworkModel(**{"latency": 0.005, "transfer": transfer, **sc.network})
        from .cpu import CpuSpec

        self.cluster = SimCluster(seed=sc.seed, network=self.network, encode=sc.encode, membership=sc.membership,
                                  cpu=CpuSpec.from_value(sc.cpu))
        self.env = self.cluster.env
        self.clock = self.cluster.clock
        self.task = Task(sc.seed, spec)
        self.initial_count = sc.peers
        self._hosts = [spec_ for h in sc.hosts for spec_ in [HostSpec.from_dict(h)] * HostSpec.from_dict(h).count]
        self._profile_rng = self.rng("profiles")
        self._place_rng = self.rng("placement")
        grid = ()
        if spec.optimizer == "moshpit":
            grid = spec.grid or _square_grid(sc.peers)
        self.grid = MoshpitGrid(tuple(grid))
        self._cells = [tuple(int(x) for x in c) for c in np.ndindex(*self.grid.shape)] if self.grid.ndim else []
        self.slots: list[SimPeer | Departed] = []  # a crashed trainer's peer leaves a Departed (sim.driver)
        self.records: list[dict] = []
        self.evals: list[dict] = []
        self.losses = hashlib.blake2b(digest_size=16)
        self.threads: list[Any] = []
        self.initial_left = sc.peers  # initial trainers still training
        self.stop = False  # every initial trainer finished (or crashed): late joiners stop too
        self.optimizers: dict[int, Any] = {}  # slot -> its latest trainer's optimizer, while that one lives
        # per record (a slot that rejoins has several): its trainer's optimizer, and once the trainer is
        # over, only what the results read of it (`_RoundsKept`): a departed trainer's model, optimizer
        # and averager were kept to the end of the run
        self._rec_opts: list[Any] = []
        self.progress: dict[int, int] = {}  # slot -> steps made, for the trainers training now
        self.t_end: float | None = None
        self._training: dict[int, dict] = {}  # slot -> the record of the trainer training there now
        for i in range(sc.peers):
            self._start(i, late=False)
        for f in sc.faults:
            fault_from_dict(f).install(self)
        if sc.churn:
            Churn(**sc.churn).install(self)

    # ---------------------------------------------------------------- FaultContext (rng, at, peer, endpoint: SimFaultContext)
    def crash(self, index: int) -> None:
        # (a slot churn has not filled yet is refused by name, as a pause there is: it was skipped silently)
        if self.peer(index).alive:
            peer = self.slots[index]
            peer.crash()
            # the trainer ends now: its thread may still sit in a wait the crash cannot cut short (an
            # outer step waiting for its round), and that wait is no time the swarm spent training
            rec = self._training.pop(index, None)
            if rec is not None:
                self._ended(rec, float(self.env.now), crashed=True)
            gone = self.cluster.peers.get(peer.endpoint)
            if isinstance(gone, Departed) and gone.peer_id == peer.peer_id:
                self.slots[index] = gone

    def rejoin(self, index: int) -> None:
        if index < len(self.slots) and not self.slots[index].alive and not self.stop:
            self._start(index, late=True)

    def arrive(self) -> None:
        if not self.stop:
            self._start(len(self.slots), late=True)
            if self.departure_rate > 0:
                self.schedule_departure(len(self.slots) - 1, self.env.now)

    def schedule_departure(self, index: int, now: float) -> None:
        t = now + float(self.rng(f"leave-{index}").exponential(1.0 / self.departure_rate))
        if t < self.departure_until:
            self.at(t, lambda: self.crash(index))

    # ---------------------------------------------------------------- trainers
    def _averager_opts(self, index: int, peer: SimPeer) -> dict:
        sc, spec = self.sc, self.spec
        opts: dict[str, Any] = {**_SIM_PROTOCOL}
        if spec.optimizer == "gossip":
            opts.update(target_group_size=2, min_group_size=2)
        elif spec.optimizer == "moshpit":
            # (at least 2, the averager's least group: a swarm of one trains alone, its rounds find no group)
            opts.update(target_group_size=max((2, *self.grid.shape)), grid=self.grid.shape,
                        grid_coords=self._cells[index] if index < len(self._cells)
                        else self.grid.random_coords(self._place_rng))
        else:  # a group of all (capped at twice the initial swarm: the protocol bounds group sizes)
            opts.update(target_group_size=max(2, sc.peers))
        if spec.optimizer == "diloco":
            # peers that wait for each other at an outer step follow the first that enters the round; its
            # record spreads in a few gossip intervals, so the window must outlast that (it closes early once
            # every live peer joined). One group must hold the swarm, late joiners included: groups give
            # different means, and every peer outside the largest would download its state
            opts["matchmaking_time"] = 4 * opts["gossip_interval"]
            opts["target_group_size"] = max(2, 2 * sc.peers)
        opts.update(sc.protocol)
        if index < len(self._hosts) and self._hosts[index].hint is not None:
            opts["bandwidth"] = float(self._hosts[index].hint)
        # identity and protocol randomness from (seed, creation index), as SimCluster.add_peer does
        idx = self.cluster._created
        self.cluster._created += 1
        opts.update(transport=peer, seed=[sc.seed, idx])
        return opts

    def _start(self, index: int, late: bool) -> None:
        sc = self.sc
        ep = self.endpoint(index)
        if index < len(self._hosts):
            self.network.profiles[ep] = self._hosts[index].profile(f"host{index}")
        elif sc.profiles:
            names = sorted(sc.profiles)
            w = np.array([sc.profiles[n] for n in names], dtype=float)
            self.network.profiles[ep] = PROFILES[names[int(self._profile_rng.choice(len(names), p=w / w.sum()))]]
        live = [p for p in self.slots if p.alive]
        peer = SimPeer(self.cluster, ep, (), None)
        self.cluster.peers[ep] = peer
        if index < len(self.slots):
            self.slots[index] = peer
        else:
            self.slots.append(peer)
        boot = [] if sc.membership == "static" or not live else [live[0].endpoint]
        if not late and index > 0 and sc.membership != "static":
            boot = [self.endpoint(0)]
        opts = self._averager_opts(index, peer)
        rec = {"slot": index, "late": late, "joined": float(self.env.now), "started": None, "ended": None,
               "first_step": 0, "steps": 0, "crashed": False, "epoch": 0, "downloaded": False}
        self.records.append(rec)
        self._training[index] = rec
        self._rec_opts.append(None)
        self.threads.append(self.cluster.spawn(self._trainer, index, peer, boot, opts, rec, len(self.records) - 1,
                                               name=f"trainer{index}"))

    def _make_optimizer(self, model: Any, boot: list[str], opts: dict) -> Any:
        import torch

        spec = self.spec
        steps_per_epoch = spec.steps_per_epoch or 10 * self.sc.peers * spec.average_every
        common = dict(prefix="train", model=model, initial_peers=boot, averager_opts=opts,
                      startup_timeout=max(1.0, 5 * opts["gossip_interval"]), load_state_timeout=30.0,
                      state_chunk_timeout=5.0)
        if spec.optimizer == "collaborative":
            from zgossip.collaborative import CollaborativeOptimizer

            sgd = torch.optim.SGD(model.parameters(), lr=spec.lr, momentum=spec.momentum)
            return CollaborativeOptimizer(sgd, target_batch_size=self.sc.peers * spec.batch_size,
                                          batch_size=spec.batch_size,
                                          matchmaking_time=opts["matchmaking_time"],
                                          target_group_size=opts["target_group_size"], **common)
        if spec.optimizer == "diloco":
            from zgossip.optim import DiLoCoOptimizer

            def outer(params: list) -> Any:
                return torch.optim.SGD(params, lr=spec.outer_lr, momentum=spec.outer_momentum,
                                       nesterov=spec.outer_momentum > 0)

            sgd = torch.optim.SGD(model.parameters(), lr=spec.lr, momentum=spec.momentum)
            return DiLoCoOptimizer(sgd, inner_steps=spec.average_every, outer=outer,
                                   matchmaking_time=opts["matchmaking_time"],
                                   target_group_size=opts["target_group_size"],
                                   min_group_size=opts.get("min_group_size", 2), **common)
        from zgossip.optim import DecentralizedSGD

        return DecentralizedSGD(model.parameters(), lr=spec.lr, momentum=spec.momentum,
                                average_every=spec.average_every, steps_per_epoch=steps_per_epoch,
                                matchmaking_time=opts["matchmaking_time"],
                                target_group_size=opts["target_group_size"],
                                min_group_size=opts.get("min_group_size", 2), **common)

    def _evaluate(self, model: Any) -> float:
        import torch

        x, y = self.task.heldout
        with torch.no_grad():
            return float(torch.nn.functional.mse_loss(model(torch.from_numpy(x)), torch.from_numpy(y)))

    def _bytes(self, ep: str) -> tuple[int, int]:
        return int(self.network.sent_bytes.get(ep, 0)), int(self.network.received_bytes.get(ep, 0))

    def _record_eval(self, index: int, peer: SimPeer, model: Any, step: int) -> None:
        loss = self._evaluate(model)
        sent, recv = self._bytes(peer.endpoint)
        self.evals.append({"slot": index, "step": step, "t": float(self.env.now), "loss": loss, "sent": sent,
                           "received": recv})
        self.losses.update(np.float64(loss).tobytes())

    def _trainer(self, index: int, peer: SimPeer, boot: list[str], opts: dict, rec: dict, nrec: int) -> None:
        """One trainer's whole life: a plain blocking loop (what a user writes), in virtual time."""
        import torch

        clock, spec = self.clock, self.spec
        model = _make_model(self.task)
        batches = self.task.stream(index)
        opt = self._make_optimizer(model, boot, opts)
        peer.averager = opt.averager
        self.optimizers[index] = opt
        self._rec_opts[nrec] = opt
        rec["downloaded"] = opt.local_epoch > 0
        late = rec["late"]
        t0, dt = self.sc.bootstrap_time, spec.step_time
        step = 0
        if spec.optimizer == "diloco" and late:
            # it starts its inner steps from the anchor it downloaded (or the initial one): the step of that
            # anchor on the swarm's axis; the others wait for it at the next outer step
            step = opt.local_epoch * spec.average_every + opt.steps_in_epoch
        elif spec.optimizer == "collaborative" and late and clock.now() > t0:
            # its steps wait for the swarm's rounds: it takes up the swarm's step count (its state came from
            # there), so that the curves of all trainers share one step axis and it stops when the others do
            step = max((self.progress[s] for s, p in enumerate(self.slots) if p.alive and s in self.progress),
                       default=0)
        elif clock.now() > t0 and dt > 0:
            # decentralized trainers never wait for a round: the swarm steps on a schedule (step k at
            # t0 + k * step_time), and a late joiner falls in with it at the next step
            step = math.ceil((clock.now() - t0) / dt - 1e-9)
        clock.sleep(max(0.0, t0 + step * dt - clock.now()))  # the initial trainers start together
        rec["started"] = float(clock.now())
        rec["first_step"] = step
        evaluated: set[int] = set()  # (a DiLoCo trainer that downloaded the state passes some steps twice)
        try:
            while peer.alive and step < spec.steps and not (late and self.stop):
                self.progress[index] = step
                if step % spec.eval_every == 0 and step not in evaluated:
                    evaluated.add(step)
                    self._record_eval(index, peer, model, step)
                x, y = batches()
                loss = torch.nn.functional.mse_loss(model(torch.from_numpy(x)), torch.from_numpy(y))
                loss.backward()
                self.losses.update(np.float64(loss.item()).tobytes())
                clock.sleep(spec.step_time)  # the compute a real step takes
                if not peer.alive:
                    break
                opt.step()
                opt.zero_grad()
                step += 1
                if spec.optimizer == "diloco":
                    # a trainer that downloaded the state (left out of an outer step) starts that outer step's
                    # inner steps again from its anchor: it takes up the anchor's place on the step axis
                    step = opt.local_epoch * spec.average_every + opt.steps_in_epoch
            if peer.alive:
                if spec.optimizer in ("collaborative", "diloco"):
                    # as train-demo ends: let the last records spread, then make sure this trainer holds
                    # the swarm's model (a trainer that stepped alone at the end is resolved here)
                    clock.sleep(2 * opts["gossip_interval"])
                    opt.synchronize()
                else:
                    opt.apply_pending(wait=True)
                    if spec.final_round and peer.alive:
                        # a pinned round: the trainers that finished meet only each other, never a
                        # scheduled round of one still training
                        opt.average(wait=True, round=1_000_000 + spec.steps)
                self._record_eval(index, peer, model, step)
        finally:
            # what `_trainer_rows` reads of the optimizer: only this thread changes it (its steps and
            # rounds), and it is over; a crashed trainer's optimizer is read no more (`_final`: live slots)
            self._rec_opts[nrec] = _RoundsKept(opt)
            if not peer.alive and self.optimizers.get(index) is opt:
                del self.optimizers[index]
            self.progress.pop(index, None)
            # (a DiLoCo trainer may take up a step of the axis again: count the steps it made)
            rec["steps"] = opt.local_step if spec.optimizer == "diloco" else step - rec["first_step"]
            rec["epoch"] = int(opt.local_epoch)
            if self._training.get(index) is rec:
                del self._training[index]
                self._ended(rec, float(clock.now()), crashed=not peer.alive)

    def _ended(self, rec: dict, now: float, crashed: bool) -> None:
        """A trainer is over: finished, or crashed (then at the crash, not when its thread next runs)."""
        rec["ended"] = now
        rec["crashed"] = crashed
        if not rec["late"]:
            self.initial_left -= 1
            if self.initial_left == 0:
                self.stop = True
                self.t_end = now

    # ---------------------------------------------------------------- run
    def run(self) -> TrainResult:
        try:
            res = self._run()
            warn_unfired(self.sc.faults, self.env.now)
            return res
        finally:
            self.clock.close()  # (`sim.clock.VirtualClock.close`: nothing of this run stays alive)

    def _run(self) -> TrainResult:
        w0 = time.perf_counter()
        env = self.env
        limit = self.sc.bootstrap_time + 10.0 + self.spec.steps * (self.spec.step_time + 30.0)
        while True:
            pending = [th.done for th in self.threads if not th.done.triggered]
            if not pending:
                break
            env.run(until=env.any_of([env.all_of(pending), env.timeout(max(0.0, limit - env.now))]))
            if env.now >= limit:
                break
            # threads spawned meanwhile (late joiners) join the next wait
        for th in self.threads:
            if th.done.triggered and not th.done.ok:
                raise th.done.value
        wall = time.perf_counter() - w0
        res = TrainResult(self.sc.to_dict(), self.evals, self._trainer_rows(), self._curve(), self._final(),
                          self.losses.hexdigest(), self.cluster.trace_hash, self.cluster.delivered,
                          self.cluster.lost, wall)
        return res

    def _trainer_rows(self) -> list[dict]:
        out = []
        for rec, opt in zip(self.records, self._rec_opts):
            row = dict(rec)
            ep = self.endpoint(rec["slot"])
            row["sent"], row["received"] = self._bytes(ep)
            if opt is not None and hasattr(opt, "rounds"):
                row["rounds"] = dict(opt.rounds)
            if opt is not None:
                row["last_round"] = {k: v for k, v in opt.last_round.items() if k in ("ok", "group_size", "error")}
            out.append(row)
        return out

    def _curve(self) -> list[dict]:
        """Per evaluation step: the mean over trainers evaluated there of time, loss and bytes."""
        by_step: dict[int, list[dict]] = {}
        for e in self.evals:
            by_step.setdefault(e["step"], []).append(e)
        rows = []
        for step in sorted(by_step):
            es = by_step[step]
            rows.append({"step": step, "n": len(es), "t": float(np.mean([e["t"] for e in es])),
                         "loss": float(np.mean([e["loss"] for e in es])),
                         "loss_max": float(max(e["loss"] for e in es)),
                         "sent": float(np.mean([e["sent"] for e in es])),
                         "received": float(np.mean([e["received"] for e in es]))})
        return rows

    def _final(self) -> dict:
        live = [i for i, p in enumerate(self.slots) if p.alive and i in self.optimizers]
        params = {i: np.concatenate([p.detach().numpy().reshape(-1) for p in self.optimizers[i].params])
                  for i in live}
        digests = sorted({hashlib.blake2b(v.tobytes(), digest_size=8).hexdigest() for v in params.values()})
        spread = 0.0
        if params:
            xs = np.stack(list(params.values())).astype(np.float64)
            spread = float(((xs - xs.mean(axis=0)) ** 2).mean())
        groups: dict[str, list[int]] = {}
        for i, v in params.items():
            groups.setdefault(hashlib.blake2b(v.tobytes(), digest_size=8).hexdigest(), []).append(i)
        return {"live": len(live), "identical": len(digests) == 1, "distinct_params": len(digests),
                "param_groups": sorted(sorted(g) for g in groups.values()),
                "spread": spread, "t_end": self.t_end, "t_final": float(self.env.now)}


def run_train(sc: TrainScenario | dict) -> TrainResult:
    if isinstance(sc, dict):
        sc = TrainScenario.from_dict(sc)
    return TrainRun(sc).run()
