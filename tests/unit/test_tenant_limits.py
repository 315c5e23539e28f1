"""Per-tenant admission limits (``dualpath.tenant.limits``), driven with an explicit clock."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dualpath.tenant import RateLimitedError, TenantLimiter, TenantLimits


def _limiter(**per_tenant: TenantLimits) -> TenantLimiter:
    return TenantLimiter(TenantLimits(max_concurrency=2, tokens_per_minute=0), per_tenant, lease_ttl_s=600)


def test_a_tenant_at_its_concurrency_is_refused_until_a_request_ends():
    lim = _limiter()
    lim.admit("a1", "alice", 10, now=0)
    lim.admit("a2", "alice", 10, now=0)
    with pytest.raises(RateLimitedError) as err:
        lim.admit("a3", "alice", 10, now=0)
    assert err.value.limit == "max_concurrency" and err.value.retry_after_s == 1 and "alice" in str(err.value)
    lim.admit("b1", "bob", 10, now=0)  # another tenant's limit is its own
    lim.release("a1")
    lim.release("a1")  # idempotent
    lim.admit("a3", "alice", 10, now=0)
    assert lim.in_flight("alice") == 2


def test_per_tenant_limits_override_the_defaults_and_zero_means_none():
    lim = _limiter(vip=TenantLimits(max_concurrency=0), tiny=TenantLimits(tokens_per_minute=60))
    for i in range(10):
        lim.admit(f"v{i}", "vip", 1, now=0)
    assert lim.limits_of("tiny") == TenantLimits(max_concurrency=2, tokens_per_minute=60)
    assert lim.limits_of("vip") == TenantLimits(max_concurrency=0, tokens_per_minute=0)


def test_the_token_budget_refills_over_the_minute_and_says_when_to_retry():
    lim = TenantLimiter(TenantLimits(tokens_per_minute=600), lease_ttl_s=600)  # 10 tokens a second
    lim.admit("r1", "t", 500, now=0)
    lim.charge("r1", 100, now=0)  # generated tokens count too: the bucket is empty
    with pytest.raises(RateLimitedError) as err:
        lim.admit("r2", "t", 50, now=0)
    assert err.value.limit == "tokens_per_minute" and err.value.retry_after_s == 5
    with pytest.raises(RateLimitedError):
        lim.admit("r2", "t", 50, now=4.9)
    lim.admit("r2", "t", 50, now=5.0)


def test_a_prompt_larger_than_the_whole_budget_is_admitted_on_a_full_bucket():
    lim = TenantLimiter(TenantLimits(tokens_per_minute=100), lease_ttl_s=600)
    lim.admit("big", "t", 1000, now=0)
    with pytest.raises(RateLimitedError) as err:
        lim.admit("next", "t", 1, now=60)  # 900 tokens of debt: 9 minutes more
    assert err.value.retry_after_s == 481


def test_a_lease_whose_release_was_lost_stops_counting_after_its_ttl():
    lim = TenantLimiter(TenantLimits(max_concurrency=1), lease_ttl_s=30)
    lim.admit("lost", "t", 1, now=0)
    with pytest.raises(RateLimitedError):
        lim.admit("r", "t", 1, now=29)
    lim.admit("r", "t", 1, now=31)


def test_without_limits_the_limiter_is_inactive_and_admits_everything():
    lim = TenantLimiter(TenantLimits(), lease_ttl_s=1)
    assert not lim.active
    for i in range(100):
        lim.admit(str(i), "", 10**6, now=0)
    assert TenantLimiter(TenantLimits(), {"a": TenantLimits(tokens_per_minute=5)}, lease_ttl_s=1).active


def test_negative_limits_are_refused():
    with pytest.raises(ValueError):
        TenantLimiter(TenantLimits(max_concurrency=-1), lease_ttl_s=1)


@given(ops=st.lists(st.tuples(st.sampled_from("arc"), st.integers(0, 5), st.integers(0, 300)), max_size=60))
def test_in_flight_never_exceeds_the_limit_and_a_refusal_changes_nothing(ops):
    lim = TenantLimiter(TenantLimits(max_concurrency=3, tokens_per_minute=600), lease_ttl_s=10_000)
    now = 0.0
    for kind, rid, n in ops:
        now += 0.5
        if kind == "a":
            before = (lim.in_flight("t"), lim._tenants["t"].level if "t" in lim._tenants else None)
            try:
                lim.admit(str(rid), "t", n, now)
            except RateLimitedError as exc:
                assert exc.retry_after_s >= 1
                assert lim.in_flight("t") == before[0]
        elif kind == "r":
            lim.release(str(rid))
        else:
            lim.charge(str(rid), n, now)
        assert lim.in_flight("t") <= 3
