"""Run the gateway: ``python -m services.gateway --model DIR --nats-url URL [--port 8000]``."""

from __future__ import annotations

import argparse
import sys

import uvicorn

from dualpath.chat.reasoning import REASONING_PARSERS
from dualpath.chat.tools import FORMATS
from dualpath.config import (
    BusConfig,
    GatewayConfig,
    ModelConfigSpec,
    add_arguments,
    from_args,
)
from dualpath.telemetry.logs import configure_logging
from dualpath.telemetry.metrics import configure_metrics, shutdown_metrics
from dualpath.telemetry.tracing import configure_tracing, shutdown_tracing
from services.gateway.app import build_app
from services.gateway.core import Gateway


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dualpath service gateway", description="OpenAI- and Anthropic-compatible HTTP gateway")
    add_arguments(p, BusConfig)
    add_arguments(p, GatewayConfig)
    add_arguments(p, ModelConfigSpec)  # device and dtype: the engines', for the KV bytes /v1/models reports
    return p


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    parser_name = from_args(GatewayConfig, ns).tool_parser
    if parser_name not in ("", "auto", *FORMATS):
        print(f"gateway: --tool-parser must be auto or one of {', '.join(sorted(FORMATS))}, got {parser_name!r}", file=sys.stderr)
        return 2
    reasoning = from_args(GatewayConfig, ns).reasoning_parser
    if reasoning not in ("", "none", *REASONING_PARSERS):
        print(f"gateway: --reasoning-parser must be one of {', '.join(sorted(REASONING_PARSERS))}, got {reasoning!r}", file=sys.stderr)
        return 2
    configure_logging("gateway")
    configure_tracing("gateway")
    try:
        cfg, bus_cfg = from_args(GatewayConfig, ns), from_args(BusConfig, ns)
        configure_metrics("gateway", bus_cfg.metrics_port)
        gw = Gateway(cfg, bus_cfg, from_args(ModelConfigSpec, ns))
    except Exception as exc:  # noqa: BLE001 - a clear message, not a traceback
        print(f"gateway: fatal: {exc}")
        shutdown_tracing()
        return 1
    try:
        uvicorn.run(build_app(gw), host=cfg.host, port=cfg.port, log_level="warning", access_log=False, timeout_graceful_shutdown=5)
    finally:
        shutdown_metrics()
        shutdown_tracing()  # flush: spans of the last requests must not be lost
    return 0
