"""Real agents, end to end: Claude Code (``claude -p``, Anthropic Messages), Codex CLI (``codex
exec``, OpenAI Responses) and the OpenAI Agents SDK's default model class (Responses) each run a
two-turn session against a real stack, exit 0, and their second request reads at least 90% of
its prompt from the KV cache (the gateway's ``request_finished`` log line says so).

The CLIs come from the npm registry, installed into a temporary prefix (skipped when npm or the
registry is unavailable). They send a system prompt and tool definitions of tens of thousands
of characters every turn, so the tiny checkpoint here differs from the usual one in two ways:
a context of 128K positions, and a byte-level BPE tokenizer with merges learned from this
repository's own sources and docs (English and code, a few characters per token, as real
tokenizers have) instead of one token per byte. The model is the same tiny random model and
answers with random letters, which the agents show as their answer; its head is changed so
that it also writes EOS now and then (``_ends_its_answers``): agents take an answer cut at
``max_tokens`` for an error.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import SubmitTap, start_stack

from dualpath.config import ModelConfigSpec, default_of
from dualpath.model import make_tiny_model

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
QWEN_TEMPLATE = ROOT / "tests" / "data" / "chat_templates" / "qwen2.5-instruct.jinja"
MODEL = "tiny-agent"
VOCAB = 8192
CLIS = ("@anthropic-ai/claude-code", "@openai/codex")
CACHED_SHARE = 0.9
EOS, EOS_GAIN = 258, 2.0  # <|im_end|>


def merged_tiny_model(out: Path) -> Path:
    """The tiny model with a 128K context and a BPE tokenizer whose merges were learned from
    this repository's text. Bytes keep ids 0..255 and the special tokens theirs (the model's
    embeddings and head are indexed by them); the learned tokens take the reserved ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    make_tiny_model(out, vocab=VOCAB, max_position=131072)
    spec = json.loads((out / "tokenizer.json").read_text())
    base = {t: i for t, i in spec["model"]["vocab"].items() if i < 259}  # bytes and specials
    learner = Tokenizer(models.BPE())
    learner.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    trainer = trainers.BpeTrainer(vocab_size=VOCAB - 3, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    corpus = [ROOT / "README.md", *sorted(ROOT.glob("libs/**/*.py")), *sorted(ROOT.glob("services/**/*.py"))]
    learner.train([str(p) for p in corpus if p.is_file()], trainer)
    learned = json.loads(learner.to_str())["model"]
    for token, _ in sorted(learned["vocab"].items(), key=lambda kv: kv[1]):
        if token not in base and len(base) < VOCAB:
            base[token] = len(base)
    spec["model"]["vocab"] = base
    spec["model"]["merges"] = [m for m in learned["merges"] if "".join(m if isinstance(m, list) else m.split(" ")) in base]
    spec["pre_tokenizer"] = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    (out / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    cfg["chat_template"] = QWEN_TEMPLATE.read_text(encoding="utf-8")  # renders tools, as Qwen's own does
    (out / "tokenizer_config.json").write_text(json.dumps(cfg), encoding="utf-8")
    _ends_its_answers(out)
    return out


def _ends_its_answers(out: Path) -> None:
    """Make the model end its answers: the tiny model never writes EOS (its head has rows
    for letters and digits only), and Claude Code takes an answer cut at max_tokens for an
    error. ``<|im_end|>``'s head row becomes twice the row of one letter: EOS then wins
    wherever that letter leads by enough, on roughly one step in ten."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(out / "model.safetensors"))
    head = tensors["lm_head.weight"]  # [vocab, hidden]
    head[EOS] = EOS_GAIN * head[ord("e")]
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def clis(tmp_path_factory) -> Path:
    """``bin/`` of a temporary npm prefix holding both CLIs."""
    npm = shutil.which("npm")
    if npm is None:
        pytest.skip("npm is not installed: the Claude Code and Codex CLIs come from the npm registry")
    prefix = tmp_path_factory.mktemp("npm")
    try:
        proc = subprocess.run(
            [npm, "install", "--prefix", str(prefix), "--no-audit", "--no-fund", *CLIS], capture_output=True, text=True, timeout=600
        )
    except subprocess.TimeoutExpired:
        pytest.skip("npm install of the CLIs took over 10 minutes (registry unreachable?)")
    if proc.returncode != 0:
        pytest.skip(f"npm install {' '.join(CLIS)} failed (registry unreachable?): {proc.stderr[-500:]}")
    return prefix / "node_modules" / ".bin"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    base = tmp_path_factory.mktemp("agent-clis")
    s = start_stack(merged_tiny_model(base / MODEL), base / "storage", base / "run", kv_capacity_tokens=262144)
    try:
        yield s
    finally:
        s.stop()


def finished_requests(stack) -> list[dict]:
    """The gateway's ``request_finished`` lines so far, oldest first."""
    lines = (Path(stack.cfg.run_dir) / "logs" / "gateway.log").read_text().splitlines()
    return [rec for rec in (json.loads(ln) for ln in lines if '"request_finished"' in ln)]


def run(cmd: list[str], env: dict[str, str], cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    print(f"$ {' '.join(cmd)}\n  exit {proc.returncode}\n  stdout: {proc.stdout[-1500:]}\n  stderr: {proc.stderr[-1500:]}")
    return proc


def check_turns(stack, before: int, label: str) -> list[dict]:
    """The session's requests; the last one reads from the cache every full block of the
    request before it (its prompt extends that one's), and most of its own prompt."""
    reqs = finished_requests(stack)[before:]
    print(f"{label}: " + "; ".join(f"prompt {r['prompt_tokens']} cached {r['cached_tokens']}" for r in reqs))
    assert len(reqs) >= 2 and all(r["finish_reason"] != "error" for r in reqs), reqs
    prev, last = reqs[-2], reqs[-1]
    block = default_of(ModelConfigSpec, "block_tokens")
    assert last["cached_tokens"] >= prev["prompt_tokens"] // block * block > 0, reqs
    assert last["cached_tokens"] >= CACHED_SHARE * last["prompt_tokens"] - block, reqs  # within a block of 90%
    return reqs


def test_claude_code_runs_a_two_turn_session_and_its_second_request_is_a_cache_hit(stack, clis, tmp_path):
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(home),
        "ANTHROPIC_BASE_URL": stack.url,
        "ANTHROPIC_API_KEY": "unused",
        "ANTHROPIC_MODEL": MODEL,
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": MODEL,  # any background request goes to the served model too
        "ANTHROPIC_DEFAULT_SONNET_MODEL": MODEL,
        "ANTHROPIC_DEFAULT_OPUS_MODEL": MODEL,
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_AUTOUPDATER": "1",
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "256",
    }
    before = len(finished_requests(stack))
    claude = [str(clis / "claude"), "-p", "--output-format", "json", "--model", MODEL]
    with SubmitTap(stack) as tap:
        first = run([*claude, "List the files in this directory."], env, work)
        assert first.returncode == 0, first.stderr
        out1 = json.loads(first.stdout)
        assert out1["is_error"] is False and out1["result"]
        second = run([*claude, "--resume", out1["session_id"], "Now summarise them."], env, work)
        assert second.returncode == 0, second.stderr
    out2 = json.loads(second.stdout)
    assert out2["is_error"] is False and out2["session_id"] == out1["session_id"]
    reqs = check_turns(stack, before, "claude code")
    usage = out2["usage"]  # what Claude Code itself reports for its second run
    assert usage["cache_read_input_tokens"] == reqs[-1]["cached_tokens"]
    sessions = {tap.sessions[r["request_id"]] for r in reqs}  # metadata.user_id, the same on both turns
    assert len(sessions) == 1 and out1["session_id"] in sessions.pop()


def _codex_home(home: Path, url: str) -> dict[str, str]:
    codex = home / ".codex"
    codex.mkdir(parents=True)
    (codex / "config.toml").write_text(
        f'model = "{MODEL}"\nmodel_provider = "dualpath"\n\n'
        "[model_providers.dualpath]\n"
        'name = "DualPath"\n'
        f'base_url = "{url}/v1"\n'
        'wire_api = "responses"\n'
        'env_key = "DUALPATH_API_KEY"\n'
    )
    return {"PATH": os.environ["PATH"], "HOME": str(home), "CODEX_HOME": str(codex), "DUALPATH_API_KEY": "unused"}


def test_codex_exec_runs_a_two_turn_session_and_its_second_request_is_a_cache_hit(stack, clis, tmp_path):
    home, work = tmp_path / "home", tmp_path / "work"
    work.mkdir()
    env = _codex_home(home, stack.url)
    before = len(finished_requests(stack))
    codex = [str(clis / "codex"), "exec", "--skip-git-repo-check"]
    with SubmitTap(stack) as tap:
        first = run([*codex, "List the files in this directory."], env, work)
        assert first.returncode == 0, first.stderr
        second = run([*codex, "resume", "--last", "--skip-git-repo-check", "Now summarise them."], env, work)
        assert second.returncode == 0, second.stderr
    reqs = check_turns(stack, before, "codex")
    sessions = {tap.sessions[r["request_id"]] for r in reqs}  # prompt_cache_key: Codex's thread id
    assert len(sessions) == 1 and sessions.pop()


@pytest.mark.anyio
async def test_agents_sdk_default_model_runs_two_turns_on_the_responses_api(stack):
    agents = pytest.importorskip("agents")
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    agents.set_default_openai_client(client, use_for_tracing=False)
    agents.set_tracing_disabled(True)
    agent = agents.Agent(
        name="assistant",
        instructions="You are a careful coding agent. " * 40,
        model=MODEL,  # a model name: the SDK's default model class, OpenAIResponsesModel
        model_settings=agents.ModelSettings(max_tokens=200, temperature=0.0),
    )
    before = len(finished_requests(stack))
    with SubmitTap(stack) as tap:
        first = await agents.Runner.run(agent, "List the files.")
        second = await agents.Runner.run(agent, "Now summarise them.", previous_response_id=first.last_response_id)
    assert tap.sessions[first.last_response_id] == tap.sessions[second.last_response_id] == first.last_response_id
    # The random model may end an answer at once (EOS first): an empty answer is still a turn.
    assert isinstance(agent.model, str) and isinstance(first.final_output, str) and isinstance(second.final_output, str)
    reqs = check_turns(stack, before, "agents sdk")
    assert second.raw_responses[-1].usage.input_tokens_details.cached_tokens == reqs[-1]["cached_tokens"]
    await client.close()
