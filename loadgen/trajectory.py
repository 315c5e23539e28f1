"""Agent trajectories and their JSONL file format.

One agent per line, a JSON object::

    {"id": "agent-0",                      # optional, default "line-<n>"
     "system_tokens": 5210,                # or "system": "<text>"; optional (0)
     "append_tokens": [608, 120, ...],     # or "appends": ["<text>", ...]
     "gen_tokens": [148, 90, ...],         # tokens generated per turn (replayed exactly)
     "meta": {...}}                        # optional, ignored

Turn ``i``'s prompt is the system prompt, then for every earlier turn its append and the
answer, then append ``i``. Recorded agent runs keep their texts (``system``/``appends``);
synthetic sets keep only lengths and get text at replay time (``loadgen.prompts``).
Blank lines are skipped; anything else malformed raises ``TrajectoryFormatError`` naming
the line and field.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, NoReturn

from loadgen.errors import TrajectoryFormatError

__all__ = ["Trajectory", "load_trajectories", "save_trajectories", "parse_trajectory"]

_KNOWN = {"id", "system", "system_tokens", "appends", "append_tokens", "gen_tokens", "meta"}


@dataclass(frozen=True, slots=True, kw_only=True)
class Trajectory:
    """One agent: a system prompt and, per turn, an append and a generation length.

    ``system_text``/``append_texts`` are None for length-only (synthetic) agents; when
    present, ``system_tokens``/``append_tokens`` hold their estimated token counts.
    """

    id: str
    system_tokens: int
    append_tokens: tuple[int, ...]
    gen_tokens: tuple[int, ...]
    system_text: str | None = None
    append_texts: tuple[str, ...] | None = None

    @property
    def turns(self) -> int:
        """Number of turns."""
        return len(self.gen_tokens)

    @property
    def total_tokens(self) -> int:
        """Final context length: system + every append + every generation."""
        return self.system_tokens + sum(self.append_tokens) + sum(self.gen_tokens)

    def prompt_lengths(self) -> list[int]:
        """Prompt length (tokens) of every turn."""
        out, ctx = [], self.system_tokens
        for a, g in zip(self.append_tokens, self.gen_tokens):
            ctx += a
            out.append(ctx)
            ctx += g
        return out

    def from_turn(self, k: int) -> Trajectory:
        """The agent as met mid-rollout: turns ``k`` onwards, the first ``k`` turns' appends and
        generations folded into the system prompt (one long synthetic first round, as the paper
        gives extra agents). At least the last turn is kept. Recorded text keeps the appends'
        text; the earlier generations' text is unknown and is left out (lengths fold in full
        only for length-only agents)."""
        k = max(0, min(k, self.turns - 1))
        if k == 0:
            return self
        rest: dict[str, Any] = {
            "append_tokens": self.append_tokens[k:],
            "gen_tokens": self.gen_tokens[k:],
            "append_texts": None if self.append_texts is None else self.append_texts[k:],
        }
        if self.system_text is None or self.append_texts is None:
            # A length-only system prompt (or appends) absorbs the lengths; any system text is
            # kept and the folded turns are added to its length as generated filler.
            folded = self.system_tokens + sum(self.append_tokens[:k]) + sum(self.gen_tokens[:k])
            if self.system_text is None:
                return replace(self, system_tokens=folded, **rest)
            return replace(self, system_text=None, system_tokens=folded, **rest)
        text = self.system_text + "".join(self.append_texts[:k])
        return replace(self, system_text=text, system_tokens=_estimate_tokens(text), **rest)

    def capped(self, turns: int | None) -> Trajectory:
        """The first ``turns`` turns (all when None)."""
        if turns is None or turns >= self.turns:
            return self
        texts = None if self.append_texts is None else self.append_texts[:turns]
        return replace(self, append_tokens=self.append_tokens[:turns], gen_tokens=self.gen_tokens[:turns], append_texts=texts)

    def scaled(self, factor: float) -> Trajectory:
        """Every length multiplied by ``factor`` (rounded; gens and appends stay ≥ 1).

        Texts, when present, are cut to the same fraction of their characters.
        """
        if factor == 1.0:
            return self

        def s(n: int) -> int:
            return max(1, round(n * factor))

        sys_text = None if self.system_text is None else self.system_text[: round(len(self.system_text) * factor)]
        texts = None if self.append_texts is None else tuple(t[: max(1, round(len(t) * factor))] for t in self.append_texts)
        return replace(
            self,
            system_tokens=round(self.system_tokens * factor),
            system_text=sys_text,
            append_tokens=tuple(s(a) for a in self.append_tokens),
            gen_tokens=tuple(s(g) for g in self.gen_tokens),
            append_texts=texts,
        )

    def to_json(self) -> dict:
        """The JSONL object for this agent."""
        out: dict = {"id": self.id}
        if self.system_text is not None:
            out["system"] = self.system_text
        else:
            out["system_tokens"] = self.system_tokens
        if self.append_texts is not None:
            out["appends"] = list(self.append_texts)
        else:
            out["append_tokens"] = list(self.append_tokens)
        out["gen_tokens"] = list(self.gen_tokens)
        return out


def _estimate_tokens(text: str) -> int:
    # Same rule as loadgen.prompts without a tokenizer: 1 token ≈ 4 characters.
    return (len(text) + 3) // 4


def _int_list(obj: dict, key: str, minimum: int, fail: Callable[[str, str], NoReturn]) -> tuple[int, ...]:
    values = obj[key]
    if not isinstance(values, list):
        fail(key, "must be a list of integers")
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
            fail(f"{key}[{i}]", f"must be an integer >= {minimum}, got {v!r}")
    return tuple(values)


def parse_trajectory(obj: object, *, path: str = "<input>", line: int = 1) -> Trajectory:
    """Validate one decoded JSONL object and build its ``Trajectory``.

    Raises TrajectoryFormatError naming ``path``, ``line`` and the offending field.
    """

    def fail(field: str, reason: str) -> NoReturn:
        raise TrajectoryFormatError(path, line, field, reason)

    if not isinstance(obj, dict):
        fail("", f"expected a JSON object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - _KNOWN)
    if unknown:
        fail(unknown[0], f"unknown field (allowed: {', '.join(sorted(_KNOWN))})")
    if "system" in obj and "system_tokens" in obj:
        fail("system", "give either 'system' or 'system_tokens', not both")
    system_text = obj.get("system")
    if system_text is not None and not isinstance(system_text, str):
        fail("system", "must be a string")
    system_tokens = obj.get("system_tokens", 0)
    if isinstance(system_tokens, bool) or not isinstance(system_tokens, int) or system_tokens < 0:
        fail("system_tokens", f"must be an integer >= 0, got {system_tokens!r}")
    if system_text is not None:
        system_tokens = _estimate_tokens(system_text)
    if "gen_tokens" not in obj:
        fail("gen_tokens", "missing")
    gens = _int_list(obj, "gen_tokens", 1, fail)
    if not gens:
        fail("gen_tokens", "an agent needs at least one turn")
    if ("appends" in obj) == ("append_tokens" in obj):
        fail("append_tokens", "give exactly one of 'appends' (texts) or 'append_tokens' (lengths)")
    texts = None
    if "appends" in obj:
        raw = obj["appends"]
        if not isinstance(raw, list) or not all(isinstance(t, str) for t in raw):
            fail("appends", "must be a list of strings")
        texts = tuple(raw)
        appends = tuple(_estimate_tokens(t) for t in texts)
    else:
        appends = _int_list(obj, "append_tokens", 0, fail)
    key = "appends" if texts is not None else "append_tokens"
    if len(appends) != len(gens):
        fail(key, f"has {len(appends)} turns but gen_tokens has {len(gens)}")
    if system_tokens + appends[0] == 0:
        fail(key, "the first turn's prompt is empty (no system prompt and an empty first append)")
    ident = obj.get("id", f"line-{line}")
    if not isinstance(ident, (str, int)) or isinstance(ident, bool):
        fail("id", "must be a string")
    return Trajectory(
        id=str(ident), system_tokens=system_tokens, append_tokens=appends, gen_tokens=gens, system_text=system_text, append_texts=texts
    )


def load_trajectories(path: str | Path) -> list[Trajectory]:
    """Read a JSONL trajectory file.

    Raises TrajectoryFormatError for a malformed line (naming line and field), for an
    unreadable or empty file (line 0).
    """
    name = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TrajectoryFormatError(name, 0, "", f"cannot read file: {exc}") from None
    out = []
    for number, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
        except ValueError as exc:
            raise TrajectoryFormatError(name, number, "", f"not valid JSON ({exc})") from None
        out.append(parse_trajectory(obj, path=name, line=number))
    if not out:
        raise TrajectoryFormatError(name, 0, "", "file holds no trajectories")
    return out


def save_trajectories(path: str | Path, trajectories: Iterable[Trajectory]) -> None:
    """Write trajectories as JSONL (one agent per line). Raises OSError on I/O failure."""
    with open(path, "w", encoding="utf-8") as f:
        for t in trajectories:
            f.write(json.dumps(t.to_json(), separators=(",", ":")) + "\n")
