"""Wire codecs on their own: the documented round-trip error bound of each (property-tested), what
they do with NaN/inf, and how a codec map splits a part into pieces."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from zgossip import codecs as C

LOSSY = [C.FP16, C.BF16, C.INT8]
_RANGE = {C.FP16: 65504.0, C.BF16: float(np.float32(3.3e38)), C.INT8: float(np.finfo(np.float32).max)}


def _round_trip(codec: int, x: np.ndarray) -> np.ndarray:
    enc = np.empty(C.encoded_nbytes(codec, x.size, x.itemsize), np.uint8)
    C.encode(codec, x, enc)
    y = np.empty_like(x)
    C.decode(codec, enc, y)
    return y


def _floats(limit: float):
    return hnp.arrays(np.float32, st.integers(1, 3000),
                      elements=st.floats(-limit, limit, allow_nan=False, allow_infinity=False, width=32))


@pytest.mark.parametrize("codec", LOSSY + [C.NONE])
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_round_trip_stays_within_the_documented_bound(codec, data):
    limit = _RANGE.get(codec, float(np.finfo(np.float32).max))
    x = data.draw(_floats(limit))
    y = _round_trip(codec, x)
    err = np.abs(y.astype(np.float64) - x.astype(np.float64))
    bound = C.error_bound(codec, x)
    assert (err <= bound).all(), (codec, float((err - bound).max()))


@pytest.mark.parametrize("codec", LOSSY)
@settings(max_examples=30, deadline=None)
@given(x=_floats(1e4), where=st.integers(0, 2999), bad=st.sampled_from([np.nan, np.inf, -np.inf]))
def test_nan_and_inf_never_become_finite(codec, x, where, bad):
    where %= x.size
    x = x.copy()
    x[where] = bad
    y = _round_trip(codec, x)
    assert not np.isfinite(y[where])  # the reducer's NaN/inf policy sees it
    if codec == C.INT8:  # the whole block decodes as NaN, no garbage; other blocks are untouched
        blk = where - where % C.INT8_BLOCK
        assert np.isnan(y[blk:blk + C.INT8_BLOCK]).all()
        rest = np.ones(x.size, bool)
        rest[blk:blk + C.INT8_BLOCK] = False
        assert np.isfinite(y[rest]).all()
    else:
        assert np.isfinite(np.delete(y, where)).all()


def test_out_of_range_values_become_inf_not_garbage():
    assert np.isinf(_round_trip(C.FP16, np.array([7e4, -1e5, 1.0], np.float32))[:2]).all()
    assert np.isinf(_round_trip(C.BF16, np.array([3.4e38], np.float32))).all()
    y = _round_trip(C.BF16, np.array([np.float32(np.nan)], np.float32).view(np.uint32).__or__(1).view(np.float32))
    assert np.isnan(y).all()  # a NaN with only low mantissa bits stays NaN (rounding must not make it inf)


@pytest.mark.parametrize("native", [True, False])
@settings(max_examples=40, deadline=None)
@given(x=_floats(float(np.float32(4e-37))))
def test_int8_keeps_its_bound_on_blocks_of_tiny_values(native, x):
    """A block whose max|x| is under ~3.7e-37 has a subnormal scale with no finite float32 inverse:
    multiplying by that inverse (inf) turned every nonzero value into +-127 steps (1e-41 beside
    3e-40 came back as 3e-40), on both paths."""
    from zgossip import kernels

    if native and not kernels.NATIVE:
        pytest.skip("C extension not built")
    saved = kernels._native
    if not native:
        kernels._native = None
    try:
        y = _round_trip(C.INT8, x)
    finally:
        kernels._native = saved
    err = np.abs(y.astype(np.float64) - x.astype(np.float64))
    assert (err <= C.error_bound(C.INT8, x)).all()
    y = _round_trip(C.INT8, np.array([1e-40, 0.0, -3e-40, 1e-41], np.float32))
    assert np.abs(y[3]) < 1e-40 and y[1] == 0


def test_the_bounds_are_tight():
    """Not vacuous: some value of a typical tensor loses close to the whole bound."""
    x = np.random.default_rng(0).standard_normal(1 << 14).astype(np.float32)
    for codec in LOSSY:
        ratio = np.abs(_round_trip(codec, x).astype(np.float64) - x) / C.error_bound(codec, x)
        assert 0.9 < ratio.max() <= 1.0, (codec, ratio.max())


def test_encoded_sizes():
    assert C.encoded_nbytes(C.NONE, 10) == 40
    assert C.encoded_nbytes(C.FP16, 10) == C.encoded_nbytes(C.BF16, 10) == 20
    assert C.encoded_nbytes(C.INT8, 1024) == 1028 and C.encoded_nbytes(C.INT8, 1025) == 1033


def test_codec_map_pieces_parts_that_cross_tensors_and_checks_what_arrives():
    m = C.CodecMap((0, 100, 300, 400), (C.INT8, C.NONE, C.FP16))
    cid, pieces, nbytes = m.layout(50, 350)
    assert cid == C.MIXED and [p[0] for p in pieces] == [C.INT8, C.NONE, C.FP16]
    assert nbytes == (50 + 4) + 200 * 4 + 50 * 2
    assert m.layout(300, 400)[0] == C.FP16 and m.layout(100, 300)[0] == C.NONE
    x = np.random.default_rng(0).standard_normal(300).astype(np.float32)
    cid, enc = m.encode(50, 350, x)
    out = np.empty(300, np.float32)
    assert m.decode(50, 350, cid, enc, out) is None
    assert np.array_equal(out[50:250], x[50:250])  # the raw piece is exact
    assert "bytes" in m.decode(50, 350, cid, enc[:-1], out)  # truncated: refused
    assert "agreed" in m.decode(50, 350, C.INT8, enc, out)  # another codec id: refused
    assert "agreed" in m.decode(50, 350, 77, enc, out)  # an unknown one too


def test_error_feedback_records_what_the_codec_lost():
    res = np.zeros(2048, np.float32)
    m = C.CodecMap((0, 2048), (C.INT8,), residual=res)
    x = np.random.default_rng(1).standard_normal(2048).astype(np.float32)
    _, enc = m.encode(0, 2048, x)
    y = np.empty_like(x)
    C.decode(C.INT8, enc, y)
    assert np.array_equal(res, x - y) and np.abs(res).max() > 0
    m.zero_residual(0, 1024)
    assert not res[:1024].any()


def test_resolve_per_tensor_choices():
    shapes, dtypes = [(10,), (5000,), (3,)], [np.float32, np.float32, np.float16]
    assert C.resolve(None, shapes, dtypes) == (C.NONE, C.NONE, C.FP16)
    assert C.resolve("int8", shapes, dtypes) == (C.INT8,) * 3
    assert C.resolve({1: "bf16"}, shapes, dtypes) == (C.NONE, C.BF16, C.FP16)
    # bf16 would round an fp16 tensor's values above 65408 to 65536 (inf in fp16): it travels as fp16
    assert C.resolve("bf16", shapes, dtypes) == (C.BF16, C.BF16, C.FP16)
    assert C.resolve({2: "bf16"}, shapes, dtypes) == (C.NONE, C.NONE, C.FP16)
    assert C.resolve(["int8", "fp16", "none"], shapes, dtypes) == (C.INT8, C.FP16, C.NONE)
    assert C.resolve(C.by_size(1000), shapes, dtypes) == (C.NONE, C.INT8, C.NONE)
    for bad in ("zip", {5: "int8"}, ["int8"], {0: "nope"}):
        with pytest.raises(ValueError):
            C.resolve(bad, shapes, dtypes)


def test_resolve_for_bfloat16_tensors():
    """A bfloat16 tensor (dtype "bf16" in a layout) travels as bf16 by default and when named none (raw
    float32 would carry the same values in twice the bytes); other codecs named for it win; a rule is
    told its dtype as "bfloat16"."""
    shapes, dtypes = [(10,), (5000,)], [C.BF16_DTYPE, np.float32]
    assert C.resolve(None, shapes, dtypes) == (C.BF16, C.NONE)
    assert C.resolve("none", shapes, dtypes) == (C.BF16, C.NONE)
    assert C.resolve("int8", shapes, dtypes) == (C.INT8, C.INT8)
    assert C.resolve({0: "fp16"}, shapes, dtypes) == (C.FP16, C.NONE)
    seen = []
    assert C.resolve(lambda i, s, d: seen.append(d) or "none", shapes, dtypes) == (C.BF16, C.NONE)
    assert seen == ["bfloat16", np.dtype(np.float32)]
    assert C.resolve(C.by_size(1000, "int8"), shapes, dtypes) == (C.BF16, C.INT8)


@pytest.mark.skipif(not __import__("zgossip.kernels").kernels.NATIVE, reason="C extension not built")
@pytest.mark.parametrize("codec", LOSSY)
def test_c_and_numpy_paths_give_the_same_bytes(codec, monkeypatch):
    from zgossip import kernels

    x = np.random.default_rng(4).standard_normal(5000).astype(np.float32) * 100
    x[[3, 2100, 4999]] = [np.inf, -0.0, 1e-42]
    x[1024:2048] = -0.0
    x[3072:4096] *= np.float32(1e-41)  # a subnormal scale (divided, not multiplied by its inverse)
    x[3000] = 7e4
    n = C.encoded_nbytes(codec, x.size)
    a, b = np.empty(n, np.uint8), np.empty(n, np.uint8)
    C.encode(codec, x, a)
    ya = np.empty_like(x)
    C.decode(codec, a, ya)
    monkeypatch.setattr(kernels, "_native", None)
    C.encode(codec, x, b)
    yb = np.empty_like(x)
    C.decode(codec, a, yb)
    assert np.array_equal(a, b)
    assert np.array_equal(ya.view(np.uint32), yb.view(np.uint32))
