"""The all-reduce's numeric policy alone: when to sum, and what NaN/inf and overflow do."""
from __future__ import annotations

import numpy as np
import pytest

from zgossip.kernels import ACC_BLOCK
from zgossip.numeric import MIN_RUN, PassPlan, add_pass, divide, plan_pass, scaled, take_finite, weight_exponent


@pytest.mark.parametrize("nterms, complete, first, plan", [
    (0, False, True, PassPlan.WAIT),
    (0, True, False, PassPlan.FINISH),
    (MIN_RUN - 1, False, True, PassPlan.WAIT),
    (MIN_RUN, False, True, PassPlan.SUM),
    (1, True, True, PassPlan.ALONE),
    (1, True, False, PassPlan.SUM),
    (2, True, True, PassPlan.SUM),
])
def test_plan_pass(nterms, complete, first, plan):
    assert plan_pass(nterms, complete, first) is plan


def test_a_clean_pass_is_the_fixed_order_weighted_mean():
    rng = np.random.default_rng(0)
    terms = [rng.standard_normal(100) for _ in range(3)]
    out = np.empty(100)
    v = add_pass(out, out, terms, [1.0, 2.0, 3.0], True, 6.0)
    assert v.ok
    np.testing.assert_allclose(out, (terms[0] + 2 * terms[1] + 3 * terms[2]) / 6, rtol=1e-12)


def test_nan_in_the_first_block_of_a_first_pass_drops_only_that_term():
    terms = [np.ones(10), np.ones(10)]
    terms[1][2] = np.nan
    scratch = np.empty(10)
    v = add_pass(scratch, scratch, terms, [1.0, 1.0], True, 0.0)
    assert not v.ok and v.bad_term == 1 and v.give_up is None and v.kept == 0


def test_nan_after_a_stored_block_gives_the_part_up_keeping_the_owners_prefix():
    n = 2 * ACC_BLOCK
    terms = [np.ones(n), np.full(n, 3.0)]
    terms[0][ACC_BLOCK + 5] = np.inf
    own, scratch = np.empty(n), np.empty(n)
    v = add_pass(own, scratch, terms, [1.0, 1.0], True, 2.0)
    assert not v.ok and v.bad_term == 0 and v.give_up and v.kept == ACC_BLOCK
    np.testing.assert_array_equal(own[:ACC_BLOCK], 2.0)  # the mean over the pass's terms


def test_overflow_gives_the_part_up():
    terms = [np.full(8, 1e308), np.full(8, 1e308)]
    out = np.empty(8)
    v = add_pass(out, out, terms, [1.0, 1.0], True, 1e-300)
    assert not v.ok and v.bad_term is None and "overflow" in v.give_up
    assert divide(np.full(4, 1e308), 1e-300) is not None and divide(np.full(4, 2.0), 2.0) is None


def test_a_result_is_taken_up_to_its_first_bad_block():
    dst, res = np.zeros(4096), np.ones(4096)
    res[2500] = np.nan
    took = take_finite(dst, res)
    assert 0 < took <= 2500 and np.all(dst[:took] == 1.0) and np.all(dst[took:] == 0.0)


def test_weights_that_float32_cannot_hold_give_the_part_up_instead_of_raising():
    # scaled weights come from the part's first terms; a later one 2**200 times larger is past float32
    out = np.zeros(8, np.float32)
    terms = [np.ones(8, np.float32), np.ones(8, np.float32)]
    e = weight_exponent([1e-30, 1e-30])
    v = add_pass(out, out, terms, [scaled(1e-30, e), scaled(1e30, e)], True, scaled(1e30 + 1e-30, e))
    assert not v.ok and v.bad_term is None and "weights" in v.give_up and v.kept == 0
    assert np.all(out == 0)
    assert weight_exponent([1.0, 1.0]) == 0 and weight_exponent([3.0, 1e30, 1.0, 1.0, 1e31]) == 99


def test_a_weight_sum_past_float32_gives_the_part_up_instead_of_dividing_to_zeros():
    acc = np.full(8, 3.0, np.float32)
    assert "weights" in divide(acc, 1e39)
