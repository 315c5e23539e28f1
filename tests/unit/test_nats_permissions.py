"""The per-role NATS permissions come from the subject table, and every subject has a rule."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest

from dualpath.bus.auth import OPERATOR, ClusterAuth, Identity, permissions
from dualpath.protocol import subjects as subjects_module
from dualpath.protocol.subjects import RULES, TM_TOPICS, Role, Subjects

ROOT = Path(__file__).resolve().parents[2]


def _matches(pattern: str, subject: str) -> bool:
    """NATS subject matching: ``*`` one token, ``>`` the rest."""
    p, s = pattern.split("."), subject.split(".")
    for i, tok in enumerate(p):
        if tok == ">":
            return len(s) > i
        if i >= len(s) or (tok != "*" and tok != s[i]):
            return False
    return len(p) == len(s)


def _allowed(identity: Identity, what: str, subject: str, ns: str = "dp") -> bool:
    return any(_matches(p, subject) for p in permissions(identity, ns)[what]["allow"])


PREFILL = Identity(Role.PREFILL, "p0e0", "p0")
DECODE = Identity(Role.DECODE, "d0e0", "d0")
GATEWAY = Identity(Role.GATEWAY, "gw0")
TM = Identity(Role.TRAFFIC_MANAGER, "p0")
S = Subjects("dp")


def test_every_subject_of_the_table_has_a_rule():
    assert subjects_module.unruled_attributes() == []


def test_a_new_subject_without_a_rule_is_caught(monkeypatch):
    monkeypatch.setattr(Subjects, "new_topic", property(lambda self: f"{self.ns}.new"), raising=False)
    assert subjects_module.unruled_attributes() == ["new_topic"]


def test_every_traffic_manager_topic_it_serves_has_a_rule():
    """The topics ``services/traffic_manager`` serves are read from its source, not restated here."""
    source = (ROOT / "services" / "traffic_manager" / "service.py").read_text()
    served = set(re.findall(r'\(\s*"(\w+)",\s*tm\.\w+', source)) | set(re.findall(r'subjects\.tm\(cfg\.node_id, "(\w+)"\)', source))
    assert served, "no served topics found: the pattern above no longer matches the service"
    assert served <= set(TM_TOPICS), served - set(TM_TOPICS)
    with pytest.raises(ValueError, match="unknown traffic-manager topic"):
        S.tm("p0", "not-a-topic")


def test_every_subject_used_by_a_service_is_in_the_table():
    """Every ``subjects.<name>`` a service or library touches is an attribute the table rules."""
    used: set[str] = set()
    for path in [*ROOT.joinpath("services").rglob("*.py"), *ROOT.joinpath("libs", "dualpath").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) and node.value.attr == "subjects":
                used.add(node.attr)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in ("subjects", "subj"):
                used.add(node.attr)
    public = {n for n, _ in inspect.getmembers(Subjects) if not n.startswith("_")}
    assert used, "no subject uses found"
    assert used <= public | {"ns"}, used - public


def test_an_engine_publishes_only_its_own_reports_and_cannot_command():
    assert _allowed(PREFILL, "publish", S.engine_report("p0e0"))
    assert not _allowed(PREFILL, "publish", S.engine_report("p0e1"))
    assert not _allowed(PREFILL, "publish", S.task_failed("d0e0"))
    for command in (S.submit, S.prefill("p0e1"), S.sched_alive, S.engine_lost, S.kv_commit, S.tm("p1", "free")):
        assert not _allowed(PREFILL, "publish", command), command
    assert _allowed(PREFILL, "publish", S.decode("d0e0"))  # it hands a prefilled request to a decode engine
    assert _allowed(PREFILL, "publish", S.tm("d0", "load"))  # a DE read goes through the decode node
    assert not _allowed(DECODE, "publish", S.tm("d1", "persist"))  # only through its own node


def test_token_streams_are_read_by_their_gateway_only():
    stream = S.tokens("gw0", "req1")
    assert _allowed(GATEWAY, "subscribe", stream)
    assert not _allowed(Identity(Role.GATEWAY, "gw1"), "subscribe", stream)
    for role_identity in (PREFILL, DECODE, TM, Identity(Role.SCHEDULER, "s0"), Identity(Role.KV_PERSISTENCE, "r0")):
        assert not _allowed(role_identity, "subscribe", stream), role_identity
    assert _allowed(DECODE, "publish", stream)


def test_the_index_stream_belongs_to_kv_persistence():
    kvp = Identity(Role.KV_PERSISTENCE, "r0")
    info = f"$JS.API.STREAM.INFO.{S.kv_index}"
    consumer = f"$JS.API.CONSUMER.CREATE.{S.kv_index}.c1.{S.kv_log}"
    assert _allowed(kvp, "publish", info) and _allowed(kvp, "publish", consumer)
    for other in (PREFILL, DECODE, TM, GATEWAY, Identity(Role.SCHEDULER, "s0")):
        assert not _allowed(other, "publish", info), other
        assert not _allowed(other, "publish", consumer), other
    assert not _allowed(GATEWAY, "publish", f"$KV.{S.sched_leader}.leader")  # a gateway cannot take the lease


def test_replies_go_only_to_the_identitys_own_inbox():
    assert _allowed(GATEWAY, "subscribe", "_INBOX.gateway-gw0.abc.1")
    assert not _allowed(GATEWAY, "subscribe", "_INBOX.scheduler-s0.abc.1")
    assert permissions(GATEWAY, "dp")["allow_responses"] is True


def test_own_scope_needs_the_identitys_ids():
    with pytest.raises(ValueError, match="no node id"):
        permissions(Identity(Role.DECODE, "d0e0"), "dp")  # an engine without its node


def test_unknown_roles_and_unsafe_names_are_refused():
    with pytest.raises(ValueError):
        Identity("root", "x")
    with pytest.raises(ValueError):
        Identity(Role.GATEWAY, "gw0.>")


def test_rules_name_only_known_roles_and_fields():
    for rule in [*RULES.values(), *TM_TOPICS.values()]:
        fields = set(re.findall(r"{(\w+)}", rule.pattern)) - {"ns"}
        assert fields <= {"engine", "node", "gateway", "request"}, rule.pattern
        assert rule.publish and rule.subscribe, rule.pattern  # a subject nobody reads or writes is dead


def test_server_config_holds_every_identity_with_a_distinct_password():
    auth = ClusterAuth("dp")
    auth.add_all([PREFILL, DECODE, GATEWAY, Identity(OPERATOR, "launcher")])
    text = auth.server_config()
    assert all(identity.user in text for identity in (PREFILL, DECODE, GATEWAY))
    assert len(set(auth.passwords.values())) == 4
    assert auth.add(PREFILL) is PREFILL and len(auth.passwords) == 4  # adding again keeps the password


def test_the_security_page_shows_the_table_the_server_enforces():
    """docs/security.md carries the permission table as the code derives it (regenerate it with
    ``python -c "from dualpath.bus.auth import permissions_table; print(permissions_table())"``)."""
    from dualpath.bus.auth import permissions_table

    assert permissions_table() in (ROOT / "docs" / "security.md").read_text()
