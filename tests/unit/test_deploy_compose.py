"""deploy/compose: every compose file is valid Compose and agrees with the code.

No Docker engine runs on the development machines, so these checks stand in for what
``docker compose up`` would find first: schema errors, commands and environment variables
the code does not know, dependencies that can never be met, engines that cannot see their
node's shared memory, and Dockerfiles that copy what the build context does not hold.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import importlib.util
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from dualpath import cli, config

REPO = Path(__file__).resolve().parents[2]
COMPOSE_DIR = REPO / "deploy" / "compose"
MAIN = COMPOSE_DIR / "compose.yaml"
SCHEMA = REPO.parent / "shared" / "schemas" / "compose-spec.json"
COMPOSE_FILES = sorted(p for p in COMPOSE_DIR.glob("*.y*ml") if p.name.startswith(("compose", "docker-compose")))
FILE_IDS = [p.name for p in COMPOSE_FILES]
SHELLS = ("sh", "/bin/sh", "bash", "/bin/bash")
INTERPOLATION = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)")


class _ComposeLoader(yaml.SafeLoader):
    """YAML with Compose's merge tags: ``!reset`` (drop the base's value) and ``!override``
    (replace it whole) load as the value they carry."""


def _tagged(loader: yaml.SafeLoader, node: yaml.Node) -> object:
    if isinstance(node, yaml.SequenceNode):
        return loader.construct_sequence(node, deep=True)
    if isinstance(node, yaml.MappingNode):
        return loader.construct_mapping(node, deep=True)
    return loader.construct_scalar(node)  # type: ignore[arg-type]


for _tag in ("!reset", "!override"):
    _ComposeLoader.add_constructor(_tag, _tagged)


@functools.cache
def _load(path: Path) -> dict:
    return yaml.load(path.read_text(), Loader=_ComposeLoader)  # noqa: S506 - a SafeLoader with two tags added


def _env(svc: dict) -> dict[str, str]:
    env = svc.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) if "=" in item else (item, "") for item in env)
    return {k: "" if v is None else str(v) for k, v in env.items()}


@functools.cache
def _services(path: Path) -> dict[str, dict]:
    """The services of ``path`` as ``docker compose -f compose.yaml -f path`` sees them
    (an override's keys replace the base's, its environment and build entries merge)."""
    own = _load(path).get("services") or {}
    if path == MAIN:
        return own
    base = _load(MAIN)["services"]
    merged = {}
    for name, svc in own.items():
        merged[name] = {**base.get(name, {}), **svc, "environment": {**_env(base.get(name, {})), **_env(svc)}}
        if isinstance(svc.get("build"), dict) and isinstance(base.get(name, {}).get("build"), dict):
            merged[name]["build"] = {**base[name]["build"], **svc["build"]}  # build keys merge too
    return merged


def _argv(svc: dict) -> list[str]:
    parts: list[str] = []
    for key in ("entrypoint", "command"):
        value = svc.get(key) or []
        parts += shlex.split(value) if isinstance(value, str) else [str(v) for v in value]
    return parts


def _simple_commands(argv: list[str]) -> list[list[str]]:
    """``argv``, or the simple commands of its ``sh -c`` script (grouping and ``exec`` dropped)."""
    if len(argv) >= 3 and argv[0] in SHELLS and argv[1] == "-c":
        out = []
        for part in re.split(r"\|\||&&|;|\|", argv[2]):
            words = [w for w in shlex.split(part) if w not in ("{", "}", "(", ")", "exec")]
            if words:
                out.append(words)
        return out
    return [argv]


def _ours(svc: dict) -> bool:
    return "build" in svc or str(svc.get("image", "")).startswith("dualpath")


def _service_module(svc: dict) -> str | None:
    """The ``services.*.service`` module a compose service runs, if it runs one."""
    argv = _argv(svc)
    if argv[:2] == ["dualpath", "service"] and len(argv) >= 3:
        return cli.SERVICES.get(argv[2])
    if len(argv) >= 3 and argv[0].startswith("python") and argv[1] == "-m":
        module = argv[2] if argv[2].endswith(".service") else argv[2] + ".service"
        return module if module in cli.SERVICES.values() else None
    return None


def _python_sources(*roots: str) -> str:
    return "\n".join(p.read_text() for root in roots for p in sorted((REPO / root).rglob("*.py")))


@functools.cache
def _known_dualpath_vars() -> frozenset[str]:
    classes = [obj for name in config.__all__ if dataclasses.is_dataclass(obj := getattr(config, name))]
    grep = re.findall(r"[\"'](DUALPATH_[A-Z0-9_]+)[\"']", _python_sources("libs", "services"))
    return frozenset(config.env_vars(*classes)) | frozenset(grep)


@functools.cache
def _global_vars() -> frozenset[str]:
    """Variables every service reads through its logging and tracing set-up."""
    text = _python_sources("libs/dualpath/telemetry") + (REPO / "libs/dualpath/runtime.py").read_text()
    return frozenset(re.findall(r"[\"'](DUALPATH_[A-Z0-9_]+)[\"']", text))


@functools.cache
def _module_vars(module: str) -> frozenset[str]:
    """The ``DUALPATH_*`` variables ``module``'s ``build_parser()`` offers (each flag's help names its variable)."""
    parser = importlib.import_module(module).build_parser()
    found: set[str] = set()
    for action in parser._actions:
        found |= set(re.findall(r"env (DUALPATH_[A-Z0-9_]+)", action.help or ""))
    return frozenset(found)


@pytest.mark.parametrize("path", COMPOSE_FILES, ids=FILE_IDS)
def test_every_compose_file_validates_against_the_compose_specification(path: Path) -> None:
    if not SCHEMA.exists():
        pytest.skip(f"Compose Specification schema not found at {SCHEMA}")
    import jsonschema

    validator = jsonschema.Draft7Validator(json.loads(SCHEMA.read_text()))
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(_load(path))]
    assert errors == [], "\n".join(errors)


@pytest.mark.parametrize("path", COMPOSE_FILES, ids=FILE_IDS)
def test_every_dualpath_and_otel_variable_is_one_the_code_reads(path: Path) -> None:
    from opentelemetry.sdk import environment_variables as otel

    names = set(INTERPOLATION.findall(path.read_text()))
    for svc in _services(path).values():
        names |= set(_env(svc))
    unknown = sorted(
        n
        for n in names
        if (n.startswith("DUALPATH_") and n not in _known_dualpath_vars()) or (n.startswith("OTEL_") and not hasattr(otel, n))
    )
    assert unknown == []


@pytest.mark.parametrize("path", COMPOSE_FILES, ids=FILE_IDS)
def test_each_service_is_given_only_dualpath_variables_its_own_command_reads(path: Path) -> None:
    wasted = []
    for name, svc in _services(path).items():
        module = _service_module(svc)
        if module is None:
            assert not [v for v in _env(svc) if v.startswith("DUALPATH_")], f"{name} runs no DualPath service"
            continue
        allowed = _module_vars(module) | _global_vars()
        wasted += [f"{name}: {v}" for v in _env(svc) if v.startswith("DUALPATH_") and v not in allowed]
    assert wasted == []


def test_every_command_names_an_existing_subcommand_service_or_module() -> None:
    builtins = set(re.findall(r'cmd == "([\w-]+)"', Path(cli.__file__).read_text()))
    checked = 0
    for name, svc in _services(MAIN).items():
        if not _ours(svc):
            continue
        for words in _simple_commands(_argv(svc)):
            if words[0] == "dualpath":
                sub = words[1]
                if sub == "service":
                    assert words[2] in cli.SERVICES, f"{name}: no service {words[2]!r}"
                    assert importlib.util.find_spec(cli.SERVICES[words[2]]) is not None
                    assert words[3:] == [], f"{name}: configure {words[3:]} by environment, not flags"
                elif sub not in builtins:
                    assert sub in cli.PASSTHROUGH, f"{name}: dualpath has no sub-command {sub!r}"
                    assert importlib.util.find_spec(cli.PASSTHROUGH[sub]) is not None, f"{name}: {sub} has no module"
                checked += 1
            elif words[0].startswith("python") and words[1:2] == ["-m"]:
                assert importlib.util.find_spec(words[2]) is not None, f"{name}: no module {words[2]}"
                checked += 1
    assert checked >= 7  # model-init, kv-persistence, scheduler, 2 traffic managers, 2 engines, gateway


def test_services_on_the_control_image_import_without_torch() -> None:
    modules = sorted(
        {
            _service_module(svc)
            for svc in _services(MAIN).values()
            if str(svc.get("build", {}).get("dockerfile", "")).endswith("Dockerfile.control")
        }
        - {None}
    )
    assert modules, "no DualPath service runs on the control image"
    script = (
        "import importlib, sys\n"
        "class NoTorch:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'torch': raise ImportError('torch is not in the control image')\n"
        "sys.meta_path.insert(0, NoTorch())\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert result.returncode == 0, result.stderr[-2000:]


def test_the_gateway_describes_the_model_without_torch(tiny_model: Path) -> None:
    """``/v1/models``' description (what the control image's gateway answers) needs no torch;
    its KV bytes per token are what the engines' KV spec gives with torch."""
    from dualpath.model.config import ModelConfig, dtype_from_name

    cfg = ModelConfig.from_dir(tiny_model)
    want = cfg.kv_spec.bytes_per_token_layer(dtype_from_name("float32")) * cfg.num_hidden_layers
    script = (
        "import json, sys\n"
        "class NoTorch:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'torch': raise ImportError('torch is not in the control image')\n"
        "sys.meta_path.insert(0, NoTorch())\n"
        "from dualpath.model.config import ModelConfig\n"
        f"cfg = ModelConfig.from_dir({str(tiny_model)!r})\n"
        "print(json.dumps(cfg.describe(cfg.serving_dtype('cpu'))))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(result.stdout)["kv_bytes_per_token"] == want > 0


def test_nats_jaeger_and_the_gateway_have_healthchecks() -> None:
    svcs = _services(MAIN)
    for name in ("nats", "jaeger", "gateway"):
        check = svcs[name].get("healthcheck") or {}
        assert check.get("test") and not check.get("disable"), f"{name} has no healthcheck"
    probe = " ".join(svcs["gateway"]["healthcheck"]["test"])
    port = _env(svcs["gateway"])["DUALPATH_PORT"]
    path = re.search(rf"127\.0\.0\.1:{port}(/\w+)", probe).group(1)
    assert f'@app.get("{path}"' in (REPO / "services/gateway/app.py").read_text()  # a route the gateway serves


@pytest.mark.parametrize("path", COMPOSE_FILES, ids=FILE_IDS)
def test_every_dependency_waits_on_a_condition_its_target_can_meet(path: Path) -> None:
    svcs = _services(MAIN)
    for name, svc in _services(path).items():
        deps = svc.get("depends_on") or {}
        assert isinstance(deps, dict), f"{name}: depends_on must give conditions"
        for target, spec in deps.items():
            assert target in svcs, f"{name} depends on unknown service {target}"
            condition = spec.get("condition")
            assert condition, f"{name} -> {target} has no condition"
            if condition == "service_healthy":
                assert svcs[target].get("healthcheck"), f"{name} waits for {target} to be healthy; it has no healthcheck"
            if condition == "service_completed_successfully":
                assert svcs[target].get("restart", "no") in ("no", "on-failure"), f"{target} never completes"


def _by_module(svcs: dict[str, dict], suffix: str) -> dict[str, dict]:
    return {n: s for n, s in svcs.items() if (_service_module(s) or "").endswith(suffix)}


def test_engines_share_shared_memory_with_their_own_nodes_traffic_manager() -> None:
    svcs = _services(MAIN)
    managers = _by_module(svcs, "traffic_manager.service")
    node_of = {n: _env(s)["DUALPATH_NODE_ID"] for n, s in managers.items()}
    assert len(set(node_of.values())) == len(node_of), "one traffic manager per node"
    engines = _by_module(svcs, "engine.service")
    assert len(engines) >= 2
    for name, svc in engines.items():
        node, ipc = _env(svc)["DUALPATH_NODE_ID"], svc.get("ipc", "")
        owner = ipc.removeprefix("service:")
        if ipc == "host":
            assert any(m.get("ipc") == "host" and node_of[n] == node for n, m in managers.items()), name
        else:
            assert owner in managers and node_of[owner] == node, f"{name} (node {node}) must join its node's manager"
            assert managers[owner].get("ipc") == "shareable", f"{owner} must be ipc: shareable"
            assert managers[owner].get("shm_size"), f"{owner} needs room in /dev/shm for buffer and windows"


def test_traffic_managers_advertise_a_data_host_their_peers_can_resolve() -> None:
    for name, svc in _by_module(_services(MAIN), "traffic_manager.service").items():
        env = _env(svc)
        assert env["DUALPATH_TRANSPORT"] == "tcp"
        assert env["DUALPATH_DATA_HOST"] in (name, svc.get("hostname")), f"{name} advertises {env['DUALPATH_DATA_HOST']}"


def _volume_at(svc: dict, path: str) -> str | None:
    """The named volume mounted at ``path`` or one of its parents."""
    for vol in svc.get("volumes", []):
        if isinstance(vol, str):
            source, target = vol.split(":")[:2]
        else:
            source, target = vol.get("source"), vol["target"]
        if path == target or path.startswith(target.rstrip("/") + "/"):
            return source
    return None


def test_storage_and_models_live_on_shared_volumes_at_the_configured_paths() -> None:
    doc, svcs = _load(MAIN), _services(MAIN)
    storage_users = {**_by_module(svcs, "traffic_manager.service"), **_by_module(svcs, "kv_persistence.service")}
    sources = {_volume_at(s, _env(s)["DUALPATH_STORAGE"]) for s in storage_users.values()}
    assert len(sources) == 1 and None not in sources, f"storage must be one shared volume, got {sources}"
    model_users = {n: s for n, s in svcs.items() if "DUALPATH_MODEL" in _env(s)}
    assert len(model_users) >= 3  # two engines and the gateway
    models = {_volume_at(s, _env(s)["DUALPATH_MODEL"]) for s in model_users.values()}
    assert models == {_volume_at(svcs["model-init"], "/models/tiny")}, "engines must read what model-init writes"
    assert (sources | models) <= set(doc.get("volumes") or {})


def test_nats_accepts_the_payload_size_the_embedded_server_uses() -> None:
    embedded = re.search(r"max_payload: (\d+)", (REPO / "libs/dualpath/bus/embedded.py").read_text())
    conf = re.search(r"^max_payload: (\d+)", (COMPOSE_DIR / "nats.conf").read_text(), re.M)
    assert conf and embedded and int(conf.group(1)) >= int(embedded.group(1))


def _builds() -> list[tuple[Path, Path]]:
    found = set()
    for path in COMPOSE_FILES:
        for svc in _services(path).values():
            build = svc.get("build")
            if isinstance(build, dict):
                context = (COMPOSE_DIR / build.get("context", ".")).resolve()
                found.add((context, context / build.get("dockerfile", "Dockerfile")))
    return sorted(found)


def _ignored(rel: str, patterns: list[str]) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parents decides."""
    parts = rel.strip("/").split("/")
    candidates = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    verdict = False
    for pattern in patterns:
        negate, pat = pattern.startswith("!"), pattern.lstrip("!").strip("/")
        if any(fnmatch.fnmatchcase(c, pat) for c in candidates):
            verdict = not negate
    return verdict


def _copy_sources(dockerfile: Path) -> list[str]:
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    sources = []
    for line in text.splitlines():
        words = line.split(None, 1)
        if len(words) == 2 and words[0].upper() in ("COPY", "ADD"):
            rest = words[1].strip()
            args = json.loads(rest) if rest.startswith("[") else shlex.split(rest)
            if any(a.startswith("--from") for a in args):
                continue
            sources += [a for a in args if not a.startswith("--")][:-1]
    return sources


@pytest.mark.parametrize("context,dockerfile", _builds(), ids=[df.name for _, df in _builds()])
def test_dockerfile_copy_sources_exist_and_are_sent_with_the_build_context(context: Path, dockerfile: Path) -> None:
    assert dockerfile.exists()
    ignore_file = Path(f"{dockerfile}.dockerignore")
    if not ignore_file.exists():
        ignore_file = context / ".dockerignore"
    patterns = (
        [ln.strip() for ln in ignore_file.read_text().splitlines() if ln.strip() and not ln.startswith("#")] if ignore_file.exists() else []
    )
    sources = _copy_sources(dockerfile)
    assert sources, f"{dockerfile.name} copies nothing"
    for src in sources:
        assert list(context.glob(src)), f"{dockerfile.name}: COPY {src} is not in {context}"
        assert not _ignored(src, patterns), f"{dockerfile.name}: COPY {src} is excluded by {ignore_file.name}"


def test_both_images_run_as_one_user_so_engines_can_map_their_managers_memory() -> None:
    uids = {df.name: re.findall(r"useradd[^\n]*--uid (\d+)", df.read_text()) for _, df in _builds()}
    assert len(uids) >= 2 and all(len(u) == 1 for u in uids.values())
    assert len({u[0] for u in uids.values()}) == 1, uids


def test_the_requirements_script_leaves_out_exactly_the_named_distribution(capsys) -> None:
    spec = importlib.util.spec_from_file_location("deploy_requirements", COMPOSE_DIR / "requirements.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    everything = module.requirements()
    without = module.requirements(without=("torch",))
    assert [r for r in everything if module.requirement_name(r) == "torch"] and len(without) == len(everything) - 1
    assert all(module.requirement_name(r) != "torch" for r in without)
    assert module.main(["--without", "torchh"]) == 2  # a typo must not install torch silently
    capsys.readouterr()
    assert module.main(["--without", "torch"]) == 0
    printed = capsys.readouterr().out.split()
    assert printed == without and "numpy" in {module.requirement_name(r) for r in printed}


def test_the_secure_compose_prometheus_presents_the_gateways_api_key_on_every_api_scrape():
    """With compose.secure.yaml the gateway's /metrics needs a key: the scraper reads the same
    DUALPATH_API_KEY from a secret, and otherwise scrapes what the plain form scrapes."""
    secure = _load(COMPOSE_DIR / "compose.secure.yaml")
    prometheus = secure["services"]["prometheus"]
    (mount,) = prometheus["configs"]
    config_file = COMPOSE_DIR / secure["configs"][mount["source"]]["file"]
    assert mount["target"] == "/etc/prometheus/prometheus.yml"
    (secret,) = prometheus["secrets"]
    assert secure["secrets"][secret]["environment"] == "DUALPATH_API_KEY"
    assert secure["services"]["gateway"]["environment"]["DUALPATH_API_KEY"].startswith("${DUALPATH_API_KEY")
    scraped = yaml.safe_load(config_file.read_text())
    api = next(job for job in scraped["scrape_configs"] if job["job_name"] == "dualpath-api")
    assert api.pop("authorization") == {"type": "Bearer", "credentials_file": f"/run/secrets/{secret}"}
    assert scraped == yaml.safe_load((COMPOSE_DIR / "prometheus.yml").read_text())
