"""A real 1P1D stack with ``--data-tls``: the prefill node's KV reaches the decode node's buffer
over mutual TLS, and the answers and cache hits are those of a stack without it."""

from __future__ import annotations

import pytest
from conftest import openai_client, start_stack

pytestmark = pytest.mark.slow

TURNS = [
    "Here is the repository layout and the failing test output, please look at it carefully. " * 3,
    "The tool returned: stack trace line 42 in scheduler.py, KeyError 'engine'. What next?",
]


def _conversation(url: str) -> list[tuple[str, int, list[float]]]:
    """(answer, cached prompt tokens, logprobs) of each turn of a chat that extends itself."""
    client = openai_client(url)
    model = client.models.list().data[0].id
    messages = [{"role": "system", "content": "You are a coding agent."}]
    out = []
    for text in TURNS:
        messages.append({"role": "user", "content": text})
        r = client.chat.completions.create(model=model, messages=messages, max_tokens=24, temperature=0, logprobs=True)
        answer = r.choices[0].message.content or ""
        out.append((answer, r.usage.prompt_tokens_details.cached_tokens, [c.logprob for c in r.choices[0].logprobs.content]))
        messages.append({"role": "assistant", "content": answer})
    return out


def test_kv_crosses_nodes_over_mutual_tls_and_serves_what_a_plain_stack_serves(tiny_model, tmp_path) -> None:
    tls = start_stack(tiny_model, tmp_path / "storage-tls", tmp_path / "run-tls", data_tls=True)
    try:
        with_tls = _conversation(tls.url)
        logs = {name: tls.logs.joinpath(f"{name}.log").read_text() for name in ("traffic-manager-d0", "traffic-manager-p0")}
    finally:
        tls.stop()
    assert with_tls[1][1] > 0  # the second turn hit the first turn's KV
    assert '"event": "tcp_tls_connection"' in logs["traffic-manager-d0"] and "TLSv1.3" in logs["traffic-manager-d0"]
    assert all("tcp_key_refused" not in text and "tcp_tls_refused" not in text for text in logs.values())
    assert (tmp_path / "run-tls" / "data-tls" / "ca.pem").exists()
    plain = start_stack(tiny_model, tmp_path / "storage", tmp_path / "run")
    try:
        without = _conversation(plain.url)
    finally:
        plain.stop()
    for (a_text, a_hit, a_lp), (b_text, b_hit, b_lp) in zip(with_tls, without):
        assert (a_text, a_hit) == (b_text, b_hit)
        assert len(a_lp) == len(b_lp) > 0 and max(abs(x - y) for x, y in zip(a_lp, b_lp)) < 1e-4
