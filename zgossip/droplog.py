"""One log line per source and kind of refused input; everything else is only counted.

A hostile or broken peer can send the same bad message thousands of times (NaN in every part, a
wrong shape, results for spans it does not own...). Each refusal is counted in the node's
`stats`; logging each would let that peer fill the receiver's log. `DropLog` logs the first
refusal of each kind from each source (with the source, so an operator knows whom to revoke)
and only counts the rest at DEBUG level. Plain data, no clock: protocol code may hold one.
"""
from __future__ import annotations

import logging

__all__ = ["DropLog"]


class DropLog:
    """Remembers which (source, kind) pairs were logged; at most `cap` of them (then only DEBUG)."""

    def __init__(self, owner: str, cap: int = 4096) -> None:
        self.owner = owner
        self.cap = cap
        self._seen: set[tuple[str, str]] = set()

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
        self._seen.add(key)
        logger.log(level, "%s: %s%s (logged once per source and kind; later ones are only counted in stats[%r])",
                   self.owner, "" if text is not None else "dropped ", what, counter)
        return True

    def seen(self, source: str, kind: str) -> bool:
        return (source, kind) in self._seen
