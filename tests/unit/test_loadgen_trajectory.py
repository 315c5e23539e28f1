"""Trajectory JSONL format: round trips, precise errors, scaling, capping, datasets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadgen.dataset import load_dataset
from loadgen.errors import InputError, TrajectoryFormatError
from loadgen.trajectory import Trajectory, load_trajectories, save_trajectories


def _write(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


def test_length_and_text_trajectories_survive_a_save_and_load(tmp_path: Path) -> None:
    trajectories = [
        Trajectory(id="a", system_tokens=12, append_tokens=(5, 0, 7), gen_tokens=(3, 1, 9)),
        Trajectory(
            id="b",
            system_tokens=2,
            system_text="you are",
            append_tokens=(2, 1),  # 1 token ~ 4 chars
            append_texts=("hello", "ok"),
            gen_tokens=(4, 4),
        ),
    ]
    path = tmp_path / "t.jsonl"
    save_trajectories(path, trajectories)
    assert load_trajectories(path) == trajectories


def test_prompt_lengths_grow_by_each_append_and_answer() -> None:
    t = Trajectory(id="a", system_tokens=10, append_tokens=(5, 6), gen_tokens=(3, 4))
    assert t.prompt_lengths() == [15, 24]
    assert t.total_tokens == 28


@pytest.mark.parametrize(
    ("line", "field"),
    [
        ('{"append_tokens": [1, 2], "gen_tokens": [1, -2]}', "gen_tokens[1]"),
        ('{"append_tokens": [1, 2], "gen_tokens": [1]}', "append_tokens"),
        ('{"append_tokens": [1], "gen_tokens": [1], "colour": 1}', "colour"),
        ('{"append_tokens": [1]}', "gen_tokens"),
        ('{"append_tokens": ["x"], "gen_tokens": [1]}', "append_tokens[0]"),
        ('{"system_tokens": -1, "append_tokens": [1], "gen_tokens": [1]}', "system_tokens"),
        ('{"appends": ["a"], "append_tokens": [1], "gen_tokens": [1]}', "append_tokens"),
        ('{"append_tokens": [0], "gen_tokens": [1]}', "append_tokens"),
        ("[1, 2]", ""),
    ],
)
def test_a_malformed_line_is_reported_with_its_line_number_and_field(tmp_path: Path, line: str, field: str) -> None:
    good = '{"append_tokens": [1], "gen_tokens": [1]}'
    path = _write(tmp_path / "t.jsonl", [good, "", line])
    with pytest.raises(TrajectoryFormatError) as info:
        load_trajectories(path)
    assert info.value.line == 3 and info.value.field == field
    assert "line 3" in str(info.value) and str(path) in str(info.value)


def test_invalid_json_names_the_line(tmp_path: Path) -> None:
    path = _write(tmp_path / "t.jsonl", ['{"append_tokens": [1], "gen_tokens": [1]}', "{not json"])
    with pytest.raises(TrajectoryFormatError, match="line 2: not valid JSON"):
        load_trajectories(path)


def test_empty_or_missing_files_are_refused(tmp_path: Path) -> None:
    with pytest.raises(TrajectoryFormatError, match="no trajectories"):
        load_trajectories(_write(tmp_path / "empty.jsonl", ["", "  "]))
    with pytest.raises(TrajectoryFormatError, match="cannot read"):
        load_trajectories(tmp_path / "absent.jsonl")


def test_scaling_multiplies_lengths_and_keeps_every_turn_non_empty() -> None:
    t = Trajectory(id="a", system_tokens=1000, append_tokens=(600, 30), gen_tokens=(150, 20)).scaled(0.01)
    assert (t.system_tokens, t.append_tokens, t.gen_tokens) == (10, (6, 1), (2, 1))


def test_capping_keeps_the_first_turns_only() -> None:
    t = Trajectory(id="a", system_tokens=1, append_tokens=(1, 2, 3), gen_tokens=(4, 5, 6), append_texts=("a", "b", "c"))
    capped = t.capped(2)
    assert capped.gen_tokens == (4, 5) and capped.append_texts == ("a", "b")
    assert t.capped(None) is t and t.capped(10) is t


def test_synthetic_dataset_applies_agents_turns_and_scale() -> None:
    agents = load_dataset("64k", agents=20, seed=1, turns=3, scale=0.01)
    assert len(agents) == 20
    assert all(a.turns <= 3 for a in agents)
    assert max(a.system_tokens for a in agents) < 300  # ~9K system prompts scaled by 0.01


def test_a_short_file_is_cycled_and_copies_of_recorded_text_get_a_distinct_prefix(tmp_path: Path) -> None:
    path = _write(
        tmp_path / "t.jsonl",
        [
            json.dumps({"id": "r", "system": "sys", "appends": ["x"], "gen_tokens": [2]}),
            json.dumps({"id": "s", "append_tokens": [3], "gen_tokens": [2]}),
        ],
    )
    agents = load_dataset(str(path), agents=5)
    assert [a.id for a in agents] == ["r", "s", "r#1", "s#1", "r#2"]
    assert agents[0].system_text == "sys"
    assert agents[2].system_text == "agent2: sys" and agents[4].system_text == "agent4: sys"
    assert load_dataset(str(path)) == agents[:2]


@pytest.mark.parametrize("kwargs", [dict(agents=0), dict(turns=0), dict(scale=0.0)])
def test_dataset_refuses_non_positive_sizes(kwargs: dict) -> None:
    with pytest.raises(InputError):
        load_dataset("32k", **kwargs)


def test_unknown_dataset_name_is_an_input_error() -> None:
    with pytest.raises(InputError, match="32k, 48k, 64k"):
        load_dataset("128k")


def test_from_turn_folds_the_first_turns_into_the_system_prompt_and_keeps_later_prompts():
    from loadgen.trajectory import Trajectory

    t = Trajectory(id="a", system_tokens=100, append_tokens=(10, 20, 30, 40), gen_tokens=(1, 2, 3, 4))
    mid = t.from_turn(2)
    assert (mid.system_tokens, mid.append_tokens, mid.gen_tokens) == (133, (30, 40), (3, 4))
    assert mid.prompt_lengths() == t.prompt_lengths()[2:] and mid.total_tokens == t.total_tokens
    assert t.from_turn(0) is t and t.from_turn(99).turns == 1  # at least the last turn stays
    text = Trajectory(
        id="b", system_tokens=2, append_tokens=(1, 1, 1), gen_tokens=(5, 5, 5), system_text="sys.", append_texts=("one.", "two.", "three.")
    )
    folded = text.from_turn(2)
    assert folded.system_text == "sys.one.two." and folded.append_texts == ("three.",) and folded.gen_tokens == (5,)


def test_load_dataset_start_at_meets_agents_mid_rollout_and_rejects_out_of_range():
    from loadgen.dataset import load_dataset
    from loadgen.errors import InputError

    start = load_dataset("64k", agents=40, seed=1, turns=2)
    mid = load_dataset("64k", agents=40, seed=1, turns=2, start_at=0.5)
    assert sum(t.prompt_lengths()[0] for t in mid) > 2 * sum(t.prompt_lengths()[0] for t in start)
    for bad in (-0.1, 1.0):
        with pytest.raises(InputError, match="start-at"):
            load_dataset("64k", agents=2, start_at=bad)


def test_from_turn_on_mixed_text_and_length_trajectories_folds_lengths_and_slices_texts():
    from loadgen.trajectory import Trajectory

    text_system = Trajectory(id="c", system_tokens=3, append_tokens=(4, 5, 6), gen_tokens=(1, 1, 1), system_text="system.")
    a = text_system.from_turn(1)
    assert a.system_text is None and a.system_tokens == 3 + 4 + 1 and a.append_tokens == (5, 6)
    length_system = Trajectory(id="d", system_tokens=50, append_tokens=(1, 1, 2), gen_tokens=(7, 7, 7), append_texts=("a.", "b.", "cc."))
    b = length_system.from_turn(2)
    assert b.system_tokens == 50 + 1 + 1 + 7 + 7 and b.append_texts == ("cc.",) and b.gen_tokens == (7,)
