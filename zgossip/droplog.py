"""One log line per source and kind of refused input; everything else is only counted.

A hostile or broken peer can send the same bad message thousands of times (NaN in every part, a
wrong shape, results for spans it does not own...). Each refusal is counted in the node's
`stats`; logging each would let that peer fill the receiver's log. `DropLog` logs the first
refusal of each kind from each source (with the source, so an operator knows whom to revoke)
and only counts the rest at DEBUG level. A source is what the message claims (often its sender
*at its endpoint*), so one peer can pose as many sources: at most `per_kind` sources are logged
for each kind, then one line says the rest of that kind is only counted. The other kinds keep
their own budgets, so a flood of one kind never silences another (a single cap over all kinds
once let one peer's 4,096 GROUPs with made-up endpoints silence every later refusal of the node).
Plain data, no clock: protocol code may hold one.
"""
from __future__ import annotations

import logging

__all__ = ["DropLog", "OncePer"]


class DropLog:
    """Remembers which (source, kind) pairs were logged; at most `cap` of them (then only DEBUG)."""

    def __init__(self, owner: str, cap: int = 4096, per_kind: int = 32) -> None:
        self.owner = owner
        self.cap = cap
        self.per_kind = per_kind
        self._seen: set[tuple[str, str]] = set()
        self._sources: dict[str, int] = {}  # kind -> sources logged for it (per_kind + 1: the rest announced)

    def note(self, logger: logging.Logger, source: str, kind: str, detail: str = "", counter: str = "dropped",
             level: int = logging.WARNING, text: str | None = None) -> bool:
        """Log a refusal of `kind` from `source` (a peer id, an endpoint, or a description) if it is
        the first of its kind from that source; True if this call logged it. `text` replaces the
        line's "dropped KIND from SOURCE: DETAIL" where that reads badly."""
        key = (source, kind)
        what = text if text is not None else f"{kind} from {source}{f': {detail}' if detail else ''}"
        if key in self._seen or len(self._seen) >= self.cap:
            logger.debug("%s: %s", self.owner, what)
            return False
        n = self._sources.get(kind, 0)
        if n >= self.per_kind:
            if n == self.per_kind:
                self._sources[kind] = n + 1
                logger.log(level, "%s: %s from more than %d sources: from now on only counted in stats[%r]",
                           self.owner, kind, self.per_kind, counter)
            logger.debug("%s: %s", self.owner, what)
            return False
        self._sources[kind] = n + 1
        self._seen.add(key)
        logger.log(level, "%s: %s%s (logged once per source and kind; later ones are only counted in stats[%r])",
                   self.owner, "" if text is not None else "dropped ", what, counter)
        return True

    def seen(self, source: str, kind: str) -> bool:
        return (source, kind) in self._seen


class OncePer:
    """Which (place, kind) pairs were logged, for log lines that are not refusals of a peer's input
    (our sends that fail, handshakes that fail): `first` is True once per pair, for at most
    `per_kind` places of each kind; then one line says the rest of that kind is only counted.
    Bounded however many places a peer makes us try (a GROUP may name 4,096 members)."""

    def __init__(self, logger: logging.Logger, owner: str, per_kind: int = 32) -> None:
        self.logger, self.owner, self.per_kind = logger, owner, per_kind
        self._seen: set[tuple[str, str]] = set()
        self._count: dict[str, int] = {}

    def first(self, where: str, kind: str, counter: str) -> bool:
        if (where, kind) in self._seen:
            return False
        n = self._count.get(kind, 0)
        if n >= self.per_kind:
            if n == self.per_kind:
                self._count[kind] = n + 1
                self.logger.warning("%s: %s: logged for %d different peers or endpoints; from now on only counted "
                                    "in stats[%r]", self.owner, kind, self.per_kind, counter)
            return False
        self._count[kind] = n + 1
        self._seen.add((where, kind))
        return True
