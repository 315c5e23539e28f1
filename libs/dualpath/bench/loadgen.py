"""Benchmark: how much latency does the load generator itself add to measured TTFT?

Method. An instant server (``loadgen.instant_server``) runs in its own process and, for
every request, stamps on ``CLOCK_MONOTONIC`` (one clock for every process on the host)
``recv``, when the request's last byte reached it, and ``sent``, just before it hands the
first token to the kernel; it returns both in its ``Server-Timing`` header. The client
stamps ``send`` just before writing the request and ``first`` when the first token
reaches it. So a turn's TTFT splits into

* send leg ``recv - send``: the client's write, kernel transit, the *server's* wake-up;
* server time ``sent - recv`` (the server's own work and pacing: not client overhead);
* receive leg ``first - sent``: kernel transit, the client's wake-up, and the time the
  client's event loop spent on other agents' data before this one's. This is where a
  busy load generator would hurt, and it bounds the error it adds on the receive side.

*Added latency* = send leg + receive leg = TTFT - server time. To separate what the
host costs any client from what the load generator costs, a probe process sends one
minimal request every ``probe_interval_s`` (from several connections when the server is
slow to answer) over raw asyncio sockets with prebuilt bytes, and measures the same legs
at the same moments. **Overhead** = load generator's added latency - probe's, over the
same time window.

Phases: *idle*, the load generator with one agent (fast transport, then httpx for
comparison) against a server that answers at once: the per-request cost of each client.
*Load*: ``agents`` agents arrive over one turn's duration and run their turns back to back
against a server paced like a real one (``ttft_s`` before the first token, ``tpot_s``
between tokens), so all of them are active at once; figures cover the steady window
(every agent launched, none finished). The probe sleeps between requests while the load
generator is busy, so the probe pays wake-up costs the load generator often does not:
on a small VM the idle overhead can come out negative. The receive leg is reported too
because it needs no probe.

``--processes N`` spreads the load phase's agents over N client processes (each a share of
the agents and of the arrival rate, against the one server), merged into one report: turns,
agents and loop lag of all of them, their CPU time summed. The report's top-level keys are
the contract: ``agents``, ``added_p50_ms`` and ``added_p99_ms`` (the load generator's added
latency under load, steady window), ``overhead_p50_ms`` (less the probe's),
``agents_per_core`` (agents over the client processes' CPU cores used), ``processes``;
``meets_aim`` says whether the added latency and the agents per core meet the aim at the
paper's online scale (``AIM_*``), ``meets_target`` whether the overhead over the probe is
under ``target_ms`` (the exit status).

    dualpath bench loadgen --agents 14000 --processes 2 --json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from types import SimpleNamespace
from typing import Any, cast
from urllib.parse import urlsplit

import anyio
import numpy as np

from loadgen.arrivals import arrival_times
from loadgen.client import Endpoint
from loadgen.instant_server import start_instant_server
from loadgen.prompts import PromptText
from loadgen.report import AgentRecord, LogHistogram, TurnRecord
from loadgen.runner import LoadSpec, RunState, run_load
from loadgen.trajectory import Trajectory

__all__ = ["run_overhead_bench", "main"]

# The aim at the paper's online scale (14,000 agents): what the load generator adds to a
# turn's TTFT, and the agents one core of it drives.
AIM_ADDED_P50_MS, AIM_ADDED_P99_MS, AIM_AGENTS_PER_CORE = 1.0, 5.0, 5000.0


def _ms(values: list[float]) -> dict:
    if not values:
        return {"n": 0}
    a = np.asarray(values) * 1000
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {"n": len(a), "p50": float(p50), "p90": float(p90), "p99": float(p99), "mean": float(a.mean())}


def _timing(server_timing: str | None) -> tuple[float, float, float] | None:
    """(proc, recv, sent) in seconds from an instant server's Server-Timing header."""
    if not server_timing or 'recv;desc="' not in server_timing:
        return None
    recv = int(server_timing.split('recv;desc="', 1)[1].split('"', 1)[0]) / 1e9
    sent = int(server_timing.split('sent;desc="', 1)[1].split('"', 1)[0]) / 1e9
    return sent - recv, recv, sent


async def _probe_connection(url: str, period_s: float, offset_s: float) -> None:
    parts = urlsplit(url)
    await asyncio.sleep(offset_s)
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    body = json.dumps({"model": "probe", "prompt": " probe", "max_tokens": 1, "stream": True}).encode()
    request = (
        f"POST /v1/completions HTTP/1.1\r\nhost: {parts.netloc}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
    ).encode() + body
    while True:
        t_send = time.monotonic()
        writer.write(request)
        buf, t_first = b"", None
        while not buf.endswith(b"\r\n0\r\n\r\n"):
            data = await reader.read(65536)
            now = time.monotonic()
            if not data:
                return
            buf += data
            if t_first is None and b"data: {" in buf:
                t_first = now
        _, recv, sent = cast("tuple[float, float, float]", _timing(buf.split(b"server-timing:", 1)[1].split(b"\r\n", 1)[0].decode()))
        print(json.dumps([t_send, recv - t_send, cast(float, t_first) - sent]), flush=True)
        await asyncio.sleep(max(0.0, t_send + period_s - time.monotonic()))


async def _probe(url: str, interval_s: float, connections: int) -> None:
    """Probe: ``connections`` staggered loops, one request per ``interval_s`` in all.

    Prints ``[send, send_leg, receive_leg]`` (seconds) per answered request.
    """
    async with anyio.create_task_group() as group:
        for i in range(connections):
            group.start_soon(_probe_connection, url, interval_s * connections, i * interval_s)


def _start_probe(url: str, interval_s: float, connections: int, sink) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "dualpath.bench.loadgen",
        "--probe",
        url,
        "--probe-interval",
        str(interval_s),
        "--probe-connections",
        str(connections),
    ]
    return subprocess.Popen(cmd, stdout=sink, stderr=subprocess.DEVNULL)


def _window(samples: list[tuple[float, float, float]], lo: float, hi: float) -> dict:
    """Probe legs (and their sum) for samples sent within [lo, hi]."""
    rows = [(a, b) for t, a, b in samples if lo <= t <= hi]
    return {"added": [a + b for a, b in rows], "send": [a for a, _ in rows], "receive": [b for _, b in rows]}


async def _loadgen(
    url: str,
    *,
    agents: int,
    turns: int,
    gen: int,
    rate: float | None,
    transport: str,
    prompts: PromptText,
    seed: int,
    first_id: int = 0,
) -> RunState:
    trajectories = tuple(
        Trajectory(id=str(first_id + i), system_tokens=64, append_tokens=(32,) * turns, gen_tokens=(gen,) * turns) for i in range(agents)
    )
    arrivals = arrival_times(agents, rate=rate, seed=seed)
    spec = LoadSpec(
        endpoint=Endpoint.parse(url, chat=False, model="instant", timeout_s=120.0),
        trajectories=trajectories,
        arrivals=tuple(arrivals.tolist()),
        offline=rate is None,
        transport=transport,
        text_seed=seed,
        max_errors=max(20, agents),
    )
    state = RunState()
    await run_load(spec, prompts, state)
    return state


def _state_to_json(state: RunState, cpu_s: float) -> dict:
    """What a worker process measured, with absolute CLOCK_MONOTONIC times (one clock for every
    process on the host), for the parent to merge."""
    t0 = state.t0
    return {
        "cpu_s": cpu_s,
        "t0": t0,
        "wall_s": state.wall_s,
        "max_active": state.max_active,
        "errors": state.errors,
        "first_error": state.first_error,
        "lag_counts": state.loop_lag.counts.tolist(),
        "lag_max": state.loop_lag.max,
        "turns": [[t0 + t.t_start, t.error_kind, t.ttft, t.server_timing, t.completion_tokens] for t in state.turns],
        "agents": [[t0 + a.started, t0 + a.ended, a.status] for a in state.agents],
    }


def _merge(parts: list[dict]) -> SimpleNamespace:
    """The workers' runs as one run (the attributes ``_load_figures`` reads), from the
    earliest start to the latest end; ``max_active`` adds the workers' maxima."""
    t0 = min(p["t0"] for p in parts)
    end = max(p["t0"] + (p["wall_s"] or 0.0) for p in parts)
    lag = LogHistogram()
    for p in parts:
        lag.counts += np.asarray(p["lag_counts"], dtype=np.int64)
        lag.max = max(lag.max, p["lag_max"])
    turns = [
        TurnRecord(
            agent=0,
            turn=0,
            t_start=send - t0,
            expected_prompt_tokens=0,
            expected_gen_tokens=0,
            error_kind=kind,
            ttft=ttft,
            server_timing=timing,
            completion_tokens=tokens,
        )
        for p in parts
        for send, kind, ttft, timing, tokens in p["turns"]
    ]
    agents = [
        AgentRecord(agent=0, scheduled=0.0, started=start - t0, ended=stop - t0, turns_done=0, turns_total=0, status=status)
        for p in parts
        for start, stop, status in p["agents"]
    ]
    first_error = next((p["first_error"] for p in parts if p["first_error"]), None)
    return SimpleNamespace(
        t0=t0,
        wall_s=end - t0,
        turns=turns,
        agents=agents,
        max_active=sum(p["max_active"] for p in parts),
        errors=sum(p["errors"] for p in parts),
        first_error=first_error,
        loop_lag=lag,
    )


def _worker_cmd(url: str, agents: int, turns: int, gen: int, rate: float | None, seed: int, first_id: int) -> list[str]:
    cmd = [sys.executable, "-m", "dualpath.bench.loadgen", "--worker", url, "--agents", str(agents), "--turns", str(turns)]
    cmd += ["--gen-tokens", str(gen), "--seed", str(seed), "--first-id", str(first_id)]
    return cmd + (["--rate", repr(rate)] if rate is not None else [])


def _run_workers(
    url: str, *, agents: int, processes: int, turns: int, gen: int, rate: float | None, seed: int
) -> tuple[SimpleNamespace, float]:
    """The load phase over ``processes`` client processes: their merged run and summed CPU seconds.

    Raises:
        RuntimeError: a worker failed (its last output included).
    """
    shares = [agents // processes + (1 if i < agents % processes else 0) for i in range(processes)]
    procs, first = [], 0
    for i, n in enumerate(shares):
        share_rate = None if rate is None else rate * n / agents
        cmd = _worker_cmd(url, n, turns, gen, share_rate, seed + 100 * i, first)
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        first += n
    parts = []
    for proc in procs:
        out, err = proc.communicate()
        if proc.returncode != 0:
            raise RuntimeError(f"load generator worker failed ({proc.returncode}): {err.strip()[-800:]}")
        parts.append(json.loads(out))
    return _merge(parts), sum(p["cpu_s"] for p in parts)


def _legs(state: RunState, lo: float = -np.inf, hi: float = np.inf) -> dict:
    """Added latency and its legs (seconds) of the turns sent within [lo, hi]."""
    out: dict[str, list[float]] = {"added": [], "send": [], "receive": []}
    for t in state.turns:
        timing = _timing(t.server_timing)
        send = state.t0 + t.t_start
        if t.ok and t.ttft is not None and timing is not None and lo <= send <= hi:
            proc, recv, sent = timing
            out["added"].append(t.ttft - proc)
            out["send"].append(recv - send)
            out["receive"].append(send + t.ttft - sent)
    return out


def _compare(loadgen: dict, probe: dict) -> dict:
    """Per leg: loadgen and probe distributions (ms) and the overhead (difference)."""
    out = {}
    for leg in ("added", "send", "receive"):
        lg, pr = _ms(loadgen[leg]), _ms(probe[leg])
        out[leg] = {
            "loadgen_ms": lg,
            "probe_ms": pr,
            "overhead_ms": {k: lg[k] - pr[k] for k in ("p50", "p90", "p99", "mean")} if lg["n"] and pr["n"] else {},
        }
    return out


class _Phase:
    """An instant server with a probe next to it; collects the probe's samples."""

    def __init__(self, probe_interval_s: float, **server: float) -> None:
        self.interval, self.server_options = probe_interval_s, server
        # Enough probe connections that one request leaves every interval even when the
        # server holds each answer for ttft_s.
        self.connections = 1 + int(server.get("ttft_s", 0.0) / probe_interval_s) + 1
        self.samples: list[tuple[float, float, float]] = []

    def __enter__(self) -> str:
        self.server = start_instant_server(**self.server_options)
        self.sink = tempfile.TemporaryFile("w+")
        self.probe = _start_probe(self.server.url, self.interval, self.connections, self.sink)
        time.sleep(1.0)  # let the probe connect and settle
        return self.server.url

    def server_cpu_s(self) -> float | None:
        """CPU seconds the server process has used so far (None off Linux)."""
        try:
            with open(f"/proc/{self.server.proc.pid}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            return None
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime

    def __exit__(self, *exc: object) -> None:
        self.probe.send_signal(signal.SIGTERM)
        self.probe.wait(10)
        self.server.stop()
        self.sink.seek(0)
        self.samples = [tuple(json.loads(line)) for line in self.sink if line.startswith("[")]
        self.sink.close()


def run_overhead_bench(
    agents: int = 1000,
    *,
    turns: int = 6,
    gen_tokens: int = 16,
    ttft_s: float = 0.5,
    tpot_s: float = 0.05,
    idle_turns: int = 1000,
    probe_interval_s: float = 0.02,
    compare_httpx: bool = True,
    seed: int = 0,
    target_ms: float = 1.0,
    processes: int = 1,
) -> dict:
    """Run the benchmark described in the module docstring and return its figures (ms).

    ``meets_target``: under load, the overhead's p50 and mean are below ``target_ms``, no
    turn failed, and at least min(agents, 1000) agents were active at once. ``meets_aim``: the
    added latency itself (what the client and the host add, the probe not subtracted) has p50
    below ``AIM_ADDED_P50_MS`` and p99 below ``AIM_ADDED_P99_MS``, with at least
    ``AIM_AGENTS_PER_CORE`` agents per core of the client and no turn failed. ``processes``
    spreads the load phase's agents over that many client processes (module docstring).

    Raises:
        RuntimeError: the instant server or the probe cannot be started, or a worker failed.
        ValueError: ``processes`` below 1 or above ``agents``.
    """
    if not 1 <= processes <= max(1, agents):
        raise ValueError(f"processes must be between 1 and the number of agents ({agents}), got {processes}")
    prompts = PromptText()
    loadavg_before = list(os.getloadavg())
    idle_phase = _Phase(probe_interval_s)  # answers at once: per-request cost only
    with idle_phase as url:
        idle = anyio.run(lambda: _loadgen(url, agents=1, turns=idle_turns, gen=1, rate=None, transport="fast", prompts=prompts, seed=seed))
        httpx_idle = None
        if compare_httpx:
            httpx_idle = anyio.run(
                lambda: _loadgen(url, agents=1, turns=idle_turns, gen=1, rate=None, transport="httpx", prompts=prompts, seed=seed + 1)
            )
    load_phase = _Phase(probe_interval_s, ttft_s=ttft_s, tpot_s=tpot_s)
    with load_phase as url:
        turn_s = ttft_s + gen_tokens * tpot_s
        rate = agents / turn_s if turn_s > 0 else None  # arrivals spread over one turn
        cpu0, server0 = time.process_time(), load_phase.server_cpu_s()
        load: Any
        if processes == 1:
            load = anyio.run(
                lambda: _loadgen(
                    url, agents=agents, turns=turns, gen=gen_tokens, rate=rate, transport="fast", prompts=prompts, seed=seed + 2
                )
            )
            cpu = time.process_time() - cpu0
        else:
            load, cpu = _run_workers(url, agents=agents, processes=processes, turns=turns, gen=gen_tokens, rate=rate, seed=seed + 2)
        server1 = load_phase.server_cpu_s()
        server_cpu = None if server0 is None or server1 is None else server1 - server0
    config = dict(
        agents=agents,
        turns=turns,
        gen_tokens=gen_tokens,
        server_ttft_s=ttft_s,
        server_tpot_s=tpot_s,
        idle_turns=idle_turns,
        probe_interval_s=probe_interval_s,
        seed=seed,
        processes=processes,
    )
    result: dict[str, Any] = {
        "method": "legs from CLOCK_MONOTONIC stamps of client and server; overhead = load generator's "
        "added latency - a raw-socket probe's, same server, same window (see dualpath.bench.loadgen)",
        "config": config,
        "host": {"cpus": os.cpu_count(), "loadavg_before": loadavg_before, "loadavg_after": list(os.getloadavg())},
        "idle": _idle_figures(idle, httpx_idle, idle_phase.samples),
        "load": _load_figures(load, load_phase.samples, cpu, server_cpu),
    }
    overhead = result["load"]["legs"]["added"]["overhead_ms"]
    added = result["load"]["legs"]["added"]["loadgen_ms"]
    cores = result["load"]["client_cpu_share"]
    result.update(
        agents=agents,
        processes=processes,
        added_p50_ms=added.get("p50"),
        added_p99_ms=added.get("p99"),
        overhead_p50_ms=overhead.get("p50"),
        client_cores=cores,
        agents_per_core=agents / cores if cores > 0 else None,
    )
    result["target_ms"] = target_ms
    result["meets_target"] = (
        bool(overhead)
        and overhead["p50"] < target_ms
        and overhead["mean"] < target_ms
        and load.errors == 0
        and load.max_active >= min(1000, agents)
    )
    result["meets_aim"] = (
        result["added_p50_ms"] is not None
        and result["added_p50_ms"] < AIM_ADDED_P50_MS
        and result["added_p99_ms"] < AIM_ADDED_P99_MS
        and (result["agents_per_core"] or 0.0) >= AIM_AGENTS_PER_CORE
        and load.errors == 0
    )
    return result


def _state_window(state: RunState) -> tuple[float, float]:
    return state.t0, state.t0 + (state.wall_s or 0.0)


def _idle_figures(idle: RunState, httpx_idle: RunState | None, samples: list) -> dict:
    out = {"fast": _compare(_legs(idle), _window(samples, *_state_window(idle)))}
    if httpx_idle is not None:
        out["httpx"] = _compare(_legs(httpx_idle), _window(samples, *_state_window(httpx_idle)))
    return out


def _load_figures(load: Any, samples: list, cpu_s: float, server_cpu_s: float | None) -> dict:
    """``load``: a ``RunState``, or the workers' merged run (``_merge``)."""
    starts = [load.t0 + a.started for a in load.agents]
    ends = [load.t0 + a.ended for a in load.agents if a.status == "done"]
    lo, hi = max(starts, default=load.t0), min(ends, default=load.t0)
    if hi <= lo:  # no steady window (very short turns): use the whole run
        lo, hi = _state_window(load)
    grid = np.linspace(lo, hi, 200)
    active = [sum(1 for a in load.agents if load.t0 + a.started <= t < load.t0 + a.ended) for t in grid]
    done = [t for t in load.turns if t.ok]
    wall = load.wall_s or 1e-9
    lag = {k: (v * 1000 if k != "n" and v is not None else v) for k, v in load.loop_lag.summary().items()}
    return {
        "window_s": hi - lo,
        "active_sessions": {"max": load.max_active, "mean_in_window": float(np.mean(active))},
        "turns": len(done),
        "errors": load.errors,
        "first_error": load.first_error,
        "requests_per_s": len(done) / wall,
        "tokens_per_s": sum(t.completion_tokens or 0 for t in done) / wall,
        "client_cpu_share": cpu_s / wall,
        "loop_lag_ms": lag,
        "server_cpu_share": None if server_cpu_s is None else server_cpu_s / wall,
        "legs": _compare(_legs(load, lo, hi), _window(samples, lo, hi)),
    }


def main(argv: list[str] | None = None) -> int:
    """``python -m dualpath.bench.loadgen``: run the benchmark and print its JSON (or run a probe)."""
    p = argparse.ArgumentParser(prog="python -m dualpath.bench.loadgen", description=__doc__.split("\n")[0])
    p.add_argument("--agents", type=int, default=1000, help="concurrent agent sessions")
    p.add_argument("--turns", type=int, default=6, help="turns per agent")
    p.add_argument("--gen-tokens", type=int, default=16, help="tokens per answer")
    p.add_argument("--ttft", type=float, default=0.5, help="server delay before the first token, s")
    p.add_argument("--tpot", type=float, default=0.05, help="server delay between tokens, s")
    p.add_argument("--no-httpx", action="store_true", help="skip the httpx comparison")
    p.add_argument("--processes", type=int, default=1, help="client processes the load phase's agents are spread over")
    p.add_argument("--json", action="store_true", help="print the whole report as JSON (default: the headline figures)")
    p.add_argument("--worker", help=argparse.SUPPRESS)  # internal: run one share of the load against this URL
    p.add_argument("--rate", type=float, default=None, help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--first-id", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--probe", help=argparse.SUPPRESS)  # internal: run as the probe process
    p.add_argument("--probe-interval", type=float, default=0.02, help="seconds between probe requests")
    p.add_argument("--probe-connections", type=int, default=1, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.probe:
        signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
        anyio.run(_probe, a.probe, a.probe_interval, a.probe_connections)
        return 0
    if a.worker:
        cpu0 = time.process_time()
        state = anyio.run(
            lambda: _loadgen(
                a.worker,
                agents=a.agents,
                turns=a.turns,
                gen=a.gen_tokens,
                rate=a.rate,
                transport="fast",
                prompts=PromptText(),
                seed=a.seed,
                first_id=a.first_id,
            )
        )
        print(json.dumps(_state_to_json(state, time.process_time() - cpu0)))
        return 0
    try:
        result = run_overhead_bench(
            a.agents,
            turns=a.turns,
            gen_tokens=a.gen_tokens,
            ttft_s=a.ttft,
            tpot_s=a.tpot,
            probe_interval_s=a.probe_interval,
            compare_httpx=not a.no_httpx,
            processes=a.processes,
        )
    except (RuntimeError, ValueError) as exc:
        print(f"dualpath bench loadgen: {exc}", file=sys.stderr)
        return 2
    if a.json:
        print(json.dumps(result, indent=2))
    else:
        print(_headline(result))
    return 0 if result["meets_target"] else 1


def _headline(r: dict) -> str:
    def ms(v: float | None) -> str:
        return "n/a" if v is None else f"{v:.2f} ms"

    per_core = "n/a" if r["agents_per_core"] is None else f"{r['agents_per_core']:,.0f}"
    load = r["load"]
    return "\n".join(
        [
            f"load generator: {r['agents']:,} agents in {r['processes']} process(es), {load['active_sessions']['max']:,} active at most, "
            f"{load['turns']:,} turns, {load['errors']} errors",
            f"added latency (TTFT less server time): p50 {ms(r['added_p50_ms'])}, p99 {ms(r['added_p99_ms'])}; "
            f"over the probe: p50 {ms(r['overhead_p50_ms'])}",
            f"client CPU {r['client_cores']:.2f} cores -> {per_core} agents per core; server {load['server_cpu_share'] or 0:.2f} cores",
            f"meets the {r['target_ms']} ms overhead target (over the probe): {r['meets_target']}; "
            f"meets the aim (added p50 < {AIM_ADDED_P50_MS:g} ms, p99 < {AIM_ADDED_P99_MS:g} ms, "
            f">= {AIM_AGENTS_PER_CORE:,.0f} agents per core): {r['meets_aim']}",
        ]
    )


if __name__ == "__main__":
    raise SystemExit(main())
