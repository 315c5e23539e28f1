"""``dualpath experiment soak``: serve agents for M minutes while killing a random process every S seconds.

A redundant stack (``--replicas 2``: two schedulers on the lease, two kv-persistence replicas;
its supervisor restarts whatever dies) serves ``--agents`` concurrent agents, each running
multi-turn conversations back to back (token-id prompts that grow by ``--turn-tokens`` per
turn, greedy, ``--max-tokens`` per answer). Every ``--kill-every`` seconds one process of a
random kind (engine, traffic manager, scheduler, kv-persistence replica) gets SIGKILL.

Each request ends one of three ways: *completed* (HTTP 200 and every token), *failed* with an
explicit error (an HTTP error status), or *lost* (no answer: the client gave up after
``--client-timeout`` or the connection broke). After the run every completed prompt is asked
again on the undisturbed stack; answers that differ are *mismatched*. SLO attainment (TTFT and
TPOT) is computed over the requests that started outside the fault windows (``--fault-window``
seconds after each kill). Exit status 0 when nothing is lost or mismatched.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field

import httpx

__all__ = ["main", "run_soak"]

KINDS = {
    "engine": ("prefill-", "decode-"),
    "traffic-manager": ("traffic-manager-",),
    "scheduler": ("scheduler",),
    "kv-persistence": ("kv-persistence",),
}


@dataclass(slots=True)
class Outcome:
    prompt: list[int]
    started: float  # seconds since the soak began
    status: str = "lost"  # completed | failed | lost
    text: str = ""
    error: str = ""
    ttft_s: float | None = None
    tpot_s: float | None = None


@dataclass(slots=True)
class Soak:
    url: str
    model: str
    max_tokens: int
    turns: int
    turn_tokens: int
    client_timeout: float
    t0: float = field(default_factory=time.monotonic)
    outcomes: list[Outcome] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def ask(self, http: httpx.Client, prompt: list[int]) -> Outcome:
        out = Outcome(prompt=prompt, started=time.monotonic() - self.t0)
        with self.lock:
            self.outcomes.append(out)
        body = {"model": self.model, "prompt": prompt, "max_tokens": self.max_tokens, "temperature": 0, "ignore_eos": True}
        t = time.monotonic()
        try:
            r = http.post("/v1/completions", json=body, timeout=self.client_timeout)
        except httpx.HTTPError as exc:
            out.error = f"{type(exc).__name__}: {exc}"
            return out  # lost: no answer at all
        elapsed = time.monotonic() - t
        try:
            data = r.json()
        except ValueError:
            data = {}
        if r.status_code != 200:
            out.status, out.error = "failed", f"HTTP {r.status_code}: {str(data)[:200]}"
            return out
        n = data.get("usage", {}).get("completion_tokens", 0)
        if n != self.max_tokens:
            out.status, out.error = "failed", f"{n} of {self.max_tokens} tokens ({data['choices'][0].get('finish_reason')})"
            return out
        info = data.get("dualpath", {})
        out.status, out.text = "completed", data["choices"][0]["text"]
        out.ttft_s = (info.get("ttft_queue_s") or 0.0) + (info.get("ttft_exec_s") or 0.0)
        out.tpot_s = max(0.0, elapsed - out.ttft_s) / max(1, n - 1)
        return out

    def agent(self, seed: int, until: float, vocab: int) -> None:
        rng = random.Random(seed)
        with httpx.Client(base_url=self.url) as http:
            while time.monotonic() < until:
                prompt: list[int] = []
                for _ in range(self.turns):
                    if time.monotonic() >= until:
                        return
                    prompt = prompt + [rng.randrange(3, vocab) for _ in range(self.turn_tokens)]
                    self.ask(http, prompt)


def _killer(stack, every: float, until: float, kinds: list[str], rng: random.Random, t0: float, kills: list[dict]) -> None:
    while True:
        time.sleep(every)
        if time.monotonic() >= until:
            return
        kind = rng.choice(kinds)
        names = [n for n, p in stack.procs if n.startswith(KINDS[kind]) and p.poll() is None]
        if not names:
            continue
        name = rng.choice(sorted(names))
        try:
            os.kill(stack.pid(name), signal.SIGKILL)
        except (KeyError, ProcessLookupError):
            continue
        kills.append({"t": round(time.monotonic() - t0, 2), "kind": kind, "process": name})


def run_soak(ns: argparse.Namespace, say=lambda _m: None) -> dict:
    """Run the soak the flags describe; returns the report (see the module docstring)."""
    from dualpath.bus.embedded import free_port
    from dualpath.cli.launcher.stack import Stack, StackConfig
    from dualpath.cli.launcher.topology import parse_topology
    from dualpath.cli.launcher.up import ensure_model

    run_dir = ns.run_dir or tempfile.mkdtemp(prefix="dualpath-soak-")
    model = ensure_model("", run_dir)
    cfg = StackConfig(
        model=model,
        topology=parse_topology(ns.topology),
        storage=os.path.join(run_dir, "storage"),
        run_dir=run_dir,
        port=free_port(),
        replicas=ns.replicas,
        nats_cluster=ns.nats_cluster,
        buffer_mb=64,
        extra_env={"DUALPATH_REQUEST_TIMEOUT": str(ns.client_timeout / 2)},
    )
    stack = Stack(cfg).start(timeout=180, progress=say)
    try:
        with open(os.path.join(model, "config.json")) as f:
            vocab = json.load(f)["vocab_size"]
        name = httpx.get(stack.url + "/v1/models", timeout=10).json()["data"][0]["id"]
        soak = Soak(
            url=stack.url,
            model=name,
            max_tokens=ns.max_tokens,
            turns=ns.turns,
            turn_tokens=ns.turn_tokens,
            client_timeout=ns.client_timeout,
        )
        until = soak.t0 + 60 * ns.minutes
        kills: list[dict] = []
        rng = random.Random(ns.seed)
        threads = [threading.Thread(target=soak.agent, args=(ns.seed * 1000 + i, until, vocab), daemon=True) for i in range(ns.agents)]
        threads.append(threading.Thread(target=_killer, args=(stack, ns.kill_every, until, ns.kinds, rng, soak.t0, kills), daemon=True))
        say(f"soak: {ns.agents} agents for {ns.minutes} min, a kill every {ns.kill_every}s")
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        say("soak over; asking every completed prompt again on the undisturbed stack")
        time.sleep(ns.fault_window)  # let the last restart finish before the reference run
        mismatched, unanswered = _recheck(soak)
        restarts = sum(1 for e in stack.events if e.kind == "restarted")
    finally:
        stack.stop()
    report = _report(ns, soak, kills, mismatched, restarts)
    report["recheck_unanswered"] = unanswered  # the stack did not recover: the reference run failed
    return report


def _recheck(soak: Soak, give_up_after: int = 24, budget_s: float = 180.0) -> tuple[int, int]:
    """(answers that differ, prompts the stack could not answer again) over the completed requests.

    Asked 4 at a time; after ``give_up_after`` unanswered prompts in a row, or ``budget_s``
    seconds, the stack is taken as broken and the rest count as unanswered."""
    import concurrent.futures as cf

    done = [o for o in soak.outcomes if o.status == "completed"]
    ref = Soak(url=soak.url, model=soak.model, max_tokens=soak.max_tokens, turns=1, turn_tokens=0, client_timeout=20.0)
    differ = unanswered = streak = 0
    deadline = time.monotonic() + budget_s
    with httpx.Client(base_url=soak.url) as http, cf.ThreadPoolExecutor(4) as pool:
        for start in range(0, len(done), 4):
            if streak >= give_up_after or time.monotonic() > deadline:
                unanswered += len(done) - start
                break
            batch = done[start : start + 4]
            for o, again in zip(batch, pool.map(lambda o: ref.ask(http, o.prompt), batch)):
                ok = again.status == "completed"
                unanswered += not ok
                streak = 0 if ok else streak + 1
                differ += ok and again.text != o.text
    return differ, unanswered


def _report(ns, soak: Soak, kills: list[dict], mismatched: int, restarts: int) -> dict:
    outs = soak.outcomes
    count = {k: sum(o.status == k for o in outs) for k in ("completed", "failed", "lost")}
    windows = [(k["t"], k["t"] + ns.fault_window) for k in kills]
    calm = [o for o in outs if o.status != "lost" and not any(a <= o.started <= b for a, b in windows)]
    met = [
        o for o in calm if o.status == "completed" and o.ttft_s is not None and o.ttft_s <= ns.slo_ttft and (o.tpot_s or 0.0) <= ns.slo_tpot
    ]
    return {
        "minutes": ns.minutes,
        "kill_every_s": ns.kill_every,
        "agents": ns.agents,
        "topology": ns.topology,
        "replicas": ns.replicas,
        "nats_servers": ns.nats_cluster,
        "kills": kills,
        "restarts": restarts,
        "started": len(outs),
        **count,
        "mismatched": mismatched,
        "slo": {
            "ttft_s": ns.slo_ttft,
            "tpot_s": ns.slo_tpot,
            "requests_outside_faults": len(calm),
            "attainment_outside_faults": len(met) / len(calm) if calm else None,
        },
        "errors": _error_counts(outs),
        "lost_examples": [asdict(o) | {"prompt": len(o.prompt)} for o in outs if o.status == "lost"][:3],
    }


def _error_counts(outs: list[Outcome]) -> dict[str, int]:
    """How many requests ended with each kind of error (message cut before ids and numbers)."""
    counts: dict[str, int] = {}
    for o in outs:
        if o.error:
            key = o.error.replace("'", '"')
            key = key.split('"message": "', 1)[-1][:70]
            counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1])[:8])


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dualpath experiment soak", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=2.0, help="how long agents arrive (default 2)")
    p.add_argument("--kill-every", type=float, default=20.0, help="seconds between kills (default 20)")
    p.add_argument("--kinds", default="engine,traffic-manager,scheduler,kv-persistence", help="kinds of process to kill")
    p.add_argument("--agents", type=int, default=6, help="concurrent agents (default 6)")
    p.add_argument("--turns", type=int, default=4, help="turns per conversation")
    p.add_argument("--turn-tokens", type=int, default=96, help="new prompt tokens per turn")
    p.add_argument("--max-tokens", type=int, default=24, help="tokens per answer")
    p.add_argument("--topology", default="2P2D")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--nats-cluster", type=int, default=1, choices=(1, 3))
    p.add_argument("--fault-window", type=float, default=10.0, help="seconds after a kill left out of the SLO figure")
    p.add_argument("--client-timeout", type=float, default=120.0, help="seconds a client waits before the request counts as lost")
    p.add_argument("--slo-ttft", type=float, default=4.0)
    p.add_argument("--slo-tpot", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--run-dir", default="", help="logs and storage (default: a temporary directory)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    return p


def _interrupt(*_args) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    ns = p.parse_args(argv)
    ns.kinds = [k.strip() for k in ns.kinds.split(",") if k.strip()]
    bad = [k for k in ns.kinds if k not in KINDS]
    if bad or not ns.kinds or ns.minutes <= 0 or ns.kill_every <= 0 or ns.agents < 1 or ns.turns < 1 or ns.max_tokens < 1:
        print(
            f"dualpath experiment soak: bad flags ({'unknown kinds ' + ','.join(bad) if bad else 'counts and times must be positive'}; "
            f"kinds: {', '.join(KINDS)})",
            file=sys.stderr,
        )
        return 2
    signal.signal(signal.SIGTERM, _interrupt)  # a SIGTERM stops the stack too, as Ctrl-C does
    try:
        report = run_soak(ns, say=lambda msg: print(msg, file=sys.stderr, flush=True))
    except KeyboardInterrupt:
        print("dualpath experiment soak: interrupted", file=sys.stderr)
        return 130
    if ns.json:
        print(json.dumps(report, indent=2))
    else:
        print(
            f"soak {report['minutes']} min, {len(report['kills'])} kills ({report['restarts']} restarts): started {report['started']}, "
            f"completed {report['completed']}, failed {report['failed']}, lost {report['lost']}, mismatched {report['mismatched']} "
            f"(not answered again: {report['recheck_unanswered']}); "
            f"SLO attainment outside fault windows {report['slo']['attainment_outside_faults']}"
        )
    return 0 if report["lost"] == 0 and report["mismatched"] == 0 and report["recheck_unanswered"] == 0 else 1
