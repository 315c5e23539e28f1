"""The API key file (``dualpath.tenant.keys``): its format, its errors, the key -> tenant lookup."""

from __future__ import annotations

import pytest

from dualpath.tenant import DEFAULT_TENANT, ApiKeys, KeyFileError, TenantLimits, configured_keys, parse_key_file

GOOD = """
# KEY        TENANT  [limits]
sk-alice-1   alice
sk-alice-2   alice   max_concurrency=2

  sk-bob     bob     tokens_per_minute=1000 max_concurrency=0
"""


def test_a_file_maps_each_key_to_its_tenant_and_gathers_each_tenants_limits():
    parsed = parse_key_file(GOOD)
    assert parsed.keys == {"sk-alice-1": "alice", "sk-alice-2": "alice", "sk-bob": "bob"}
    assert parsed.tenants == ["alice", "bob"]
    assert parsed.limits == {
        "alice": TenantLimits(max_concurrency=2),
        "bob": TenantLimits(max_concurrency=0, tokens_per_minute=1000),
    }


@pytest.mark.parametrize(
    ("text", "line", "words"),
    [
        ("sk-a alice\nsk-lonely\n", 2, "one field"),
        ("sk-a alice\nsk-a bob\n", 2, "duplicate key (already on line 1)"),
        ("# c\n\nsk-a al/ice\n", 3, "tenant 'al/ice'"),
        ("sk-a alice colour=red\n", 1, "unknown option 'colour=red'"),
        ("sk-a alice max_concurrency\n", 1, "unknown option"),
        ("sk-a alice max_concurrency=-1\n", 1, "whole number"),
        ("sk-a alice max_concurrency=two\n", 1, "whole number"),
        ("sk-a alice max_concurrency=1 max_concurrency=1\n", 1, "given twice"),
        ("sk-a alice max_concurrency=1\nsk-b alice max_concurrency=3\n", 2, "earlier line"),
        ("sk-é alice\n", 1, "printable ASCII"),
        ("# only comments\n\n", 0, "no API key"),
    ],
)
def test_a_malformed_file_is_refused_naming_the_line(text, line, words):
    with pytest.raises(KeyFileError) as err:
        parse_key_file(text, "keys.txt")
    assert err.value.line == line and words in str(err.value)
    assert str(err.value).startswith("API key file keys.txt" + (f", line {line}:" if line else ":"))


def test_an_error_message_never_holds_the_key():
    with pytest.raises(KeyFileError) as err:
        parse_key_file("sk-secret-value alice\nsk-secret-value bob\n")
    assert "sk-secret-value" not in str(err.value)


def test_the_single_api_key_is_tenant_default_and_joins_the_files_keys(tmp_path):
    path = tmp_path / "keys"
    path.write_text("sk-a alice\n")
    assert configured_keys("", "") is None
    assert configured_keys("solo", "").keys == {"solo": DEFAULT_TENANT}
    assert configured_keys("solo", str(path)).keys == {"sk-a": "alice", "solo": DEFAULT_TENANT}
    with pytest.raises(KeyFileError, match="also listed"):
        configured_keys("sk-a", str(path))
    with pytest.raises(KeyFileError, match="cannot be read"):
        configured_keys("", str(tmp_path / "missing"))


def test_the_lookup_finds_each_keys_tenant_and_nothing_for_others():
    keys = ApiKeys({"sk-a": "alice", "sk-b": "bob", "sk-a2": "alice"})
    assert [keys.tenant_of(k) for k in ("sk-a", "sk-b", "sk-a2")] == ["alice", "bob", "alice"]
    for wrong in ("", "sk-", "sk-a ", "SK-A", "sk-ab", "x" * 10_000, "sk-é"):
        assert keys.tenant_of(wrong) is None
    assert keys.tenants == ["alice", "bob"]
    with pytest.raises(ValueError):
        ApiKeys({})


def test_keys_are_held_only_as_digests():
    """No configured key is kept in the clear in the lookup object."""
    keys = ApiKeys({"sk-plain-secret": "alice"})
    assert keys.tenant_of("sk-plain-secret") == "alice"
    assert "sk-plain-secret" not in repr(vars(keys))
