"""``dualpath bench index``: can the replicated block index carry a 1,152-GPU cluster's load?

The load, from the paper's figures (PAPER.md, 64K set, online at scale: 44P88D at 8.8 agents
per second, 157 turns per agent, 429 tokens appended and 176 generated per turn, average
context 32,721 tokens, 64-token blocks), as the services send it:

- lookups: one ``LookupRequest`` per turn (the gateway's, before it submits), carrying the
  whole context's chain, 32,721 / 64 = 511 hashes packed as u64s: 8.8 x 157 = 1,382 messages
  per second;
- block commits: every block that fills, (429 + 176) / 64 = 9.45 per turn, 13,060 per second.
  They arrive as ``CommitRequest`` messages from the traffic managers, each carrying the
  parent hash and the new blocks: one for the prompt's new blocks when decoding starts
  (429 / 64 = 6.7 blocks on average) and one per generated block as it fills (176 / 64 =
  2.75 messages of 1 block), 3.75 commit messages per turn, 5,181 per second, a turn's
  commits in order (a block is committed after its parent).

The benchmark runs a real nats-server with JetStream (``--nats-cluster 3``: a 3-server
cluster, the stream on all three) and ``--replicas`` kv-persistence processes
(``--replication jetstream``, one queue group), indexes every agent's context, then runs
``--clients`` agents in a closed loop for ``--seconds``: each turn is one lookup of the last
511 blocks, then the prompt's commit, then the generated blocks' commits one by one, every
message a NATS request answered by whichever replica the queue group picks, a commit
answered once its stream record is stored and applied. It reports the rates sustained,
``headroom`` = the smallest of sustained / required over lookups, block commits and commit
messages, the CPU each process used while the agents ran (the warm-up left out), and how many
commits each stream record carried. Everything shares this host's cores with the load
driver (and on a shared machine with whatever else runs), so ``headroom`` is what this host
gave; ``per_replica_core`` turns the replicas' CPU time into the load one replica core
carries, and ``projected_headroom`` is the headroom of ``--replicas`` replicas with a core
each (nats-server's CPU per unit of load is reported beside it). A benchmark, not a test: it
prints what it measured.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["LOAD", "format_report", "run_bench"]

_BLOCK = 64
_APS, _TURNS, _APPEND, _GEN, _CONTEXT = 8.8, 157, 429, 176, 32_721
_TURNS_PER_S = _APS * _TURNS
LOAD: dict[str, Any] = {
    "source": "PAPER.md: 64K set, 44P88D online at 8.8 APS (the 1,152-GPU scale)",
    "lookups_per_s": _TURNS_PER_S,
    "block_commits_per_s": _TURNS_PER_S * (_APPEND + _GEN) / _BLOCK,
    "commit_requests_per_s": _TURNS_PER_S * (1 + _GEN / _BLOCK),
    "chain_blocks": _CONTEXT // _BLOCK,
    "per_turn": {
        "lookup_messages": 1,
        "hashes_per_lookup": _CONTEXT // _BLOCK,
        "prompt_commit_messages": 1,
        "prompt_blocks": _APPEND / _BLOCK,
        "generated_commit_messages": _GEN / _BLOCK,
        "blocks_per_generated_commit": 1,
        "hashes_per_commit": "the parent's + the new blocks'",
    },
}
_GRACE_S = 15.0  # how long the driver waits for answers still due when the measuring time is over


class _Agent:
    """One conversation's hash chain, grown turn by turn (fractional blocks carried over)."""

    def __init__(self, rng: random.Random, chain_blocks: int) -> None:
        self.rng = rng
        self.chain = [rng.getrandbits(63) | 1 for _ in range(chain_blocks)]
        self.prompt_due = rng.random()  # blocks owed, so that turns average 6.7 prompt and 2.75 generated blocks
        self.gen_due = rng.random()

    def new_block(self, keep: int) -> list[int]:
        """Append one block; return ``[parent, block]`` (the commit message's hashes)."""
        h = self.rng.getrandbits(63) | 1
        parent = self.chain[-1]
        self.chain.append(h)
        if len(self.chain) > 2 * keep:
            del self.chain[:-keep]
        return [parent, h]


class _Requests:
    """Request/reply over one wildcard reply subscription: a future per request, no timer each
    (answers still missing after the run are counted as errors)."""

    def __init__(self, nc) -> None:
        self.nc = nc
        self.prefix = nc.new_inbox()
        self._futures: dict[str, asyncio.Future[bytes]] = {}
        self._ids = itertools.count()

    async def start(self) -> None:
        await self.nc.subscribe(self.prefix + ".*", cb=self._on_reply)
        await self.nc.flush()

    async def _on_reply(self, msg) -> None:
        fut = self._futures.pop(msg.subject[len(self.prefix) + 1 :], None)
        if fut is not None and not fut.done():
            fut.set_result(msg.data)

    async def request(self, subject: str, payload: bytes) -> bytes:
        token = str(next(self._ids))
        fut: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self._futures[token] = fut
        await self.nc.publish(subject, payload, reply=f"{self.prefix}.{token}")
        return await fut

    def abandon(self) -> int:
        """Cancel every request still unanswered; returns how many there were."""
        left = [f for f in self._futures.values() if not f.done()]
        for fut in left:
            fut.cancel()
        self._futures.clear()
        return len(left)


async def _drive(
    url: str, namespace: str, *, clients: int, seconds: float, chain_blocks: int, seed: int, cpu: Callable[[], dict[str, float]]
) -> dict:
    """Index every agent's context (warm-up), then run the agents for ``seconds``; ``cpu()`` (CPU
    seconds per process) is read when the agents start and when the last one ended, so the
    figures leave out the warm-up and the connection set-up."""
    import nats

    from dualpath.kv import pack_hashes
    from dualpath.protocol import decode, encode
    from dualpath.protocol import messages as m
    from dualpath.protocol.subjects import Subjects

    subj = Subjects(namespace)
    nc = await nats.connect(url, max_reconnect_attempts=-1, pending_size=64 << 20)
    req = _Requests(nc)
    await req.start()
    rng = random.Random(seed)
    agents = [_Agent(rng, chain_blocks) for _ in range(clients)]
    digest = 0x5EED
    for a in agents:  # warm-up: each agent's context is indexed
        reply = await asyncio.wait_for(req.request(subj.kv_commit, encode(m.CommitRequest(model_digest=digest, hashes=a.chain))), 60)
        decode(reply, m.Ok)
    counts = {"lookups": 0, "commit_requests": 0, "block_commits": 0, "errors": 0, "hit_blocks": 0}
    latencies: list[float] = []
    stop_at = time.perf_counter() + seconds

    ok = encode(m.Ok())
    hit_of: dict[bytes, int] = {}  # LookupReply bytes -> hit_blocks: the driver shares the host, so it decodes each answer once

    async def commit(hashes: list[int]) -> None:
        answer = await req.request(subj.kv_commit, encode(m.CommitRequest(model_digest=digest, hashes=hashes, start=1)))
        if answer != ok:
            decode(answer, m.Ok)  # another form of Ok passes; an ErrorReply raises
        counts["commit_requests"] += 1
        counts["block_commits"] += len(hashes) - 1

    async def turn(a: _Agent) -> None:
        t0 = time.perf_counter()
        lookup = m.LookupRequest(model_digest=digest, hashes=pack_hashes(a.chain[-chain_blocks:]))  # packed, as the gateway sends
        raw = await req.request(subj.kv_lookup, encode(lookup))
        latencies.append(time.perf_counter() - t0)
        counts["lookups"] += 1
        hit = hit_of.get(raw)
        if hit is None:
            hit = hit_of[raw] = decode(raw, m.LookupReply).hit_blocks
        counts["hit_blocks"] += hit
        a.prompt_due += _APPEND / _BLOCK
        n, a.prompt_due = int(a.prompt_due), a.prompt_due % 1
        if n:
            first = a.new_block(chain_blocks)
            await commit(first + [a.new_block(chain_blocks)[1] for _ in range(n - 1)])
        a.gen_due += _GEN / _BLOCK
        n, a.gen_due = int(a.gen_due), a.gen_due % 1
        for _ in range(n):
            await commit(a.new_block(chain_blocks))

    async def run(a: _Agent) -> None:
        while time.perf_counter() < stop_at:
            try:
                await turn(a)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - an error reply or a bad answer: counted, the run goes on
                counts["errors"] += 1

    cpu0, t0 = cpu(), time.perf_counter()
    tasks = [asyncio.create_task(run(a)) for a in agents]  # awaited (or cancelled) right below
    done, late = await asyncio.wait(tasks, timeout=seconds + _GRACE_S)
    elapsed, cpu1 = time.perf_counter() - t0, cpu()
    unanswered = req.abandon()
    for task in late:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await nc.close()
    latencies.sort()
    return {
        "elapsed_s": elapsed,
        "cpu_s": {k: v - cpu0.get(k, 0.0) for k, v in cpu1.items()},
        **counts,
        "unanswered": unanswered,
        "lookup_p50_ms": 1000 * latencies[len(latencies) // 2] if latencies else None,
        "lookup_p99_ms": 1000 * latencies[int(len(latencies) * 0.99)] if latencies else None,
    }


def run_bench(
    *,
    replicas: int = 2,
    clients: int = 512,
    seconds: float = 10.0,
    nats_cluster: int = 1,
    seed: int = 0,
    chain_blocks: int = LOAD["chain_blocks"],
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
            cmd = [sys.executable, "-m", "services.kv_persistence", "--nats-url", url, "--namespace", namespace]
            cmd += ["--storage", str(run_dir / "storage"), "--replication", "jetstream", "--replica-id", str(i)]
            sup.add(f"kv-persistence-{i}", cmd, env)
        _wait_for_replicas(run_dir / "logs", replicas, sup)

        def cpu() -> dict[str, float]:
            return {**_cpu_seconds(sup), "driver": time.process_time()}

        measured = asyncio.run(
            _drive(specs[0].url, namespace, clients=clients, seconds=seconds, chain_blocks=chain_blocks, seed=seed, cpu=cpu)
        )
    except BaseException:
        print(f"dualpath bench index: failed; logs kept in {run_dir / 'logs'}", file=sys.stderr)
        raise
    finally:
        sup.stop([n for n in sup.children if n.startswith("kv-")], 10.0)
        sup.stop(list(sup.children), 5.0)
    grouping = _grouping(run_dir / "logs", replicas)
    shutil.rmtree(run_dir, ignore_errors=True)  # the stream's files: nothing to keep after a run that worked
    cpu_s = measured.pop("cpu_s")
    driver_cpu = cpu_s.pop("driver")
    report = _report(measured, cpu_s, driver_cpu, replicas, nats_cluster, clients)
    report["stream_records"] = grouping
    return report


def _grouping(logs: Path, replicas: int) -> dict[str, float | int | None]:
    """Stream records the replicas published over the whole run (warm-up included) and the
    commits they carried, from each replica's ``index_closed`` log line."""
    records = ops = 0
    for i in range(replicas):
        try:
            lines = (logs / f"kv-persistence-{i}.log").read_text(errors="replace").splitlines()
        except OSError:
            continue
        for line in reversed(lines):
            if '"index_closed"' in line:
                try:
                    event = json.loads(line)
                    records, ops = records + int(event["records"]), ops + int(event["ops"])
                except (ValueError, KeyError, TypeError):
                    pass
                break
    return {"records": records, "ops": ops, "ops_per_record": ops / records if records else None}


def _report(measured: dict, cpu: dict[str, float], driver_cpu: float, replicas: int, nats_cluster: int, clients: int) -> dict:
    t = measured["elapsed_s"]
    keys = ("lookups_per_s", "block_commits_per_s", "commit_requests_per_s")
    rates = {
        "lookups_per_s": measured["lookups"] / t,
        "block_commits_per_s": measured["block_commits"] / t,
        "commit_requests_per_s": measured["commit_requests"] / t,
    }
    ratios = {k: rates[k] / LOAD[k] for k in keys}
    headroom = min(ratios.values())
    # Seconds of the full load the run carried (its mix is the load's, so the ratios agree up to
    # the turns in progress at the end); CPU per such second is the cores the load needs.
    load_seconds = t * headroom
    replica_cpu = sum(v for k, v in cpu.items() if k.startswith("kv-"))
    nats_cpu = sum(v for k, v in cpu.items() if k.startswith("nats"))
    replica_cores = replica_cpu / load_seconds if load_seconds else None
    requests = measured["lookups"] + measured["commit_requests"]
    per_core = 1 / replica_cores if replica_cores else None
    return {
        "load": LOAD,
        "model": (
            "per turn: 1 lookup message of 511 hashes; 1 commit message of the prompt's new blocks (6.7 on average) and "
            "2.75 of 1 generated block each, every commit carrying the parent hash and its new blocks; closed loop, "
            "turns of one agent in order"
        ),
        "measured": measured,
        "rates": rates,
        "ratios": ratios,
        "headroom": headroom,
        "headroom_ok": headroom >= 3.0,
        "replicas": replicas,
        "nats_servers": nats_cluster,
        "clients": clients,
        "host_cpus": os.cpu_count(),
        "host_load_avg_1m": os.getloadavg()[0],
        "cpu_seconds": {**cpu, "driver": driver_cpu},
        "cores_used": {k: v / t for k, v in {**cpu, "driver": driver_cpu}.items()},
        "replica_cores_for_load": replica_cores,
        "replica_cores_for_3x": 3 * replica_cores if replica_cores else None,
        "nats_cores_for_load": nats_cpu / load_seconds if load_seconds else None,
        "per_replica_core": {
            "headroom": per_core,
            "lookups_per_s": per_core * LOAD["lookups_per_s"] if per_core else None,
            "block_commits_per_s": per_core * LOAD["block_commits_per_s"] if per_core else None,
            "commit_requests_per_s": per_core * LOAD["commit_requests_per_s"] if per_core else None,
        },
        "projected_headroom": replicas * per_core if per_core else None,
        # all replicas' CPU over every request they answered (lookups and commit messages alike,
        # stream records applied on every replica included): what one request costs the index
        "replica_cpu_us_per_request": 1e6 * replica_cpu / requests if requests else None,
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
        f"{r['clients']} agents, {meas['elapsed_s']:.1f} s on {r['host_cpus']} CPUs (load average {r['host_load_avg_1m']:.1f}, "
        "shared with the load driver)"
    )
    lines = [head, f"{'':24}{'required':>12}{'sustained':>12}{'ratio':>8}"]
    for label, key in (
        ("lookups/s", "lookups_per_s"),
        ("block commits/s", "block_commits_per_s"),
        ("commit requests/s", "commit_requests_per_s"),
    ):
        lines.append(f"{label:24}{load[key]:>12,.0f}{rates[key]:>12,.0f}{rates[key] / load[key]:>8.2f}")
    p50, p99 = meas["lookup_p50_ms"] or 0.0, meas["lookup_p99_ms"] or 0.0
    lines.append(
        f"headroom {r['headroom']:.2f}x on this host ({'meets' if r['headroom_ok'] else 'below'} the 3x target); lookup p50 "
        f"{p50:.1f} ms, p99 {p99:.1f} ms; errors {meas['errors']}, unanswered {meas['unanswered']}"
    )
    lines.append("cores used: " + ", ".join(f"{k} {v:.2f}" for k, v in sorted(r["cores_used"].items())))
    if r["replica_cores_for_load"]:
        pc = r["per_replica_core"]
        lines.append(
            f"one replica core carries {pc['headroom']:.2f}x the load ({pc['lookups_per_s']:,.0f} lookups/s with "
            f"{pc['block_commits_per_s']:,.0f} block commits/s); {r['replicas']} replicas with a core each: "
            f"{r['projected_headroom']:.2f}x (nats-server: {r['nats_cores_for_load']:.2f} cores per load); "
            f"{r['replica_cpu_us_per_request']:.0f} us of replica CPU per request"
        )
    g = r.get("stream_records") or {}
    if g.get("records"):
        lines.append(f"stream records: {g['records']:,} carrying {g['ops']:,} commits ({g['ops_per_record']:.1f} per record)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``dualpath bench index [--replicas 2] [--clients 512] [--seconds 10] [--nats-cluster 1|3] [--json]``."""
    import argparse

    p = argparse.ArgumentParser(prog="dualpath bench index", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", type=int, default=2, help="kv-persistence replicas (default 2)")
    p.add_argument(
        "--clients",
        type=int,
        default=512,
        help="concurrent agents driving the load, closed loop (default 512; at 8.8 APS with ~1,000 s per trajectory the "
        "paper's cluster has thousands of agents, and 256 left the loop bound by latency, not by the index's CPU)",
    )
    p.add_argument("--seconds", type=float, default=10.0, help="measuring time (default 10)")
    p.add_argument("--nats-cluster", type=int, default=1, choices=(1, 3), help="nats-servers (3 = a JetStream cluster)")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    ns = p.parse_args(argv)
    if ns.replicas < 1 or ns.clients < 1 or ns.seconds <= 0:
        p.error("--replicas and --clients must be at least 1, --seconds positive")
    result = run_bench(replicas=ns.replicas, clients=ns.clients, seconds=ns.seconds, nats_cluster=ns.nats_cluster)
    print(json.dumps(result, indent=2) if ns.json else format_report(result))
    return 0
