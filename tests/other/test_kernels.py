"""The checked reductions: the C kernels and the numpy fallback give the same bits and verdicts."""
from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zgossip import kernels


@pytest.fixture
def numpy_only(monkeypatch):
    monkeypatch.setattr(kernels, "_native", None)


def _copy(a):
    if isinstance(a, np.ndarray):
        return a.copy()
    if isinstance(a, list) and a and isinstance(a[0], np.ndarray):
        return [x.copy() for x in a]
    return a


def _both(fn, *args):
    """fn on fresh copies of args, with the C kernels (when built) and with numpy: [(result, copies)]."""
    saved = kernels._native
    outs = []
    for native in (saved, None):
        kernels._native = native
        try:
            copies = [_copy(a) for a in args]
            outs.append((fn(*copies), copies))
        finally:
            kernels._native = saved
    return outs


def test_native_kernels_are_built():
    # where a C compiler exists, `pip install` must have built the fast path (the numpy fallback,
    # used without one, is what the other tests compare it with)
    if not (shutil.which("cc") or shutil.which("gcc")) or os.environ.get("ZGOSSIP_NATIVE") == "0":
        pytest.skip("no C compiler here, or numpy forced: zgossip runs on numpy")
    assert kernels.NATIVE


def _mean(terms, weights, out, chunk=1):
    """The owner's loop: accumulate the terms in order, `chunk` at a time, the weight sum with the
    last; returns (index of the first term of the failing call, verdict) or (None, (-1, 0))."""
    wsum = 0.0
    for i in range(0, len(terms), chunk):
        ts, ws = terms[i:i + chunk], weights[i:i + chunk]
        wsum += sum(ws)
        last = i + chunk >= len(terms)
        verdict = kernels.accumulate(out, ts, ws, first=i == 0, divisor=wsum if last else 0.0)
        if verdict != (-1, 0):
            return i, verdict
    return None, (-1, 0)


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 40000),
    k=st.integers(1, 6),
    dtype=st.sampled_from([np.float32, np.float64]),
    seed=st.integers(0, 2**32 - 1),
    unit=st.booleans(),
    chunk=st.integers(1, 6),
)
def test_accumulate_same_bits_both_paths(n, k, dtype, seed, unit, chunk):
    rng = np.random.default_rng(seed)
    terms = [(rng.standard_normal(n) * 10.0 ** rng.integers(-3, 4)).astype(dtype) for _ in range(k)]
    weights = [1.0] * k if unit else [float(w) for w in rng.uniform(0.01, 5.0, k)]
    (r1, (_, _, o1, _)), (r2, (_, _, o2, _)) = _both(_mean, terms, weights, np.empty(n, dtype), chunk)
    assert r1 == r2 == (None, (-1, 0))
    assert o1.tobytes() == o2.tobytes()
    want = sum(w * t.astype(np.float64) for w, t in zip(weights, terms)) / sum(weights)
    scale = max(float(np.abs(t).max()) for t in terms)  # float32 sums lose digits relative to the largest term
    eps = 1e-6 if dtype == np.float32 else 1e-14
    np.testing.assert_allclose(o1, want, rtol=0, atol=eps * k * scale * max(weights) / sum(weights) * 4)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("where", [0, 16383, 16384, 50000])
@pytest.mark.parametrize("chunk", [1, 3])
def test_accumulate_reports_the_block_of_the_first_bad_value(dtype, bad, where, chunk):
    rng = np.random.default_rng(1)
    terms = [rng.standard_normal(60000).astype(dtype) for _ in range(3)]
    terms[1][where] = bad
    terms[1][59999] = bad  # a later bad value does not matter: the first one is reported
    terms[2][59999] = bad  # nor a bad value of a later term in a later block
    for (i, verdict), _ in _both(_mean, terms, [1.0, 2.0, 0.5], np.empty(60000, dtype), chunk):
        assert i + verdict[0] == 1
        assert verdict[1] == where - where % kernels.ACC_BLOCK


def test_accumulate_reports_the_first_bad_block_across_terms():
    terms = [np.ones(40000, np.float32) for _ in range(3)]
    terms[0][39000] = np.nan
    terms[2][100] = np.inf  # an earlier block wins over an earlier term
    for verdict, _ in _both(kernels.accumulate, np.empty(40000, np.float32), terms, [1.0] * 3, True, 3.0):
        assert verdict == (2, 0)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_accumulate_reports_overflow_with_the_division(dtype):
    big = np.finfo(dtype).max
    terms = [np.full(3000, big, dtype), np.full(3000, big, dtype)]
    terms[0][:10] = 1.0  # finite terms, but most of their sum is not
    for chunk in (1, 2):
        for (i, verdict), _ in _both(_mean, terms, [1.0, 1.0], np.empty(3000, dtype), chunk):
            assert i == (1 if chunk == 1 else 0) and verdict == (kernels.OVERFLOW, 0)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_overflow_is_reported_at_its_sub_block_and_nothing_from_there_is_stored(dtype):
    big = np.finfo(dtype).max
    n = 3 * kernels.ACC_BLOCK
    at = kernels.ACC_BLOCK + 3 * kernels.SUB_BLOCK + 7  # in the second block's fourth sub-block
    terms = [np.ones(n, dtype), np.ones(n, dtype)]
    terms[0][at:] = big
    terms[1][at:] = big
    cut = at - at % kernels.SUB_BLOCK
    for verdict, (out, _, _, _, _) in _both(kernels.accumulate, np.zeros(n, dtype), terms, [1.0, 1.0], True, 2.0):
        assert verdict == (kernels.OVERFLOW, cut)
        assert (out[:cut] == 1.0).all() and not out[cut:].any()  # stored up to the cut, untouched after


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_bad_term_stops_the_pass_at_its_block_with_the_blocks_before_stored(dtype):
    n = 3 * kernels.ACC_BLOCK + 5
    rng = np.random.default_rng(4)
    terms = [rng.standard_normal(n).astype(dtype) for _ in range(3)]
    terms[2][2 * kernels.ACC_BLOCK + 1] = np.nan
    src = rng.standard_normal(n).astype(dtype)
    results = _both(kernels.accumulate, np.zeros(n, dtype), terms, [1.0, 0.5, 2.0], False, 3.5, src)
    (v1, (o1, *_)), (v2, (o2, *_)) = results
    assert v1 == v2 == (2, 2 * kernels.ACC_BLOCK)
    assert o1.tobytes() == o2.tobytes()
    cut = 2 * kernels.ACC_BLOCK
    want = (src[:cut] + terms[0][:cut] + terms[1][:cut] * dtype(0.5) + terms[2][:cut] * dtype(2.0)) / dtype(3.5)
    assert o1[:cut].tobytes() == want.astype(dtype).tobytes() and not o1[cut:].any()


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 40000), k=st.integers(1, 5), alias=st.integers(0, 4), first=st.booleans(),
       dtype=st.sampled_from([np.float32, np.float64]), seed=st.integers(0, 2**32 - 1))
def test_accumulate_from_src_into_one_of_its_terms(n, k, alias, first, dtype, seed):
    """The owner's last pass: partial sum in `src`, result stored over one of the terms (its own
    data): same bits as summing into a fresh array, on both paths."""
    rng = np.random.default_rng(seed)
    terms = [rng.standard_normal(n).astype(dtype) for _ in range(k)]
    weights = [float(w) for w in rng.uniform(0.1, 3.0, k)]
    src = rng.standard_normal(n).astype(dtype)
    alias %= k
    ref = src.copy()
    assert kernels.accumulate(ref, terms, weights, first, 2.5) == (-1, 0)  # the in-place form
    for native in ([kernels._native, None] if kernels.NATIVE else [None]):
        saved, kernels._native = kernels._native, native
        try:
            ts = [t.copy() for t in terms]
            s = src.copy()
            assert kernels.accumulate(ts[alias], ts, weights, first, 2.5, src=s) == (-1, 0)
        finally:
            kernels._native = saved
        assert ts[alias].tobytes() == ref.tobytes()
        assert s.tobytes() == src.tobytes()  # src is only read


def test_finish_mean_divides_and_checks():
    a = np.array([2.0, 4.0])
    assert kernels.finish_mean(a, 2.0) and a.tolist() == [1.0, 2.0]
    b = np.array([np.finfo(np.float64).max, 1.0])
    assert not kernels.finish_mean(b, 0.5)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("where", [None, 0, 5, 1023, 1024, 3000, 4999])
def test_copy_finite_stops_before_the_first_bad_block(dtype, where):
    rng = np.random.default_rng(2)
    src = rng.standard_normal(5000).astype(dtype)
    if where is not None:
        src[where] = np.nan
    want = 5000 if where is None else where - where % kernels.BLOCK
    for done, (dst, _) in _both(kernels.copy_finite, np.zeros(5000, dtype), src):
        assert done == want
        assert dst[:done].tobytes() == src[:done].tobytes()
        assert not dst[done:].any()  # untouched


def test_all_finite(numpy_only):
    a = np.ones(10, np.float32)
    assert kernels.all_finite(a)
    a[3] = np.inf
    assert not kernels.all_finite(a)
    huge = np.full(4, 3e38, np.float32)  # squares overflow, values do not
    assert kernels.all_finite(huge)


def test_native_all_finite():
    if not kernels.NATIVE:
        pytest.skip("C kernels not built")
    a = np.ones(100_001, np.float64)
    assert kernels.all_finite(a)
    a[100_000] = -np.inf
    assert not kernels.all_finite(a)


@pytest.mark.parametrize("stream", [True, False])
def test_native_copy_finite_with_and_without_non_temporal_stores(stream):
    """Non-temporal stores are a switch (`ZGOSSIP_STREAM_STORES`): either way the same bytes land,
    up to the same first bad block, at any alignment of the destination."""
    if not kernels.NATIVE:
        pytest.skip("C kernels not built")
    rng = np.random.default_rng(5)
    src = rng.standard_normal(70_001).astype(np.float32)
    src[50_000] = np.nan
    for shift in (0, 1, 3):
        dst = np.zeros(70_001 + shift, np.float32)[shift:]
        done = kernels._native.copy_finite(dst, src, 4, stream)
        assert done == 50_000 - 50_000 % kernels.BLOCK
        assert dst[:done].tobytes() == src[:done].tobytes() and not dst[done:].any()


def test_isa_names_what_the_loader_picked():
    assert kernels.ISA in (None, "avx512f", "avx2", "default", "baseline")
    assert (kernels.ISA is None) == (not kernels.NATIVE)


def test_stream_stores_auto_follows_the_size_of_the_buffer_a_destination_lies_in(monkeypatch):
    """"auto": non-temporal stores for destinations inside a buffer larger than the last-level
    cache (cold lines), plain stores otherwise and where the cache size is unknown."""
    monkeypatch.setattr(kernels, "STREAM_STORES", "auto")
    monkeypatch.setattr(kernels, "LLC_BYTES", 1 << 20)
    big = np.zeros(1 << 19, np.float32)  # 2 MiB
    assert kernels._stream(big[:1024]) and kernels._stream(big)
    assert not kernels._stream(np.zeros(1024, np.float32)[:10])
    monkeypatch.setattr(kernels, "LLC_BYTES", None)
    assert not kernels._stream(big)
    monkeypatch.setattr(kernels, "STREAM_STORES", "on")
    assert kernels._stream(np.zeros(4, np.float32))


@pytest.mark.parametrize("dtype, divisor", [(np.float32, 1e-50), (np.float32, 1e40)])
def test_a_divisor_the_element_type_cannot_hold_is_refused_on_both_paths(dtype, divisor):
    # the C path took a divisor that rounds to 0 as "no division" (storing the undivided sum) while
    # numpy divided by it (inf, reported as overflow): the same call gave different bits
    saved = kernels._native
    try:
        for mode in (saved, None):
            kernels._native = mode
            out = np.ones(8, dtype)
            with pytest.raises(ValueError, match="divisor"):
                kernels.accumulate(out, [np.ones(8, dtype)], [1e-50], True, divisor)
            assert np.all(out == 1)
    finally:
        kernels._native = saved
