"""``dualpath experiment soak``: the online workload near its maximum APS for M minutes while a
random process is killed every S seconds.

The testbed form (``--compute modeled``, the default) is ``dualpath experiment online``'s run:
modeled GPU time of ``--target`` on emulated NICs, agents of the ``--dataset`` set met halfway
through their trajectories (``--start-at``) with their history in storage (one untimed warm-up
turn each, on a fast-forwarded stack), ``--turns`` timed turns each, in ``--slowdown`` slow
motion. The stack is the redundant form (``--replicas 2``: two schedulers on the lease, two
kv-persistence replicas on the JetStream index) and its supervisor restarts whatever dies. Agents
arrive at ``--rate`` APS (modeled). Every ``--kill-every`` host seconds one process of a random
kind (engine, traffic manager, scheduler, kv-persistence replica) gets SIGKILL.

Each request ends completed (every token), failed with an explicit error (an HTTP error status
or an SSE error event), or lost (no answer within ``--client-timeout``, a broken connection, or an
answer cut short without an error). After the run a fresh, undisturbed stack over the same
storage and index (fast-forwarded: answers do not depend on timing) is asked every completed
turn again, with the soak's own history as prompt; answers that differ are *mismatched*. The
modeled engines choose tokens deterministically (``ModeledDecoder.logits``: greedy over a
distribution peaked on a letter derived from the input token; the first from the prompt's last
token), so the comparison checks that every answer has exactly the tokens, in order, of an
undisturbed run (nothing duplicated, skipped or resumed wrongly after a kill); it cannot check
KV contents, which modeled compute never reads. ``--compute torch`` runs the same load on the
tiny real model (no emulation, lengths scaled by ``--lengths``), where a greedy answer does
depend on every KV byte loaded.

SLO attainment (TTFT, TPOT in modeled seconds) counts the completed and failed requests whose
whole life lies outside every fault window (``--fault-window`` host seconds from each kill).
Exit status 0 when nothing is lost or mismatched, every turn was answered again and every
killed process was restarted by the supervisor; 1 otherwise; 2 on bad flags.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import anyio

from dualpath.cli.experiment.soak_load import KINDS, Load, Outcome, replay, run_load

__all__ = ["main", "run_soak"]

# ``dualpath experiment online --sweep`` on this form's defaults (ds27b 1P1D, 64k, start-at 0.5,
# slowdown 4; docs/results.md, Soak): DualPath passed 6.0 APS and failed 8.49. The default rate is 90% of it.
SWEEP_MAX_APS = 6.0
LOAD_FRACTION = 0.9


def _rate(ns: argparse.Namespace) -> float:
    """Modeled APS: ``--rate``, else 90% of ``--from-sweep``'s DualPath max APS, else of SWEEP_MAX_APS."""
    if ns.rate:
        return ns.rate
    if ns.from_sweep:
        result = json.loads(Path(ns.from_sweep).read_text())
        best = (result.get("modes", {}).get("dualpath") or {}).get("max_aps")
        if not best:
            raise ValueError(f"{ns.from_sweep} has no dualpath max_aps (run dualpath experiment online --sweep)")
        return LOAD_FRACTION * best
    return LOAD_FRACTION * SWEEP_MAX_APS if ns.compute == "modeled" else 0.5


def _stacks(ns: argparse.Namespace, out: Path, say):
    """(soak stack config, fast-forwarded config over the same storage and index, testbed spec or None)."""
    from dualpath.bus.embedded import free_port
    from dualpath.cli.launcher.stack import StackConfig
    from dualpath.cli.launcher.topology import parse_topology
    from dualpath.cli.launcher.up import ensure_model

    env = {"DUALPATH_REQUEST_TIMEOUT": str(ns.client_timeout / 2)}  # the gateway answers 504 before the client gives up
    env_fast = {"DUALPATH_REQUEST_TIMEOUT": "3600"}
    namespace = f"soak{os.getpid()}"  # shared by the three stacks: the JetStream index survives them
    if ns.compute == "torch":
        cfg = StackConfig(
            model=ensure_model("", str(out)),
            topology=parse_topology(ns.topology, ns.engines_per_node),
            storage=str(out / "storage"),
            run_dir=str(out / "run"),
            port=free_port(),
            replicas=ns.replicas,
            nats_cluster=ns.nats_cluster,
            namespace=namespace,
            buffer_mb=64,
            extra_env=env,
        )
        return cfg, cfg, None
    from dualpath.cli.experiment.runner import MODES, emulation_config, prepare, stack_config

    ns.modes, ns.agents = "dualpath", _agents(ns)
    extra = ("--start-at", str(ns.start_at), "--scale", str(ns.lengths))
    prepared = prepare(ns, "dualpath experiment soak", slowdown=ns.slowdown, warmup_turns=1, extra_loadgen=extra)
    if prepared is None:
        raise ValueError("bad testbed flags (see above)")
    spec, mode = prepared[0], prepared[1][-1]  # dualpath, or split / prefetch when asked for
    cfg = stack_config(spec, MODES[mode], emulation_config(spec, False, ns.slowdown), out)
    cfg = dataclasses.replace(cfg, replicas=ns.replicas, nats_cluster=ns.nats_cluster, namespace=namespace, extra_env=cfg.extra_env | env)
    # The warm-up starts every agent at once: its gateway keeps the default request timeout.
    fast = dataclasses.replace(cfg, emulation=emulation_config(spec, False, ns.fast_slowdown), extra_env=cfg.extra_env | env_fast)
    return cfg, fast, spec


def _agents(ns: argparse.Namespace) -> int:
    """Agents that may arrive: the expected arrivals over the soak, a fifth more and a margin (Poisson spread)."""
    k = ns.slowdown if ns.compute == "modeled" else 1.0
    return math.ceil(1.2 * ns.rate * 60 * ns.minutes / k) + 8


def _start(cfg, say, label: str):
    """A stack of ``cfg`` on a fresh gateway port, started (StackError if it does not come up)."""
    from dualpath.bus.embedded import free_port
    from dualpath.cli.launcher.stack import Stack

    say(f"{label}: starting the stack")
    return Stack(dataclasses.replace(cfg, port=free_port())).start(timeout=300, progress=say)


def _warm_up(spec, fast, out: Path, say, every: float) -> dict:
    """Every agent's first turn, untimed, on the fast-forwarded redundant stack (as the online
    experiment's warm-up, but its index is the soak's JetStream index)."""
    from dualpath.cli.experiment.runner import loadgen_command

    stack = _start(fast, say, "warm-up")
    try:
        t0 = time.monotonic()
        cmd = [*loadgen_command(spec, stack.url, 1, out / "warmup"), "--offline"]
        with open(out / "warmup.log", "w") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
            while True:
                try:
                    code = proc.wait(timeout=every)
                    break
                except subprocess.TimeoutExpired:
                    say(f"warm-up: {time.monotonic() - t0:.0f} s; load average {os.getloadavg()[0]:.1f}")
        try:
            done = json.loads((out / "warmup" / "report.json").read_text())["run"]["turns"]["completed"]
        except (OSError, ValueError, KeyError, TypeError):
            done = 0
        if code != 0:
            say(f"warm-up load generator exited {code}; see {out / 'warmup.log'}")
        say(f"warm-up: {done} of {spec.agents} agents' first turns in {time.monotonic() - t0:.0f} s")
        return {"agents": spec.agents, "completed": done, "seconds": round(time.monotonic() - t0, 1)}
    finally:
        stack.stop()


def _load(ns: argparse.Namespace, model_dir: str, url: str, timeout: float) -> Load:
    from loadgen.arrivals import arrival_times
    from loadgen.client import Endpoint, resolve_model
    from loadgen.dataset import load_dataset
    from loadgen.prompts import PromptText
    from loadgen.runner import LoadSpec

    k = ns.slowdown if ns.compute == "modeled" else 1.0
    agents = _agents(ns)
    trajectories = load_dataset(ns.dataset, agents=agents, seed=ns.seed, turns=ns.turns, scale=ns.lengths, start_at=ns.start_at)
    endpoint = Endpoint.parse(url, chat=False, model=resolve_model(url, model=None, api_key=None), timeout_s=timeout)
    spec = LoadSpec(
        endpoint=endpoint,
        trajectories=tuple(trajectories),
        arrivals=tuple(arrival_times(agents, rate=ns.rate / k, seed=ns.seed).tolist()),
        offline=False,
        text_seed=ns.seed,  # as the warm-up's loadgen: same texts, so the agents' history is in storage
    )
    return Load(
        spec=spec,
        prompts=PromptText(model_dir),
        seconds=60 * ns.minutes,
        kill_every=ns.kill_every,
        kinds=ns.kinds,
        rng=random.Random(ns.seed),
        progress_every=ns.progress_every,
    )


def run_soak(ns: argparse.Namespace, say=lambda _m: None) -> dict:
    """Run the soak the flags describe; returns the report (see the module docstring).

    Raises ValueError on flags found bad once the testbed is prepared, StackError when a stack
    does not start."""
    ns.rate = _rate(ns)
    out = Path(ns.out)
    for stale in ("storage", "run", "warmup"):
        shutil.rmtree(out / stale, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    cfg, fast, spec = _stacks(ns, out, say)
    warmup = _warm_up(spec, fast, out, say, ns.progress_every) if spec is not None and ns.warmup else None
    stack = _start(cfg, say, "soak")
    try:
        load = _load(ns, cfg.model, stack.url, ns.client_timeout)
        say(
            f"soak: agents at {ns.rate:.2f} APS ({ns.compute}) for {ns.minutes:g} min, "
            f"a {'/'.join(ns.kinds)} kill every {ns.kill_every:g} s; load average {os.getloadavg()[0]:.1f}"
        )
        load.t0 = time.monotonic()
        anyio.run(run_load, load, stack, say)
        events = list(stack.events)
        if ns.replay_on == "same":
            replayed = _replay(ns, load, stack.url, say)
    finally:
        stack.stop()
    if ns.replay_on == "fresh":
        ref = _start(fast, say, "undisturbed replay")
        try:
            replayed = _replay(ns, load, ref.url, say)
        finally:
            ref.stop()
    mismatched, unanswered, examples = replayed
    report = _report(ns, load, events, mismatched, unanswered)
    report["requests_file"] = str(_save_requests(out, load))
    report["mismatch_examples"] = examples
    report["warmup"] = warmup
    return report


def _save_requests(out: Path, load: Load) -> Path:
    """Every request's outcome (answer text left out) as JSON lines, for looking into failures."""
    path = out / "requests.jsonl"
    with path.open("w") as f:
        for o in load.outcomes:
            f.write(json.dumps(dataclasses.asdict(o) | {"text": len(o.text)}) + "\n")
    return path


def _replay(ns: argparse.Namespace, load: Load, url: str, say) -> tuple[int, int, list[dict]]:
    """Every completed turn asked again at ``url``, no kills meanwhile (``soak_load.replay``)."""
    from loadgen.client import Endpoint

    endpoint = Endpoint.parse(url, chat=False, model=load.spec.endpoint.model, timeout_s=ns.client_timeout)
    n = sum(o.status == "completed" for o in load.outcomes)
    say(f"replay: asking the {n} completed turns again ({ns.replay_on} stack, no kills)")
    t0 = time.monotonic()
    result = anyio.run(replay, load, endpoint, 16, say)
    say(f"replay: {result[0]} differ, {result[1]} not answered, in {time.monotonic() - t0:.0f} s")
    return result


def _report(ns: argparse.Namespace, load: Load, events: list, mismatched: int, unanswered: int) -> dict:
    k = ns.slowdown if ns.compute == "modeled" else 1.0
    outs = load.outcomes
    count = {s: sum(o.status == s for o in outs) for s in ("completed", "failed", "lost")}
    windows = [(kill["t"], kill["t"] + ns.fault_window) for kill in load.kills]
    calm = [o for o in outs if o.status != "lost" and o.ended is not None and not any(o.started <= b and o.ended >= a for a, b in windows)]
    met = [o for o in calm if o.status == "completed" and (o.ttft_s or 0.0) / k <= ns.slo_ttft and (o.tpot_s or 0.0) / k <= ns.slo_tpot]
    kills = [_kill_entry(kill, events) for kill in load.kills]
    return {
        "compute": ns.compute,
        "target": ns.target if ns.compute == "modeled" else "tiny",
        "topology": ns.topology,
        "replicas": ns.replicas,
        "nats_servers": ns.nats_cluster,
        "minutes": ns.minutes,
        "kill_every_s": ns.kill_every,
        "rate_aps": round(ns.rate, 3),
        "slowdown": k,
        "dataset": ns.dataset,
        "agents_arrived": len({o.agent for o in outs}),
        "kills": kills,
        "restarts": sum(e.kind == "restarted" for e in events),
        "kills_not_restarted": sum(kill["restarted_after_s"] is None for kill in kills),
        "started": len(outs),
        **count,
        "mismatched": mismatched,
        "recheck_unanswered": unanswered,
        "slo": {
            "ttft_s": ns.slo_ttft,
            "tpot_s": ns.slo_tpot,
            "fault_window_s": ns.fault_window,
            "requests_outside_faults": len(calm),
            "attainment_outside_faults": round(len(met) / len(calm), 4) if calm else None,
        },
        "hit_rate": round(sum(o.cached_tokens for o in outs) / prompt, 4) if (prompt := sum(o.prompt_tokens for o in outs)) else None,
        "errors": _error_counts(outs),
        "lost_examples": [dataclasses.asdict(o) | {"text": o.text[:40]} for o in outs if o.status == "lost"][:3],
        "loadavg": [round(x, 2) for x in os.getloadavg()],
    }


def _kill_entry(kill: dict, events: list) -> dict:
    """A kill with how long its process took to be restarted by the supervisor (None: never)."""
    restarted = [e.ts for e in events if e.kind == "restarted" and e.name == kill["process"] and e.ts >= kill["wall"]]
    after = round(min(restarted) - kill["wall"], 2) if restarted else None
    return {"t": kill["t"], "kind": kill["kind"], "process": kill["process"], "restarted_after_s": after}


def _error_counts(outs: list[Outcome]) -> dict[str, int]:
    """How many requests ended with each kind of error (the server's message, cut to 70 characters)."""
    counts: dict[str, int] = {}
    for o in outs:
        if o.error:
            key = o.error.replace("'", '"')
            if '"message": "' in key:  # an error body or SSE error event: its message alone
                key = key.split('"message": "', 1)[1].split('"', 1)[0]
            counts[key[:70]] = counts.get(key[:70], 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1])[:8])


def build_parser() -> argparse.ArgumentParser:
    from dualpath.cli.experiment.runner import add_cluster_arguments

    p = argparse.ArgumentParser(prog="dualpath experiment soak", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_cluster_arguments(p)
    p.set_defaults(engines_per_node=1)  # the online experiment's cluster, whose max APS the default rate is taken from
    p.add_argument(
        "--compute", choices=("modeled", "torch"), default="modeled", help="modeled: the testbed (default); torch: tiny real model"
    )
    p.add_argument("--minutes", type=float, default=2.0, help="host minutes during which agents start turns and kills happen (default 2)")
    p.add_argument("--kill-every", type=float, default=20.0, help="host seconds between kills (default 20)")
    p.add_argument("--kinds", default=",".join(KINDS), help="kinds of process to kill, comma-separated")
    p.add_argument(
        "--rate",
        type=float,
        default=0.0,
        help=(
            f"agents per second (modeled). Default: {LOAD_FRACTION:g} x --from-sweep's DualPath max APS, else "
            f"{LOAD_FRACTION:g} x {SWEEP_MAX_APS:g} = {LOAD_FRACTION * SWEEP_MAX_APS:g} APS (the max APS `dualpath experiment "
            "online --sweep` measured on these defaults); 0.5 with --compute torch"
        ),
    )
    p.add_argument("--from-sweep", default="", help="result.json of `dualpath experiment online --sweep` for this config")
    p.add_argument("--dataset", default="64k", help="32k, 48k, 64k or a trajectory JSONL file")
    p.add_argument("--turns", type=int, default=3, help="timed turns per agent (after its warm-up turn)")
    p.add_argument("--start-at", type=float, default=0.5, help="meet every agent this far through its trajectory")
    p.add_argument("--lengths", type=float, default=0.0, help="multiply every trajectory length (default 1; 0.01 with --compute torch)")
    p.add_argument("--slowdown", type=float, default=4.0, help="slow motion of the modeled cluster (as the online experiment)")
    p.add_argument("--fast-slowdown", type=float, default=0.1, help="the warm-up's and the undisturbed replay's (fast-forward)")
    p.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True, help="untimed first turn of every agent (modeled)")
    p.add_argument(
        "--replay-on",
        choices=("fresh", "same"),
        default="fresh",
        help="fresh: on a new fast-forwarded stack over the same storage and index (default); same: on the soak's stack, kills over",
    )
    p.add_argument("--replicas", type=int, default=2, help="schedulers and kv-persistence replicas")
    p.add_argument("--nats-cluster", type=int, default=1, choices=(1, 3))
    p.add_argument("--fault-window", type=float, default=15.0, help="host seconds after a kill left out of the SLO figure")
    p.add_argument("--client-timeout", type=float, default=240.0, help="host seconds a client waits before its request counts as lost")
    p.add_argument("--slo-ttft", type=float, default=4.0, help="TTFT bound, modeled seconds")
    p.add_argument("--slo-tpot", type=float, default=0.05, help="TPOT bound, modeled seconds")
    p.add_argument("--progress-every", type=float, default=15.0, help="host seconds between progress lines on stderr")
    p.add_argument("--out", default="runs/soak", help="storage, logs and the warm-up's output")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    return p


def _bad_flags(ns: argparse.Namespace) -> str:
    bad = [k for k in ns.kinds if k not in KINDS]
    if bad or not ns.kinds:
        return f"unknown kinds {','.join(bad) or '(none)'}; kinds: {', '.join(KINDS)}"
    positive = ("minutes", "kill_every", "turns", "slowdown", "fast_slowdown", "client_timeout", "progress_every", "replicas")
    if any(not getattr(ns, name) > 0 for name in positive) or ns.rate < 0 or ns.lengths < 0:
        return "counts and times must be positive (--rate and --lengths: 0 for the default)"
    if not 0 <= ns.start_at < 1:
        return "--start-at must be in [0, 1)"
    return ""


def _interrupt(*_args) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    ns.kinds = [k.strip() for k in ns.kinds.split(",") if k.strip()]
    ns.lengths = ns.lengths or (1.0 if ns.compute == "modeled" else 0.01)
    problem = _bad_flags(ns)
    if not problem:
        try:
            ns.rate = _rate(ns)
        except (OSError, ValueError) as exc:
            problem = str(exc)
    if problem:
        print(f"dualpath experiment soak: {problem}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _interrupt)  # a SIGTERM stops the stack too, as Ctrl-C does
    try:
        report = run_soak(ns, say=lambda msg: print(msg, file=sys.stderr, flush=True))
    except KeyboardInterrupt:
        print("dualpath experiment soak: interrupted", file=sys.stderr)
        return 130
    except ValueError as exc:
        print(f"dualpath experiment soak: {exc}", file=sys.stderr)
        return 2
    if ns.json:
        print(json.dumps(report, indent=2))
    else:
        print(
            f"soak {report['minutes']:g} min at {report['rate_aps']} APS, {len(report['kills'])} kills ({report['restarts']} restarts): "
            f"started {report['started']}, completed {report['completed']}, failed {report['failed']}, lost {report['lost']}, "
            f"mismatched {report['mismatched']} (not answered again: {report['recheck_unanswered']}); "
            f"SLO attainment outside fault windows {report['slo']['attainment_outside_faults']}"
        )
    ok = not (report["lost"] or report["mismatched"] or report["recheck_unanswered"] or report["kills_not_restarted"])
    return 0 if ok else 1
