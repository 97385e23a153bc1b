"""Tensor layouts as short text, and how two layouts differ, in words.

Peers only average with peers whose tensors have the same count, shapes and dtypes
(matchmaking groups equal layout fingerprints). When a rendezvous peer sees joiners of one
key with different layouts, it tells every peer involved *what* differs, so each JOIN carries
a compact description of its layout: ``"2|f4[64,3]*3;f8[]"`` -- the tensor count, then each
tensor as dtype code (``bf16`` for bfloat16) and shape (and ``@codec`` when it travels compressed otherwise than its dtype's
default, `zgossip.codecs`), with ``*N`` for N equal tensors in a row. Descriptions longer
than `MAX_CHARS` are cut at a tensor boundary (``;...``): a difference past the cut is then
reported as such. Pure functions of strings; nothing here trusts the text it parses (it
comes from peers): a malformed description yields None, never an exception.
"""
from __future__ import annotations

import math
from typing import Sequence

__all__ = ["MAX_CHARS", "describe", "parse", "difference"]

MAX_CHARS = 2000  # a JOIN field; about 150 distinct tensors (repeats compress)

_NAMES = {"f2": "float16", "f4": "float32", "f8": "float64", "bf16": "bfloat16"}  # bf16: `tensors.BF16_DTYPE`
_CODES = {v: k for k, v in _NAMES.items()}


def _code(dtype: str) -> str:
    """'<f4' / 'float32' -> 'f4' (other dtypes keep a short name of their own)."""
    d = dtype.lstrip("<>=|")
    return _CODES.get(d, d)[:8]


def describe(shapes: Sequence[Sequence[int]], dtypes: Sequence[str], max_chars: int = MAX_CHARS,
             codecs: Sequence[str] | None = None) -> str:
    """`codecs`: per tensor, the name of its wire codec, or "" for its dtype's default."""
    items: list[str] = []
    for k, (shape, dtype) in enumerate(zip(shapes, dtypes)):
        codec = f"@{codecs[k]}" if codecs and codecs[k] else ""
        items.append(f"{_code(dtype)}[{','.join(str(int(x)) for x in shape)}]{codec}")
    runs: list[str] = []
    i = 0
    while i < len(items):
        j = i
        while j + 1 < len(items) and items[j + 1] == items[i]:
            j += 1
        runs.append(items[i] + (f"*{j - i + 1}" if j > i else ""))
        i = j + 1
    head = f"{len(items)}|"
    out = head + ";".join(runs)
    if len(out) <= max_chars:
        return out
    kept = head
    for r in runs:
        if len(kept) + len(r) + 5 > max_chars:
            break
        kept += r + ";"
    return kept + "..."


def parse(text: str) -> tuple[int, list[tuple[str, tuple[int, ...], str]], bool] | None:
    """(tensor count, [(dtype code, shape, codec or "")] as far as described, whether the list was cut), or None."""
    try:
        count_s, _, body = text.partition("|")
        count = int(count_s)
        if count < 0 or count > 1 << 24:
            return None
        cut = body.endswith("...")
        if cut:
            body = body[:-3]
        out: list[tuple[str, tuple[int, ...], str]] = []
        for run in filter(None, body.split(";")):
            item, star, n_s = run.partition("*")
            n = int(n_s) if star else 1
            item, _, codec = item.partition("@")
            code, _, rest = item.partition("[")
            if not rest.endswith("]") or n < 1 or len(out) + n > count:
                return None
            dims = rest[:-1]
            shape = tuple(int(x) for x in dims.split(",")) if dims else ()
            out.extend([(code, shape, codec[:16])] * n)
        if not cut and len(out) != count:
            return None
        return count, out, cut
    except (ValueError, TypeError, AttributeError):
        return None


def _fmt(code: str, shape: tuple[int, ...], codec: str = "", with_codec: bool = False) -> str:
    text = f"{_NAMES.get(code, code)} {shape}" if len(shape) != 1 else f"{_NAMES.get(code, code)} ({shape[0]},)"
    return text + (f" as {codec or 'default'}" if with_codec else "")


def difference(mine: str, theirs: str, me: str = "yours", them: str = "theirs") -> str | None:
    """How layout `theirs` differs from `mine` in one line (None if the descriptions are equal).

    Names the tensor count, the first tensor whose shape or dtype differs (and how many do),
    and total element counts, e.g. ``"tensor 1: yours float32 (10,), theirs float32 (12,)"``.
    """
    if mine == theirs and not (isinstance(mine, str) and mine.endswith("...")):
        return None  # (equal cut descriptions may still differ past the cut: the caller knows they differ)
    a, b = parse(mine), parse(theirs)
    if a is None or b is None:
        return "the layouts differ (a description could not be read)"
    (na, la, cut_a), (nb, lb, cut_b) = a, b
    parts: list[str] = []
    if na != nb:
        parts.append(f"{me} {na} tensor{'s' * (na != 1)}, {them} {nb}")
    common = min(len(la), len(lb))
    diffs = [i for i in range(common) if la[i] != lb[i]]
    if diffs:
        i = diffs[0]
        what = []
        if la[i][1] != lb[i][1]:
            what.append("shape")
        if la[i][0] != lb[i][0]:
            what.append("dtype")
        if la[i][2] != lb[i][2]:
            what.append("compression")
        more = f" ({len(diffs) - 1} more tensor{'s' * (len(diffs) != 2)} differ)" if len(diffs) > 1 else ""
        wc = la[i][2] != lb[i][2]
        parts.append(f"tensor {i} {' and '.join(what)}: {me} {_fmt(*la[i], with_codec=wc)}, "
                     f"{them} {_fmt(*lb[i], with_codec=wc)}{more}")
    if not parts and (cut_a or cut_b):
        parts.append(f"a tensor after the first {common} differs (the descriptions stop there)")
    if not cut_a and not cut_b:
        ea = sum(math.prod(s) for _, s, _ in la)
        eb = sum(math.prod(s) for _, s, _ in lb)
        if ea != eb:
            parts.append(f"{me} {ea:,} elements, {them} {eb:,}")
    return "; ".join(parts) or "the layouts differ"
