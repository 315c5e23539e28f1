"""``dualpath bench index``: can the replicated block index carry a 1,152-GPU cluster's load?

The load, from the paper's figures (PAPER.md, 64K set, online at scale: 44P88D at 8.8 agents
per second, 157 turns per agent, 429 tokens appended and 176 generated per turn, average
context 32,721 tokens, 64-token blocks):

- lookups: one per turn, 8.8 x 157 = 1,382 per second, each over the whole context's chain
  (32,721 / 64 = 511 hashes);
- block commits: every block that fills, (429 + 176) / 64 = 9.45 per turn, 13,061 per
  second, arriving as one commit for the prompt's new blocks and one per generated block
  (3.75 commit requests per turn), each carrying the whole chain (as the traffic manager
  sends it).

The benchmark runs a real nats-server with JetStream and ``--replicas`` kv-persistence
processes (``--replication jetstream``), warms the index with the agents' contexts, then
drives lookups and commits in the load's mix from ``--clients`` concurrent agents (closed
loop, as fast as answers come) for ``--seconds`` and reports the rates it sustained. The
headroom is the smaller of sustained/required over lookups and block commits. Everything
shares this machine's cores with the load driver itself, so the figure is a lower bound.
A benchmark, not a test: it prints what it measured.
"""

from __future__ import annotations

import asyncio
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import cast

__all__ = ["LOAD", "format_report", "run_bench"]

_BLOCK = 64
_APS, _TURNS, _APPEND, _GEN, _CONTEXT = 8.8, 157, 429, 176, 32_721
LOAD = {
    "source": "PAPER.md: 64K set, 44P88D online at 8.8 APS (the 1,152-GPU scale)",
    "lookups_per_s": _APS * _TURNS,
    "block_commits_per_s": _APS * _TURNS * (_APPEND + _GEN) / _BLOCK,
    "commit_requests_per_s": _APS * _TURNS * (1 + _GEN / _BLOCK),
    "chain_blocks": _CONTEXT // _BLOCK,
}


def _encode(type_id: int, fields: dict) -> bytes:
    from dualpath.protocol import encode
    from dualpath.protocol import messages as m

    cls = {11: m.LookupRequest, 12: m.CommitRequest}[type_id]
    return encode(cls(**fields))


class _Agent:
    """One conversation's hash chain, grown turn by turn."""

    def __init__(self, rng: random.Random, chain_blocks: int) -> None:
        self.rng = rng
        self.chain = [rng.getrandbits(63) | 1 for _ in range(chain_blocks)]

    def new_blocks(self, n: int) -> list[int]:
        return [self.rng.getrandbits(63) | 1 for _ in range(n)]


async def _drive(url: str, namespace: str, *, clients: int, seconds: float, chain_blocks: int, seed: int) -> dict:
    import nats

    from dualpath.protocol import decode
    from dualpath.protocol import messages as m
    from dualpath.protocol.subjects import Subjects

    subj = Subjects(namespace)
    nc = await nats.connect(url, max_reconnect_attempts=-1)
    rng = random.Random(seed)
    agents = [_Agent(rng, chain_blocks) for _ in range(clients)]
    digest = 0x5EED
    prompt_blocks = round(_APPEND / _BLOCK)  # new blocks of a turn's prompt (plus the generated ones, one at a time)
    gen_blocks = round(_GEN / _BLOCK)
    for a in agents:  # warm-up: each agent's context is indexed
        await nc.request(subj.kv_commit, _encode(12, {"model_digest": digest, "hashes": a.chain, "start": 0}), timeout=30)
    counts = {"lookups": 0, "commit_requests": 0, "block_commits": 0, "errors": 0, "hit_blocks": 0}
    latencies: list[float] = []
    stop_at = time.perf_counter() + seconds

    async def commit(a: _Agent, n: int) -> None:
        new = a.new_blocks(n)
        a.chain = a.chain[-chain_blocks:] + new if len(a.chain) > 4 * chain_blocks else a.chain + new
        start = len(a.chain) - n
        await nc.request(subj.kv_commit, _encode(12, {"model_digest": digest, "hashes": a.chain, "start": start}), timeout=30)
        counts["commit_requests"] += 1
        counts["block_commits"] += n

    async def run(a: _Agent) -> None:
        while time.perf_counter() < stop_at:
            try:
                t0 = time.perf_counter()
                reply = await nc.request(
                    subj.kv_lookup, _encode(11, {"model_digest": digest, "hashes": a.chain[-chain_blocks:]}), timeout=30
                )
                latencies.append(time.perf_counter() - t0)
                counts["lookups"] += 1
                counts["hit_blocks"] += decode(reply.data, m.LookupReply).hit_blocks
                await commit(a, prompt_blocks)
                for _ in range(gen_blocks):
                    await commit(a, 1)
            except Exception:  # noqa: BLE001 - counted, the run goes on
                counts["errors"] += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(run(a) for a in agents))
    elapsed = time.perf_counter() - t0
    await nc.close()
    latencies.sort()
    return {
        "elapsed_s": elapsed,
        **counts,
        "lookup_p50_ms": 1000 * latencies[len(latencies) // 2] if latencies else None,
        "lookup_p99_ms": 1000 * latencies[int(len(latencies) * 0.99)] if latencies else None,
    }


def run_bench(
    *,
    replicas: int = 2,
    clients: int = 48,
    seconds: float = 10.0,
    nats_cluster: int = 1,
    seed: int = 0,
    chain_blocks: int = cast(int, LOAD["chain_blocks"]),
) -> dict:
    """Start NATS and ``replicas`` kv-persistence processes, drive the load's mix, report rates and headroom."""
    from dualpath.cli.launcher.supervisor import Supervisor
    from dualpath.ha.natscluster import nats_servers

    run_dir = Path(tempfile.mkdtemp(prefix="dualpath-bench-index-"))
    sup = Supervisor(logs=run_dir / "logs")
    namespace = f"bi{os.getpid()}"
    try:
        specs = nats_servers(nats_cluster, run_dir)
        for s in specs:
            sup.add(s.name, s.cmd, dict(os.environ))
        url = ",".join(s.url for s in specs)
        time.sleep(1.0 if nats_cluster > 1 else 0.3)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        for i in range(replicas):
            sup.add(
                f"kv-persistence-{i}",
                [
                    sys.executable,
                    "-m",
                    "services.kv_persistence",
                    "--nats-url",
                    url,
                    "--namespace",
                    namespace,
                    "--storage",
                    str(run_dir / "storage"),
                    "--replication",
                    "jetstream",
                    "--replica-id",
                    str(i),
                ],
                env,
            )
        _wait_for_replicas(run_dir / "logs", replicas, sup)
        cpu0 = _cpu_seconds(sup)
        measured = asyncio.run(_drive(specs[0].url, namespace, clients=clients, seconds=seconds, chain_blocks=chain_blocks, seed=seed))
        cpu1 = _cpu_seconds(sup)
    finally:
        sup.stop([n for n in sup.children if n.startswith("kv-")], 10.0)
        sup.stop(list(sup.children), 5.0)
    t = measured["elapsed_s"]
    rates = {
        "lookups_per_s": measured["lookups"] / t,
        "block_commits_per_s": measured["block_commits"] / t,
        "commit_requests_per_s": measured["commit_requests"] / t,
    }
    headroom = min(rates["lookups_per_s"] / LOAD["lookups_per_s"], rates["block_commits_per_s"] / LOAD["block_commits_per_s"])
    cpu = {k: cpu1.get(k, 0.0) - cpu0.get(k, 0.0) for k in cpu1}
    # What the replicas' CPU time says: seconds of one core per second of the full load (the
    # measured mix has the load's ratio of lookups to commits), i.e. cores the index needs.
    replica_cpu = sum(v for k, v in cpu.items() if k.startswith("kv-"))
    load_seconds = t * min(rates["lookups_per_s"] / LOAD["lookups_per_s"], rates["block_commits_per_s"] / LOAD["block_commits_per_s"])
    cores_for_load = replica_cpu / load_seconds if load_seconds else None
    return {
        "load": LOAD,
        "measured": measured,
        "rates": rates,
        "headroom": headroom,
        "headroom_ok": headroom >= 3.0,
        "replicas": replicas,
        "nats_servers": nats_cluster,
        "clients": clients,
        "host_cpus": os.cpu_count(),
        "cpu_seconds": cpu,
        "replica_cores_for_load": cores_for_load,
        "replica_cores_for_3x": 3 * cores_for_load if cores_for_load else None,
    }


def _wait_for_replicas(logs: Path, replicas: int, sup, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready = sum(
            1
            for i in range(replicas)
            if (logs / f"kv-persistence-{i}.log").exists()
            and "index_loaded" in (logs / f"kv-persistence-{i}.log").read_text(errors="replace")
        )
        if ready == replicas:
            return
        for name, child in sup.children.items():
            if child.proc is not None and child.proc.poll() is not None:
                raise RuntimeError(f"{name} exited: see {logs / name}.log")
        time.sleep(0.2)
    raise RuntimeError(f"kv-persistence replicas not ready within {timeout}s (logs in {logs})")


def _cpu_seconds(sup) -> dict[str, float]:
    """User+system CPU seconds of each child so far (Linux /proc)."""
    out = {}
    tick = os.sysconf("SC_CLK_TCK")
    for name, child in sup.children.items():
        try:
            fields = Path(f"/proc/{child.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
            out[name] = (int(fields[11]) + int(fields[12])) / tick
        except (OSError, IndexError, ValueError, AttributeError):
            pass
    return out


def format_report(r: dict) -> str:
    load, rates, meas = r["load"], r["rates"], r["measured"]
    head = (
        f"replicated block index: {r['replicas']} kv-persistence replicas, {r['nats_servers']} nats-server(s), "
        f"{r['clients']} agents, {meas['elapsed_s']:.1f} s on {r['host_cpus']} CPUs (shared with the load driver)"
    )
    lines = [head, f"{'':24}{'required':>12}{'sustained':>12}{'ratio':>8}"]
    for label, key in (
        ("lookups/s", "lookups_per_s"),
        ("block commits/s", "block_commits_per_s"),
        ("commit requests/s", "commit_requests_per_s"),
    ):
        lines.append(f"{label:24}{load[key]:>12,.0f}{rates[key]:>12,.0f}{rates[key] / load[key]:>8.2f}")
    lines.append(
        f"headroom {r['headroom']:.2f}x ({'meets' if r['headroom_ok'] else 'below'} the 3x target); lookup p50 "
        f"{meas['lookup_p50_ms']:.1f} ms, p99 {meas['lookup_p99_ms']:.1f} ms; errors {meas['errors']}"
    )
    lines.append("CPU seconds: " + ", ".join(f"{k} {v:.1f}" for k, v in sorted(r["cpu_seconds"].items())))
    if r["replica_cores_for_load"]:
        lines.append(
            f"replica CPU per second of the full load: {r['replica_cores_for_load']:.1f} cores "
            f"(3x: {r['replica_cores_for_3x']:.1f} cores, spread over replicas on their own cores)"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``dualpath bench index [--replicas 2] [--clients 48] [--seconds 10] [--nats-cluster 1|3] [--json]``."""
    import argparse
    import json

    p = argparse.ArgumentParser(prog="dualpath bench index", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", type=int, default=2, help="kv-persistence replicas (default 2)")
    p.add_argument("--clients", type=int, default=48, help="concurrent agents driving the load (default 48)")
    p.add_argument("--seconds", type=float, default=10.0, help="measuring time (default 10)")
    p.add_argument("--nats-cluster", type=int, default=1, choices=(1, 3), help="nats-servers (3 = a JetStream cluster)")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    ns = p.parse_args(argv)
    if ns.replicas < 1 or ns.clients < 1 or ns.seconds <= 0:
        p.error("--replicas and --clients must be at least 1, --seconds positive")
    result = run_bench(replicas=ns.replicas, clients=ns.clients, seconds=ns.seconds, nats_cluster=ns.nats_cluster)
    print(json.dumps(result, indent=2) if ns.json else format_report(result))
    return 0
