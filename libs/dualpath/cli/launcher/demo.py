"""``dualpath demo``: start a stack, hold a multi-turn agent conversation, show the KV reuse.

Prints, per turn, prompt tokens, tokens read from storage (cached), the read path and the
latency, then stops the stack. Uses the official ``openai`` client like any user would.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from typing import TYPE_CHECKING, Any, cast

from dualpath.cli.launcher.stack import Stack, StackConfig, StackError
from dualpath.cli.launcher.topology import parse_topology
from dualpath.cli.launcher.up import ensure_model

if TYPE_CHECKING:
    from openai.types import CompletionUsage
    from openai.types.chat import ChatCompletionMessageParam
    from openai.types.completion_usage import PromptTokensDetails

__all__ = ["main"]

TURNS = [
    "List the files in the repository and tell me which one holds the scheduler.",
    "Tool output: services/scheduler/core.py (210 lines), libs/dualpath/policy/inter.py (190 lines). Open the first.",
    "Tool output: def schedule_pass(self) -> int: ... Find where requests are re-queued after a failure.",
    "Tool output: async def _retry(self, t, reason): ... Suggest a test for the retry limit.",
    "Tool output: 1 passed in 0.21s. Summarise the change for the commit message.",
]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="dualpath demo", description=__doc__)
    p.add_argument("--model", default="", help="checkpoint directory (default: the tiny model)")
    p.add_argument("--topology", default="1P1D")
    p.add_argument("--turns", type=int, default=len(TURNS))
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--read-path", default="auto", choices=("auto", "pe", "de"))
    p.add_argument("--run-dir", default=".dualpath")
    ns = p.parse_args(argv)
    import openai

    from dualpath.bus.embedded import free_port

    model = ensure_model(ns.model, ns.run_dir)
    storage = tempfile.mkdtemp(prefix="dualpath-demo-storage-")
    cfg = StackConfig(
        model=model, topology=parse_topology(ns.topology), storage=storage, run_dir=ns.run_dir, port=free_port(), read_path=ns.read_path
    )
    print(f"starting a {ns.topology} stack (storage {storage}) ...", flush=True)
    try:
        stack = Stack(cfg).start(progress=lambda msg: print("  " + msg, flush=True))
    except StackError as exc:
        print(f"dualpath demo: {exc}", file=sys.stderr)
        return 1
    try:
        client = openai.OpenAI(base_url=stack.url + "/v1", api_key="demo", max_retries=0)
        name = client.models.list().data[0].id
        messages: list[ChatCompletionMessageParam] = [{"role": "system", "content": "You are a coding agent working in a repository."}]
        print(f"\n{'turn':>4} {'prompt':>7} {'cached':>7} {'hit %':>6} {'new':>5} {'path':>5} {'seconds':>8}")
        for i, text in enumerate(TURNS[: ns.turns] * (1 + ns.turns // len(TURNS)), 1):
            if i > ns.turns:
                break
            messages.append({"role": "user", "content": text})
            t0 = time.perf_counter()
            r = client.chat.completions.create(model=name, messages=messages, max_tokens=ns.max_tokens, temperature=0)
            dt = time.perf_counter() - t0
            u = cast("CompletionUsage", r.usage)  # a DualPath server always reports usage and cached tokens
            cached = cast(int, cast("PromptTokensDetails", u.prompt_tokens_details).cached_tokens)
            info = cast("dict[str, Any]", r.model_extra).get("dualpath", {})
            print(
                f"{i:>4} {u.prompt_tokens:>7} {cached:>7} {100 * cached / u.prompt_tokens:>5.1f}% {u.completion_tokens:>5} "
                f"{info.get('read_path', '?'):>5} {dt:>8.3f}",
                flush=True,
            )
            messages.append({"role": "assistant", "content": r.choices[0].message.content})
    finally:
        stack.stop()
    print("\nstack stopped")
    return 0
