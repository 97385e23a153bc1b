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


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 40000),
    k=st.integers(1, 6),
    dtype=st.sampled_from([np.float32, np.float64]),
    seed=st.integers(0, 2**32 - 1),
    unit=st.booleans(),
)
def test_weighted_mean_same_bits_both_paths(n, k, dtype, seed, unit):
    rng = np.random.default_rng(seed)
    terms = [(rng.standard_normal(n) * 10.0 ** rng.integers(-3, 4)).astype(dtype) for _ in range(k)]
    weights = [1.0] * k if unit else list(rng.uniform(0.01, 5.0, k))
    (r1, (o1, _, _)), (r2, (o2, _, _)) = _both(kernels.weighted_mean, np.empty(n, dtype), terms, weights)
    assert r1 == r2 == -1
    assert o1.tobytes() == o2.tobytes()
    want = sum(w * t.astype(np.float64) for w, t in zip(weights, terms)) / sum(weights)
    np.testing.assert_allclose(o1, want, rtol=1e-5 if dtype == np.float32 else 1e-12, atol=1e-5)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("where", [0, 1023, 1024, 16383, 16384, 50000])
def test_weighted_mean_names_the_first_bad_term(dtype, bad, where):
    rng = np.random.default_rng(1)
    terms = [rng.standard_normal(60000).astype(dtype) for _ in range(4)]
    terms[2][where] = bad
    terms[3][7] = bad  # a later term is bad too: the first one in order is reported
    for r, _ in _both(kernels.weighted_mean, np.empty(60000, dtype), terms, [1.0, 2.0, 0.5, 1.0]):
        assert r == 2


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_weighted_mean_reports_overflow(dtype):
    big = np.finfo(dtype).max
    terms = [np.full(3000, big, dtype), np.full(3000, big, dtype)]
    terms[0][:10] = 1.0  # finite terms, but most of their sum is not
    for r, _ in _both(kernels.weighted_mean, np.empty(3000, dtype), terms, [1.0, 1.0]):
        assert r == kernels.OVERFLOW
    terms[1][2999] = np.nan  # a bad term anywhere is named, even past the first overflow
    for r, _ in _both(kernels.weighted_mean, np.empty(3000, dtype), terms, [1.0, 1.0]):
        assert r == 1


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
