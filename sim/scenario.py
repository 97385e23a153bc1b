"""Scenarios: a whole simulated experiment as data, run on the real protocol, with per-round metrics.

A scenario is a dict (or a TOML file with the same keys); everything random in it is
drawn from its ``seed``, so the same scenario gives a byte-identical results file
whatever ``PYTHONHASHSEED`` is (wall-clock times are reported beside the results,
never inside them). Keys, with defaults:

    seed = 0
    peers = 16                  # initial peers (indices 0..peers-1 in faults)
    profiles = {}               # e.g. {home = 0.7, datacenter = 0.3}: fractions of named PROFILES
    numel = 1                   # values per peer, drawn from N(0, 1)
    dtype = "float64"           # "float64" or "float32" (what real runs average)
    rounds = 5
    grid = [4, 4]               # Moshpit grid, every dimension >= 2; [] = no grid (one key per round)
    placement = "full"          # full: grid order (needs peers == cells); distinct: random distinct
                                # cells; random: independent random coordinates
    unavailability = 0.0        # each round each peer sits out with this probability
    step_timeout = 5.0          # matchmaking budget of one step
    round_gap = 0.0             # virtual seconds between the end of a round and the next
    step_ahead = 0.0            # > 0: scheduled steps, as a training loop overlapping compute makes
                                # them: each peer calls step(scheduled_time=T, wait=False) this many
                                # seconds before T (matchmaking runs meanwhile) and the all-reduce
                                # begins at T; step times are counted from T
    bootstrap_time = 1.0        # virtual seconds of gossip before round 0
    membership = "gossip"       # "gossip" (bootstrap from peer 0) or "static" (pre-seeded, converged)
    encode = true               # pass every message through the wire codec, as ZeroMQ does
    compression = "none"        # wire codec of the tensor: none, fp16, bf16, int8 (zgossip.codecs)
    error_feedback = false      # carry each peer's quantization residual to its next step
    [protocol]                  # zgossip.NodeConfig fields, e.g. target_group_size, part_timeout
                                # (checked at load; not grid, grid_coords, grid_auto: the scenario sets those)
    [network]                   # latency (number or {dist=...}; default 0.005 s one way, added to
                                # every message, [[hosts]] scenarios too), bandwidth (bytes/s, or
                                # {"sim://peerN" = bytes/s} per peer; for peers without a profile or
                                # host link, so refused beside profiles), loss, jitter,
                                # transfer = "tcp" | "fifo" (sim.tcp / sim.network; default: "tcp"
                                # with [[hosts]], else "fifo"), tcp = {profile = PATH, mss, init_cwnd,
                                # rmem_max, congestion_control, ...} (Linux defaults unless given),
                                # down_queue = {seconds, min_bytes} (tcp: each downlink's queue holds
                                # max(min_bytes, seconds x rate) and tail-drops the rest; default unbounded)
    cpu = "auto" | "PATH" | {profile = PATH, cores = N, shared = true}
                                # CPU time per handling from a `python -m sim calibrate` profile
                                # (sim.cpu); cores = N shared: all peers share N cores. Default: none
    [[hosts]]                   # explicit hosts (then `peers` may be left out: it is their count);
                                # each: up_mbit, down_mbit, latency_ms (one way, host <-> switch:
                                # host i to host j takes latency_i + latency_j), jitter_ms, loss
                                # (packet loss probability on this host's link, each direction),
                                # hint (the protocol's `bandwidth` for this peer, a number or
                                # "auto" = measured; omitted = 1.0),
                                # count (this many identical hosts). The testbed (sim.testbed)
                                # builds exactly these links; the simulator adds [network] latency
                                # (0.005 s unless given) to each message on top of them.
    [[faults]]                  # see sim.faults: crash, crash_rejoin, pause, partition (one_way =
                                # true: only sides[0] -> sides[1] is cut), slow
    [churn]                     # arrival_rate, departure_rate, until

Metrics per round: mean squared distance of the live peers' values to the mean of the
initial `peers`' values, drawn at t = 0 (the Moshpit paper's metric; peers that arrive by
churn or crash later move the live mean away from it) and its max, the spread among live
peers, group sizes, participants and outcomes, bytes sent/received in the round (mean and
max over the peers that stepped: encoded message bytes, headers included), simulated time.
"""
from __future__ import annotations

import csv
import io
import json
import math
import numbers
import re
import time
from collections import Counter
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Callable

import numpy as np

from zgossip.codecs import check_name
from zgossip.grid import MoshpitGrid
from zgossip.node import NodeConfig, StepDone, StepFailed

from .cpu import CpuSpec
from .driver import Departed, SimCluster, SimPeer, gc_frozen
from .faults import Churn, CrashRejoin, SimFaultContext, check_after_crash, check_pause_windows, fault_from_dict, warn_unfired
from .network import PROFILES, NetworkModel, Profile, check_down_queue

__all__ = ["Scenario", "ScenarioRun", "ScenarioResult", "HostSpec", "run_scenario", "load_scenario", "round_metrics"]

_FAST_PROTOCOL = dict(gossip_interval=0.5, peer_timeout=5.0, matchmaking_time=0.5, request_timeout=0.3,
                      part_timeout=1.0, allreduce_timeout=10.0)


_HOST_KEYS = ("up_mbit", "down_mbit", "latency_ms", "jitter_ms", "loss", "hint", "count")


@dataclass(frozen=True)
class HostSpec:
    """One emulated host's access link (what `[[hosts]]` holds): rates in Mbit/s, one-way
    latency and jitter to the switch in ms, packet loss per direction, the bandwidth hint the
    peer declares to the protocol (None = the default), and how many such hosts."""

    up_mbit: float = 1000.0
    down_mbit: float = 1000.0
    latency_ms: float = 0.0
    jitter_ms: float = 0.0
    loss: float = 0.0
    hint: float | str | None = None  # a number, or "auto" (the protocol measures it)
    count: int = 1

    @classmethod
    def from_dict(cls, d: dict) -> "HostSpec":
        if not isinstance(d, dict):  # `hosts = [...]` of numbers or strings, or `[hosts]` for `[[hosts]]`
            raise ValueError(f"each [[hosts]] entry is a table of {', '.join(_HOST_KEYS)}, not {d!r}")
        unknown = set(d) - set(_HOST_KEYS)
        if unknown:
            raise ValueError(f"unknown [[hosts]] keys: {sorted(unknown)} (known: {sorted(_HOST_KEYS)})")
        # every number finite and a number: a string compared with a number raised a TypeError that named
        # no field, and inf or nan went through to the testbed, which failed (a traceback for inf) only
        # after building its namespaces
        for k in ("up_mbit", "down_mbit", "latency_ms", "jitter_ms", "loss"):
            v = d.get(k, 0.0)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"hosts: {k} must be a finite number, not {v!r}")
        if "count" in d and (isinstance(d["count"], bool) or not isinstance(d["count"], int)):
            raise ValueError(f"hosts: count must be a positive integer, not {d['count']!r}")
        hint = d.get("hint")
        if hint is not None and not isinstance(hint, str) and (
                isinstance(hint, bool) or not isinstance(hint, (int, float)) or not math.isfinite(hint)):
            raise ValueError(f"hosts: hint must be a number >= 0 or \"auto\", not {hint!r}")
        h = cls(**d)  # (a NaN rate, which passes every comparison below as false, hung the simulator)
        if h.up_mbit <= 0 or h.down_mbit <= 0:
            raise ValueError("hosts: up_mbit and down_mbit must be > 0")
        if h.latency_ms < 0 or h.jitter_ms < 0:
            raise ValueError("hosts: latency_ms and jitter_ms must be >= 0")
        if not 0.0 <= h.loss < 1.0:
            raise ValueError("hosts: loss is a probability below 1")
        if isinstance(h.hint, str):
            if h.hint != "auto":
                raise ValueError("hosts: hint must be a number >= 0 or \"auto\"")
        elif h.hint is not None and (not isinstance(h.hint, numbers.Real) or isinstance(h.hint, bool)
                                     or not 0 <= h.hint < math.inf):
            raise ValueError(f"hosts: hint must be a finite number >= 0 or \"auto\", not {h.hint!r}")
        if not isinstance(h.count, numbers.Integral) or isinstance(h.count, bool) or h.count < 1:
            raise ValueError("hosts: count must be a positive integer")
        return h

    def to_dict(self) -> dict:
        d = asdict(self)
        if d["hint"] is None:
            del d["hint"]
        return d

    def profile(self, name: str) -> Profile:
        """The simulator's view of this link (bytes/s, seconds)."""
        return Profile(name, up=self.up_mbit * 125_000.0, down=self.down_mbit * 125_000.0,
                       latency=self.latency_ms / 1000.0, loss=self.loss, jitter=self.jitter_ms / 1000.0)


@dataclass
class Scenario:
    seed: int = 0
    peers: int = 16
    profiles: dict = field(default_factory=dict)
    numel: int = 1
    dtype: str = "float64"
    rounds: int = 5
    grid: list = field(default_factory=lambda: [4, 4])
    placement: str = "full"
    unavailability: float = 0.0
    step_timeout: float = 5.0
    round_gap: float = 0.0
    step_ahead: float = 0.0
    bootstrap_time: float = 1.0
    membership: str = "gossip"
    encode: bool = True
    compression: str = "none"
    error_feedback: bool = False
    protocol: dict = field(default_factory=dict)
    network: dict = field(default_factory=dict)
    faults: list = field(default_factory=list)
    churn: dict = field(default_factory=dict)
    hosts: list = field(default_factory=list)
    cpu: Any = None

    @classmethod
    def from_dict(cls, d: dict) -> "Scenario":
        if not isinstance(d, dict):  # a JSON file holding a list listed its items as unknown keys
            raise ValueError(f"a scenario is a table of settings (peers, grid, rounds, ...), not {type(d).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown scenario keys: {sorted(unknown)} (known: {sorted(known)})")
        d = dict(d)
        if d.get("hosts"):
            if not isinstance(d["hosts"], list):
                raise ValueError(f"hosts must be a list of tables ([[hosts]]), not {d['hosts']!r}")
            d["hosts"] = [HostSpec.from_dict(h).to_dict() for h in d["hosts"]]
            n = sum(h["count"] for h in d["hosts"])
            if "peers" in d and d["peers"] != n:
                raise ValueError(f"peers = {d['peers']} but [[hosts]] lists {n} hosts")
            d["peers"] = n
        sc = cls(**d)
        sc.validate()
        return sc

    def host_list(self) -> list["HostSpec"]:
        """One `HostSpec` per peer slot (``count`` expanded), or [] when the scenario names no hosts."""
        out: list[HostSpec] = []
        for h in self.hosts:
            spec = HostSpec.from_dict(h)
            out.extend([spec] * spec.count)
        return out

    def validate(self) -> None:
        for name in ("seed", "peers", "rounds", "numel"):
            v = getattr(self, name)
            if not isinstance(v, numbers.Integral) or isinstance(v, bool):  # (2.5 or nan failed deep in numpy)
                raise ValueError(f"{name} must be a whole number, not {v!r}")
            setattr(self, name, int(v))
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, not {self.seed}")
        # types first: a string where a number goes raised "'<=' not supported between instances of
        # 'float' and 'str'" (no key named), and encode = "no" ran with the codec on, any string being true
        for name in ("unavailability", "step_timeout", "round_gap", "step_ahead", "bootstrap_time"):
            if not _is_number(getattr(self, name)):
                raise ValueError(f"{name} must be a number, not {getattr(self, name)!r}")
        for name in ("encode", "error_feedback"):
            v = getattr(self, name)
            if not isinstance(v, (bool, np.bool_)):
                raise ValueError(f"{name} must be true or false, not {v!r}")
            setattr(self, name, bool(v))
        if not isinstance(self.profiles, dict):  # (a string listed its letters as unknown profiles)
            raise ValueError(f"profiles must be a table of fractions, e.g. {{home = 0.7, datacenter = 0.3}}, "
                             f"not {self.profiles!r}")
        if not isinstance(self.faults, list):  # `[faults]` for `[[faults]]`
            raise ValueError(f"faults must be a list of tables ([[faults]]), not {self.faults!r}")
        self.grid = check_grid(self.grid)
        if self.peers < 1 or self.rounds < 0 or self.numel < 1:
            raise ValueError("peers >= 1, rounds >= 0 and numel >= 1 are required")
        if not 0.0 <= self.unavailability <= 1.0:
            raise ValueError("unavailability is a probability")
        if not 0.0 <= self.step_ahead <= 60.0:
            raise ValueError("step_ahead must be in [0, 60] seconds")
        if not 0.0 <= self.step_timeout <= 1e6:  # the range `step(timeout=)` takes
            raise ValueError(f"step_timeout must be in [0, 1e6] seconds, not {self.step_timeout!r}")
        for name in ("round_gap", "bootstrap_time"):
            if not 0.0 <= getattr(self, name) < math.inf:
                raise ValueError(f"{name} must be a finite number of seconds >= 0, not {getattr(self, name)!r}")
        if self.placement not in ("full", "distinct", "random"):
            raise ValueError("placement must be full, distinct or random")
        if self.membership not in ("gossip", "static"):
            raise ValueError("membership must be gossip or static")
        if self.dtype not in ("float32", "float64"):
            raise ValueError(f"dtype must be float32 or float64, not {self.dtype!r}")
        check_name(self.compression)
        if self.hosts and self.profiles:
            raise ValueError("give either [[hosts]] or profiles, not both")
        cells = int(np.prod(self.grid)) if self.grid else 1
        if self.grid and self.placement in ("full", "distinct") and self.peers > cells:
            raise ValueError(f"{self.peers} peers do not fit {cells} grid cells with placement={self.placement}")
        if self.grid and self.placement == "full" and 0 < self.peers < cells:
            _check_full_placement(self.peers, tuple(int(g) for g in self.grid))
        unknown_profiles = set(self.profiles) - set(PROFILES)
        if unknown_profiles:
            raise ValueError(f"unknown profiles {sorted(unknown_profiles)}; known: {sorted(PROFILES)}")
        check_profile_fractions(self.profiles)
        _check_keys("[protocol]", self.protocol, {f.name for f in fields(NodeConfig)})
        check_protocol(self.protocol, self.grid)
        _check_keys("[network]", self.network, {f.name for f in fields(NetworkModel) if f.init and f.repr})
        check_network_values(self.network)
        check_network_peers(self.network, self.peers, bool(self.profiles), bool(self.hosts),
                            bool(self.churn.get("arrival_rate")))
        _check_keys("[churn]", self.churn, {f.name for f in fields(Churn) if f.init})
        Churn(**self.churn)  # its rates' signs, at load rather than when the run installs it
        check_fault_peers(self.faults, self.peers, self.churn)
        CpuSpec.check(self.cpu)
        check_slow_faults(self.faults, self.network, self.profiles, self.hosts)

    def to_dict(self) -> dict:
        return asdict(self)


def _check_keys(section: str, given: Any, known: set[str]) -> None:
    if not isinstance(given, dict):
        raise ValueError(f"{section} must be a table of settings, not {type(given).__name__}")
    bad = set(given) - known
    if bad:
        raise ValueError(f"unknown {section} setting{'s' * (len(bad) > 1)} {', '.join(sorted(bad))} "
                         f"(valid: {', '.join(sorted(known))})")


#: NodeConfig fields the scenario sets for each peer itself: given in [protocol] they were overridden
#: (grid_coords, silently) or contradicted the scenario's grid (failing only once the first peer started)
_PROTOCOL_OWN = {"grid": "the scenario's grid", "grid_coords": "placement", "grid_auto": "the scenario's grid"}


def check_protocol(protocol: dict, grid: list[int]) -> None:
    """The [protocol] settings as the peers' `NodeConfig` will take them, at load: a wrong type or range
    failed only when the first peer was built (in a sweep, every run failed instead of the file being
    refused), and grid settings the scenario owns were overridden or contradicted it."""
    own = sorted(set(protocol) & set(_PROTOCOL_OWN))
    if own:
        raise ValueError(f"[protocol] {own[0]} is set by the scenario (use {_PROTOCOL_OWN[own[0]]} instead)")
    kw = {**_FAST_PROTOCOL, "prefix": "scenario", "grid": tuple(grid), **protocol}
    if grid:
        kw.setdefault("target_group_size", max(grid))
    try:
        NodeConfig(**kw)
    except (ValueError, TypeError) as e:
        raise ValueError(f"[protocol] {e}") from None


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, (bool, np.bool_))


def check_grid(grid: Any) -> list[int]:
    """`grid` as a list of whole numbers >= 2, or [] (no grid). A dimension of size 1 leaves every peer
    alone along it: every round along it, every peer failed with GroupNotFound after the whole
    matchmaking window (grid = [1, 4] failed every other round); a string or a number failed deep in
    numpy, naming no key."""
    if not isinstance(grid, (list, tuple)) or not all(
            isinstance(m, (int, np.integer)) and not isinstance(m, (bool, np.bool_)) for m in grid):
        raise ValueError(f"grid must be a list of whole numbers, e.g. [4, 4], or [] for no grid, not {grid!r}")
    if any(m < 1 for m in grid):
        raise ValueError(f"grid dimensions must be >= 1, not {list(grid)}")
    if any(m == 1 for m in grid):
        rest = [int(m) for m in grid if m > 1]
        raise ValueError(f"grid = {list(grid)} has a dimension of size 1: every peer is alone along it, so every "
                         f"round along it fails; leave it out (grid = {rest}{' puts every peer under one key' * (not rest)})")
    return [int(m) for m in grid]


# the fields each latency distribution needs (`sim.network._sampler`)
_LATENCY_FIELDS = {"constant": ("value",), "uniform": ("low", "high"), "normal": ("mean", "std"),
                   "lognormal": ("median", "sigma")}


def check_network_values(net: dict) -> None:
    """Types, signs and ranges of the [network] numbers, at load: the network model took a negative
    jitter or bandwidth silently and failed on a negative latency only once a message used it; a
    string for loss, jitter or bandwidth failed in a comparison or a division that named no key, and
    a distribution without one of its fields raised a bare KeyError ('sigma')."""
    lat = net.get("latency")
    times = {"latency": lat} if lat is not None and not callable(lat) else {}
    if isinstance(lat, dict):  # a distribution (`sim.network._sampler`); a normal's mean is clipped at 0
        dist = lat.get("dist", "constant")
        if dist not in (*_LATENCY_FIELDS, "regions"):
            raise ValueError(f"[network] unknown latency distribution {dist!r} (known: {', '.join(_LATENCY_FIELDS)}, "
                             "regions)")
        need = _LATENCY_FIELDS.get(dist, ("region_of", "matrix"))
        missing = [k for k in need if k not in lat]
        if missing:
            raise ValueError(f"[network] latency {{dist = \"{dist}\"}} needs {' and '.join(need)}; "
                             f"{', '.join(missing)} missing")
        for k in ("sigma", "mean"):  # numbers of any sign
            if k in lat and not (_is_number(lat[k]) and math.isfinite(lat[k])):
                raise ValueError(f"[network] latency {k} must be a finite number, not {lat[k]!r}")
        times = {f"latency {k}": lat[k] for k in ("value", "low", "high", "median", "std") if k in lat}
        if dist == "uniform" and _is_number(lat["low"]) and _is_number(lat["high"]) and lat["low"] > lat["high"]:
            raise ValueError(f"[network] latency low ({lat['low']!r}) must not exceed high ({lat['high']!r})")
        matrix = lat.get("matrix")
        if isinstance(matrix, dict):
            times.update({f"latency matrix[{a}][{b}]": v for a, row in matrix.items() if isinstance(row, dict)
                          for b, v in row.items()})
    times["jitter"] = net.get("jitter", 0.0)
    for name, v in times.items():
        if isinstance(v, dict) and name == "latency":
            continue
        if not _is_number(v) or not 0 <= v < math.inf:
            raise ValueError(f"[network] {name} must be a finite number of seconds >= 0, not {v!r}")
    loss = net.get("loss", 0.0)
    if not _is_number(loss) or not 0 <= loss < 1:
        raise ValueError(f"[network] loss must be a probability in [0, 1), not {loss!r}")
    tcp = net.get("tcp")
    if tcp is not None and not isinstance(tcp, dict):
        raise ValueError(f"[network] tcp must be a table of TCP settings (e.g. {{mss = 1448}}), not {tcp!r}")
    if tcp:  # the settings given (a profile's are the machine's): their types and ranges, at load
        from .tcp import TcpParams

        TcpParams.from_dict({**TcpParams().to_dict(), **{k: v for k, v in tcp.items() if k != "profile"}})
    check_down_queue(net.get("down_queue"))
    bw = net.get("bandwidth")
    rates = {"bandwidth": bw} if not isinstance(bw, dict) else {f"bandwidth of {k}": v for k, v in bw.items()}
    for name, v in rates.items():
        if v is None and name == "bandwidth":  # leaving it out (None) is the way to say unlimited
            continue
        if not _is_number(v) or not v > 0:
            raise ValueError(f"[network] {name} must be > 0 bytes/s (leave it out for unlimited), not {v!r}")


def check_fault_peers(faults: list, peers: int, churn: dict) -> None:
    """Each fault's peers among the slots there will be: without churn arrivals the peers are the first
    `peers` slots, and a fault naming another failed only when it fired, after the simulation ran up to
    it (in a training run a crash or partition there did nothing, silently); no two pauses of one
    peer overlapping (`sim.faults.check_pause_windows`), and nothing of a peer after its crash for good
    (`sim.faults.check_after_crash`)."""
    parsed = [fault_from_dict(f) for f in faults]
    check_pause_windows(parsed)
    check_after_crash(parsed)
    for f, fault in zip(faults, parsed):
        named = [getattr(fault, "peer", None), *(i for side in getattr(fault, "sides", ()) for i in side)]
        bad = [i for i in named if i is not None and not (0 <= i < peers)]
        if bad and not churn.get("arrival_rate"):  # (churn with departures only adds no slots)
            raise ValueError(f"a {f.get('kind')} fault names peer {bad[0]}, but the scenario has peers 0..{peers - 1}")


_ENDPOINT = re.compile(r"sim://peer(0|[1-9][0-9]*)")


def check_network_peers(net: dict, peers: int, profiles: bool, hosts: bool, arrivals: bool) -> None:
    """What [network] says per peer, against the peers there are: a per-peer bandwidth keyed by anything
    but a peer's endpoint ("peer0" for "sim://peer0") was never looked up, and a bandwidth where every peer
    has a profile or a host's link was never used -- both ran unlimited (or at the profile's rates) without
    a word; a regions latency that places no region for a peer failed with a bare KeyError ('sim://peer1')
    at its first message."""
    bw = net.get("bandwidth")
    if isinstance(bw, dict):
        bad = [k for k in bw if not (isinstance(k, str) and _ENDPOINT.fullmatch(k))]
        if bad:
            raise ValueError(f"[network] bandwidth is per peer endpoint, e.g. {{\"sim://peer0\" = 1e6}}; {bad[0]!r} "
                             "names none")
    if bw is not None and (profiles or (hosts and not arrivals)):
        raise ValueError("[network] bandwidth is the rate of peers without a profile or a [[hosts]] link, and "
                         f"here every peer has one{' (profiles)' if profiles else ' ([[hosts]])'}: it would do "
                         "nothing; leave it out or give the rates there")
    lat = net.get("latency")
    if isinstance(lat, dict) and lat.get("dist") == "regions":
        region_of, matrix = lat["region_of"], lat["matrix"]
        if not isinstance(region_of, dict) or not isinstance(matrix, dict) or not all(
                isinstance(row, dict) for row in matrix.values()):
            raise ValueError("[network] latency {dist = \"regions\"} needs region_of = {endpoint = region} and "
                             "matrix = {region = {region = seconds}}")
        missing = [f"sim://peer{i}" for i in range(peers) if f"sim://peer{i}" not in region_of]
        if missing:
            raise ValueError(f"[network] latency region_of places no region for {missing[0]} (it needs every peer "
                             f"endpoint, sim://peer0..sim://peer{peers - 1})")
        regions = set(region_of.values())
        for a in sorted(map(str, regions)):
            row = matrix.get(a)
            gap = sorted(str(b) for b in regions if row is None or b not in row)
            if gap:
                raise ValueError(f"[network] latency matrix has no entry from region {a!r} to {gap[0]!r}")


def check_slow_faults(faults: list, network: dict, profiles: dict, hosts: list) -> None:
    """A `slow` fault divides its peer's link rates; a peer with no rate (no [[hosts]], no profiles, no
    [network] bandwidth for it: unlimited) has nothing to divide, and the fault did nothing, silently."""
    bw = network.get("bandwidth")
    for f in faults:
        if f.get("kind") != "slow" or hosts or profiles:
            continue
        peer = f.get("peer")
        limited = bw.get(f"sim://peer{peer}") is not None if isinstance(bw, dict) else bw is not None
        if not limited:
            raise ValueError(f"a slow fault on peer {peer} would do nothing: that peer's links have no bandwidth "
                             "limit to divide; give one ([network] bandwidth in bytes/s, profiles or [[hosts]])")


def check_profile_fractions(profiles: dict) -> None:
    """The `profiles` fractions: each >= 0, and not all 0 (peers draw a profile with these weights)."""
    for name, w in profiles.items():
        if not (_is_number(w) and 0 <= w < math.inf):
            raise ValueError(f"profiles: the fraction of {name} must be a number >= 0, not {w!r}")
    if profiles and not sum(profiles.values()) > 0:
        raise ValueError("profiles: the fractions must not all be 0")


def read_file(path: str | Path) -> dict:
    """A scenario, training scenario or sweep file as a dict: JSON if its name ends in .json (any
    case: a `.JSON` file was read as TOML and failed on its first brace), TOML otherwise."""
    path = Path(path)
    if path.suffix.lower() == ".json":
        return json.loads(path.read_text())
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]
    return tomllib.loads(path.read_text())


def json_ready(obj: Any) -> Any:
    """`obj` with every float that is not finite replaced by None (JSON's null), recursively through
    dicts, lists and tuples. A metric no peer was live to measure is NaN in the results; Python's
    `json` writes it as a bare ``NaN``, which is no JSON: jq, JavaScript, Go and most other readers
    refuse the whole file."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: json_ready(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_ready(v) for v in obj]
    return obj


def json_text(obj: Any, **kwargs: Any) -> str:
    """What the simulator's commands write as JSON: `json.dumps` of `json_ready(obj)`, refusing
    anything else that is no JSON (`allow_nan=False`)."""
    return json.dumps(json_ready(obj), allow_nan=False, **kwargs)


def load_scenario(path: str | Path) -> Scenario:
    return Scenario.from_dict(read_file(path))


@dataclass
class ScenarioResult:
    scenario: dict
    rounds: list[dict]
    peer_bytes: list[list[int]]  # per peer slot: [sent, received]
    trace: str
    delivered: int
    lost: int
    wall_seconds: list[float] = field(default_factory=list)  # per round; NOT part of to_json()
    # per peer slot: segments its downlink queue dropped over the run ([network] down_queue; else zeros)
    tail_drops: list[int] = field(default_factory=list)

    def to_json(self) -> str:
        data = {"scenario": self.scenario, "rounds": self.rounds, "peer_bytes": self.peer_bytes,
                "trace": self.trace, "delivered": self.delivered, "lost": self.lost, "tail_drops": self.tail_drops}
        return json_text(data, sort_keys=True, indent=1)

    def to_csv(self) -> str:
        cols = ["round", "t_start", "sim_seconds", "live", "participants", "succeeded", "mse", "max_abs", "spread",
                "groups", "bytes_sent_mean", "bytes_sent_max", "bytes_received_mean", "failures"]
        out = io.StringIO()
        w = csv.writer(out, lineterminator="\n")
        w.writerow(cols)
        for r in self.rounds:
            w.writerow([json.dumps(r[c], sort_keys=True) if isinstance(r[c], (dict, list)) else r[c] for c in cols])
        return out.getvalue()


def _check_full_placement(peers: int, grid: tuple[int, ...]) -> None:
    """placement = "full" puts peer i in the i-th cell in grid order. With fewer peers than cells a peer
    can be the only one in its line of some dimension: it then finds no group in every round along that
    dimension (a 4-peer scenario on the default 4 x 4 grid failed every other round, all four peers,
    after waiting out the matchmaking window). Refused, naming a grid that fits."""
    cells = list(np.ndindex(*grid))[:peers]
    for d in range(len(grid)):
        lines = Counter(c[:d] + c[d + 1:] for c in cells)
        alone = sum(1 for n in lines.values() if n == 1)
        if alone:
            raise ValueError(
                f"placement = \"full\" puts {peers} peers in the first {peers} of the {int(np.prod(grid))} cells of "
                f"grid = {list(grid)}: {alone} of them would be alone along dimension {d} and find no group in "
                f"every round along it; give a grid with as many cells as peers (e.g. grid = {_fitting_grid(peers)}), "
                "grid = [] (one group key) or placement = \"distinct\"")


def _fitting_grid(peers: int) -> list[int]:
    """The most square two-dimensional grid of exactly `peers` cells (one dimension if `peers` is prime)."""
    a = int(math.isqrt(peers))
    while a > 1 and peers % a:
        a -= 1
    return [peers] if a <= 1 else [peers // a, a]


def place_peers(grid: MoshpitGrid, count: int, placement: str, rng: np.random.Generator) -> list[tuple]:
    """Grid coordinates of the first `count` peers: ``full`` fills cells in order, ``distinct`` takes
    distinct random cells, anything else draws each peer's cell independently (cells may repeat).
    Shared by the simulator and the testbed, so one scenario places its peers alike in both."""
    if not grid.ndim:
        return [()] * count
    cells = list(np.ndindex(*grid.shape))
    if placement == "full":
        return [tuple(int(x) for x in c) for c in cells[:count]]
    if placement == "distinct":
        pick = rng.permutation(len(cells))[:count]
        return [tuple(int(x) for x in cells[i]) for i in pick]
    return [grid.random_coords(rng) for _ in range(count)]


class ScenarioRun(SimFaultContext):
    def __init__(self, sc: Scenario) -> None:
        self.sc = sc
        # emulated hosts are real TCP links: that is what they predict; abstract peers keep FIFO links
        transfer = "tcp" if sc.hosts else "fifo"
        self.network = NetworkModel(**{"latency": 0.005, "transfer": transfer, **sc.network})
        self.cluster = SimCluster(seed=sc.seed, network=self.network, encode=sc.encode, membership=sc.membership,
                                  cpu=CpuSpec.from_value(sc.cpu))
        self.env = self.cluster.env
        self.grid = MoshpitGrid(tuple(sc.grid))
        self.initial_count = sc.peers
        # per slot its peer, or once that crashed, its `Departed` (the slot's index, endpoint and byte
        # counts stay in the results; the dead peer's node and averager need not)
        self.slots: list[SimPeer | Departed] = []
        faults = [fault_from_dict(f) for f in sc.faults]
        # what a rejoin takes from the slot's last process (grid cell, tensors), kept only for the
        # slots a crash_rejoin fault names: slot -> (coords, tensors)
        self._rejoins = {f.peer for f in faults if isinstance(f, CrashRejoin)}
        self._kept: dict[int, tuple] = {}
        self._values_rng = self.rng("values")
        self._place_rng = self.rng("placement")
        self._profile_rng = self.rng("profiles")
        self._unavail_rng = self.rng("unavailability")
        self._bootstrapped = False
        self.walls: list[float] = []
        self._coords = self._placement()
        self._hosts = sc.host_list()
        for i in range(sc.peers):
            self._add(i, self._coords[i])
        initial = np.stack([p.tensors[0] for p in self.slots])
        self.truth = initial.astype(np.float64).mean(axis=0)
        for fault in faults:
            fault.install(self)
        if sc.churn:
            Churn(**sc.churn).install(self)

    # ---------------------------------------------------------------- FaultContext (rng, at, peer, endpoint: SimFaultContext)
    def crash(self, index: int) -> None:
        peer = self.peer(index)
        peer.crash()
        if isinstance(peer, SimPeer):
            if index in self._rejoins:
                self._kept[index] = (peer.node.coords, peer.tensors)
            gone = self.cluster.peers.get(peer.endpoint)
            if isinstance(gone, Departed) and gone.peer_id == peer.peer_id:
                self.slots[index] = gone

    def rejoin(self, index: int) -> None:
        old = self.slots[index]
        if old.alive:
            return
        coords, tensors = self._kept.pop(index) if index in self._kept else (old.node.coords, old.tensors)
        self._add(index, coords, tensors=tensors, replace=True)

    def arrive(self) -> None:
        idx = len(self.slots)
        coords = self.grid.random_coords(self._place_rng) if self.grid.ndim else ()
        self._add(idx, coords)
        if self.departure_rate > 0:
            self.schedule_departure(idx, self.env.now)

    def schedule_departure(self, index: int, now: float) -> None:
        t = now + float(self.rng(f"leave-{index}").exponential(1.0 / self.departure_rate))
        if t < self.departure_until:
            self.at(t, lambda: self.crash(index))

    # ---------------------------------------------------------------- setup
    def _placement(self) -> list[tuple]:
        return place_peers(self.grid, self.sc.peers, self.sc.placement, self._place_rng)

    def _config(self, coords: tuple, index: int | None = None) -> NodeConfig:
        sc = self.sc
        kw = {**_FAST_PROTOCOL, "prefix": "scenario", "grid": tuple(sc.grid), **sc.protocol}
        if sc.grid:
            kw.setdefault("target_group_size", max(sc.grid))
        kw["grid_coords"] = tuple(coords) if sc.grid else None
        if index is not None and index < len(self._hosts) and self._hosts[index].hint is not None:
            hint = self._hosts[index].hint
            kw["bandwidth"] = hint if hint == "auto" else float(hint)
        return NodeConfig(**kw)

    def _add(self, index: int, coords: tuple, tensors: list | None = None, replace: bool = False) -> SimPeer:
        sc = self.sc
        if tensors is None:
            tensors = [self._values_rng.standard_normal(sc.numel).astype(sc.dtype)]
        ep = self.endpoint(index)
        if index < len(self._hosts):
            self.network.profiles[ep] = self._hosts[index].profile(f"host{index}")
        elif sc.profiles:
            names = sorted(sc.profiles)
            w = np.array([sc.profiles[n] for n in names], dtype=float)
            name = names[int(self._profile_rng.choice(len(names), p=w / w.sum()))]
            self.network.profiles[ep] = PROFILES[name]
        live = [p for p in self.slots if p.alive]
        if sc.membership == "static":
            peer = self.cluster.add_peer(self._config(coords, index), tensors=tensors, endpoint=ep,
                                         compression=sc.compression, error_feedback=sc.error_feedback)
        else:
            boot = [live[0].endpoint] if live else []
            peer = self.cluster.add_peer(self._config(coords, index), tensors=tensors, initial_peers=boot,
                                         endpoint=ep, compression=sc.compression, error_feedback=sc.error_feedback)
        if replace:
            self.slots[index] = peer
        else:
            self.slots.append(peer)
        return peer

    # ---------------------------------------------------------------- run
    def run(self, progress: Callable[[int, int], None] | None = None) -> ScenarioResult:
        """All the scenario's rounds, then `close`."""
        sc = self.sc
        try:
            rounds = self.run_rounds(0, progress)
            warn_unfired(sc.faults, self.env.now)
            peer_bytes = [[int(self.network.sent_bytes.get(p.endpoint, 0)),
                           int(self.network.received_bytes.get(p.endpoint, 0))] for p in self.slots]
            tcp = self.cluster.tcp
            drops = [int(tcp.tail_drops.get(p.endpoint, 0)) if tcp is not None else 0 for p in self.slots]
            return ScenarioResult(sc.to_dict(), rounds, peer_bytes, self.cluster.trace_hash, self.cluster.delivered,
                                  self.cluster.lost, self.walls, drops)
        finally:
            self.close()

    def close(self) -> None:
        """Done with this run (`run` does it; callers of `run_rounds` should): its simulated threads end,
        so nothing keeps its peers in memory (`sim.driver.SimCluster.close`)."""
        self.cluster.close()

    def run_rounds(self, start: int = 0, progress: Callable[[int, int], None] | None = None) -> list[dict]:
        """Run rounds ``start .. start + sc.rounds - 1`` (bootstrapping first if nothing ran yet)."""
        sc = self.sc
        rounds: list[dict] = []
        unavail_rng = self._unavail_rng
        limit = sc.step_timeout + self._config(()).allreduce_timeout + 1.0
        if not self._bootstrapped:
            self._bootstrapped = True
            if sc.bootstrap_time > 0:
                self.cluster.run(until=self.env.now + sc.bootstrap_time)
        for r in range(start, start + sc.rounds):
            with gc_frozen():  # the round's bookkeeping too, not only its events (see gc_frozen)
                self._run_round(r, rounds, limit, unavail_rng)
            if sc.round_gap:
                self.cluster.run(until=self.env.now + sc.round_gap)
            if progress:
                progress(r + 1 - start, sc.rounds)
        return rounds

    def _run_round(self, r: int, rounds: list[dict], limit: float, unavail_rng: np.random.Generator) -> None:
        """One round: every live, available peer steps; its metrics go to `rounds`, its wall time to `walls`."""
        sc = self.sc
        walls = self.walls
        w0 = time.perf_counter()
        t0 = self.env.now
        draws = unavail_rng.random(len(self.slots))  # one draw per slot, alive or not: streams stay aligned
        live = [i for i, p in enumerate(self.slots) if p.alive]
        steppers = [i for i in live if draws[i] >= sc.unavailability and not self.slots[i].paused]
        sent0 = dict(self.network.sent_bytes)
        recv0 = dict(self.network.received_bytes)
        if sc.step_ahead:  # scheduled steps: called now, the all-reduce begins (and is timed) from t0
            t0 = self.env.now + sc.step_ahead
            evs = {i: self.slots[i].step_tensors(timeout=sc.step_timeout, round=r, scheduled_time=t0)
                   for i in steppers}
        else:
            evs = {i: self.slots[i].step_tensors(timeout=sc.step_timeout, round=r) for i in steppers}
        ends: dict[int, float] = {}
        for i, ev in evs.items():
            ev.callbacks.append(lambda _e, i=i: ends.__setitem__(i, self.env.now))
        if evs:
            self.cluster.run(until=self.env.any_of([self.env.all_of(list(evs.values())),
                                                    self.env.timeout(limit + sc.step_ahead)]))
        rounds.append(self._metrics(r, t0, steppers, evs, sent0, recv0))
        # per-peer step durations (slot, seconds), as the testbed reports them
        rounds[-1]["step_seconds"] = [[i, max(0.0, ends[i] - t0)] for i in sorted(ends)]
        # and of the successful ones, (slot, matchmaking, all-reduce) seconds, as the testbed reports them
        rounds[-1]["phase_seconds"] = [[i, ev.value.result.timings.get("matchmaking", 0.0),
                                        ev.value.result.timings.get("allreduce", 0.0)]
                                       for i, ev in sorted(evs.items()) if ev.triggered and isinstance(ev.value, StepDone)]
        walls.append(time.perf_counter() - w0)

    def _metrics(self, r: int, t0: float, steppers: list[int], evs: dict, sent0: dict, recv0: dict) -> dict:
        live = [p for p in self.slots if p.alive]
        outcomes: list[tuple] = []
        for i, ev in evs.items():
            if not ev.triggered:
                outcomes.append(("unfinished",))
            elif isinstance(ev.value, StepDone):
                outcomes.append(("done", ev.value.result.group_id, len(ev.value.result.members)))
            elif isinstance(ev.value, StepFailed):
                outcomes.append(("failed", type(ev.value.error).__name__))
        sent = [self.network.sent_bytes.get(self.slots[i].endpoint, 0) - sent0.get(self.slots[i].endpoint, 0)
                for i in steppers]
        recv = [self.network.received_bytes.get(self.slots[i].endpoint, 0) - recv0.get(self.slots[i].endpoint, 0)
                for i in steppers]
        return round_metrics(r, t0, max(0.0, self.env.now - t0), [p.tensors[0] for p in live], self.truth, self.sc.numel,
                             len(steppers), outcomes, sent, recv)


def round_metrics(r: int, t0: float, seconds: float, live_tensors: list[np.ndarray], truth: np.ndarray, numel: int,
                  participants: int, outcomes: list[tuple], sent: list[int], recv: list[int]) -> dict:
    """One round's metrics, shared by the simulator and the testbed (`sim.testbed`) so both report the same.

    ``live_tensors``: the tensor of every live peer after the round; ``truth``: the mean of the initial peers' values;
    ``outcomes``: one per stepping peer, ``("done", group_id, group_size)``, ``("failed", error_type_name)``
    or ``("unfinished",)``; ``sent``/``recv``: bytes per stepping peer during the round."""
    xs = np.stack(live_tensors) if live_tensors else np.zeros((0, numel))
    err = xs - truth
    groups: dict[str, int] = {}
    failures: Counter = Counter()
    succeeded = 0
    for o in outcomes:
        if o[0] == "done":
            succeeded += 1
            groups[o[1]] = o[2]
        else:
            failures["unfinished" if o[0] == "unfinished" else o[1]] += 1
    sizes = Counter(groups.values())
    live = len(live_tensors)
    return {
        "round": r,
        "t_start": t0,
        "sim_seconds": seconds,
        "live": live,
        "participants": participants,
        "succeeded": succeeded,
        "failures": dict(sorted(failures.items())),
        "groups": {str(k): v for k, v in sorted(sizes.items())},
        "mse": float((err ** 2).mean()) if live else math.nan,
        "max_abs": float(np.abs(err).max()) if live else math.nan,
        "spread": float(((xs - xs.mean(axis=0)) ** 2).mean()) if live else math.nan,
        "bytes_sent_mean": float(np.mean(sent)) if sent else 0.0,
        "bytes_sent_max": int(max(sent, default=0)),
        "bytes_received_mean": float(np.mean(recv)) if recv else 0.0,
    }


def run_scenario(sc: Scenario | dict, progress: Callable[[int, int], None] | None = None) -> ScenarioResult:
    if isinstance(sc, dict):
        sc = Scenario.from_dict(sc)
    return ScenarioRun(sc).run(progress)
