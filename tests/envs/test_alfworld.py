"""ALFWorld on the real engine and the real json_2.1.1 games."""

from __future__ import annotations

import io
import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from envs import ENVS, make_env_spec
from envs.alfworld.experts import _as_put, task_params
from envs.alfworld.game import GameLoadError
from envs.alfworld.spec import DATA_SUBDIR, TASK_TYPES
from envs.base import PromptContext, split_tasks
from envs.pool import EnvPool
from turnopd.config import EnvConfig
from turnopd.core.data import DataNotFoundError, resolve_data

# A 4-step game: the alarm clock is on desk 2, the desk lamp on desk 1.
LOOK_GAME = "look_at_obj_in_light-AlarmClock-None-DeskLamp-308/trial_T20190908_222917_366542"


def alfworld(**config) -> object:
    return make_env_spec(EnvConfig(name="alfworld", **config))


@pytest.fixture(scope="module")
def spec():
    return alfworld()


def test_registered() -> None:
    assert "alfworld" in ENVS


def test_split_sizes_and_order(spec) -> None:
    root = resolve_data(DATA_SUBDIR)
    for split, size in {"train": 600, "valid_train": 200, "valid_seen": 140, "valid_unseen": 134}.items():
        tasks = spec.tasks(split)
        assert len(tasks) == size
        assert tasks == sorted(tasks)
        assert tasks == alfworld().tasks(split)  # a fresh spec lists the same order
        assert all((root / split / t / "game.tw-pddl").is_file() for t in tasks)
    assert spec.splits() == ["train", "valid_train", "valid_seen", "valid_unseen"]
    assert LOOK_GAME in spec.tasks("valid_unseen")


def test_task_types_and_max_tasks(spec) -> None:
    root = resolve_data(DATA_SUBDIR) / "valid_unseen"
    # counted straight from the folder names on disk
    on_disk = sorted(p.parent.relative_to(root).as_posix() for p in root.glob("*/*/game.tw-pddl")
                     if p.parts[-3].startswith(("look_at_obj_in_light-", "pick_two_obj_and_place-")))
    picked = alfworld(task_types=["pick_two_obj_and_place", "look_at_obj_in_light"]).tasks("valid_unseen")
    assert picked == on_disk
    assert {spec.task_type(t) for t in picked} == {"look_at_obj_in_light", "pick_two_obj_and_place"}
    assert alfworld(task_types=["look_at_obj_in_light"], max_tasks=5).tasks("valid_unseen") == [
        t for t in on_disk if t.startswith("look_at")][:5]
    assert {spec.task_type(t) for t in spec.tasks("train")} == set(TASK_TYPES)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"task_types": ["pick_and_eat"]}, "unknown ALFWorld task types \\['pick_and_eat'\\]"),
        ({"template": "fancy"}, "unknown prompt template 'fancy' for env 'alfworld'; allowed: default"),
        ({"options": {"expert": "oracle"}}, "unknown alfworld expert 'oracle'; allowed: walkthrough, handcoded"),
        ({"options": {"colour": 1}}, "unknown alfworld options \\['colour'\\]"),
    ],
)
def test_bad_config(config: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        alfworld(**config)


def test_unknown_split(spec) -> None:
    with pytest.raises(ValueError, match="unknown ALFWorld split 'test'; allowed: train, valid_train"):
        spec.tasks("test")


def test_several_splits_joined_by_plus(spec) -> None:
    joined = split_tasks(spec, "valid_seen + valid_unseen")
    assert len(joined) == 140 + 134
    assert joined[:140] == spec.tasks("valid_seen") and joined[140:] == spec.tasks("valid_unseen")
    assert split_tasks(spec, "train") == spec.tasks("train")
    with pytest.raises(ValueError, match="unknown alfworld split 'test' in 'valid_seen\\+test'; allowed: train, "):
        split_tasks(spec, "valid_seen+test")
    with pytest.raises(ValueError, match="names a split twice"):
        split_tasks(spec, "valid_seen+valid_seen")


def test_missing_data_says_where_it_looked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # hide every default data root (cwd/../shared/data, the repo's ../shared/data, the user cache)
    # ($TURNOPD_DATA is searched first, then those; a recipe's data_dir is searched alone)
    monkeypatch.setenv("TURNOPD_DATA", str(tmp_path / "mine"))
    monkeypatch.setattr("turnopd.core.data.REPO_ROOT", tmp_path / "repo")
    monkeypatch.setattr("turnopd.core.data.USER_DATA", tmp_path / "cache")
    (tmp_path / "cwd").mkdir()
    (tmp_path / "mine").mkdir()  # a data folder without alfworld/ in it
    monkeypatch.chdir(tmp_path / "cwd")
    with pytest.raises(DataNotFoundError) as err:
        make_env_spec(EnvConfig(name="alfworld"))
    message = str(err.value)
    assert str(tmp_path / "mine" / "alfworld" / "json_2.1.1") in message
    assert str(tmp_path / "cache" / "alfworld" / "json_2.1.1") in message
    assert "TURNOPD_DATA" in message


def test_a_data_folder_the_user_named_must_exist(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # before, a $TURNOPD_DATA that does not exist was skipped silently and ../shared/data read instead
    monkeypatch.setenv("TURNOPD_DATA", str(tmp_path / "typo"))
    with pytest.raises(DataNotFoundError, match=r"\$TURNOPD_DATA is '.*typo', which is not a folder"):
        make_env_spec(EnvConfig(name="alfworld"))
    monkeypatch.delenv("TURNOPD_DATA")
    with pytest.raises(DataNotFoundError, match=r"the recipe's data_dir is '.*nope', which is not a folder"):
        make_env_spec(EnvConfig(name="alfworld"), str(tmp_path / "nope"))
    # a data_dir that exists but lacks the env's data is refused, not replaced by ../shared/data
    with pytest.raises(DataNotFoundError, match=r"^\S*/alfworld/json_2.1.1 not found: the recipe's data_dir '.*' lacks"):
        make_env_spec(EnvConfig(name="alfworld"), str(tmp_path))


def test_walkthrough_wins_a_real_game(spec) -> None:
    env = spec.make()
    outcome = env.reset(LOOK_GAME)
    assert outcome.observation.startswith("-= Welcome to TextWorld, ALFRED! =-")
    assert outcome.observation.endswith("Your task is to: examine the alarmclock with the desklamp.")
    assert outcome.info["task"] == "examine the alarmclock with the desklamp."
    assert (outcome.done, outcome.won, outcome.reward) == (False, False, 0.0)
    assert "go to desk 2" in outcome.admissible
    expert = spec.expert(LOOK_GAME)
    played = []
    while not outcome.done and len(played) < 50:
        action = expert.act(outcome)
        assert action in outcome.admissible
        outcome = env.step(action)
        played.append((action, outcome.observation, outcome.won, outcome.reward))
        assert outcome.info["invalid"] is False
    env.close()
    assert [a for a, *_ in played] == ["go to desk 2", "take alarmclock 1 from desk 2", "go to desk 1",
                                       "use desklamp 1"]
    assert played[0][1] == "You arrive at desk 2. On the desk 2, you see a alarmclock 1."
    assert played[1][1] == "You pick up the alarmclock 1 from the desk 2."
    # won, with reward 1, only on the last step
    assert [(won, reward) for *_, won, reward in played] == [(False, 0.0)] * 3 + [(True, 1.0)]
    assert outcome.done


FAST_TEXT_TASK_TYPES = ["look_at_obj_in_light", "pick_and_place_simple"]


def play_random(task_ids: list[str], turns: int) -> list[list]:
    """Every observation, admissible list and outcome of seeded random admissible play (notebook on)."""
    env = alfworld(task_types=FAST_TEXT_TASK_TYPES, options={"notes": True}).make()
    rng = random.Random(0)
    seen = []
    for task_id in task_ids:
        outcome = env.reset(task_id)
        seen.append([outcome.observation, outcome.admissible])
        for _ in range(turns):
            action = rng.choice(outcome.admissible)
            outcome = env.step(action)
            seen.append([action, outcome.observation, outcome.admissible, outcome.reward, outcome.done, outcome.won])
            if outcome.done:
                break
    env.close()
    return seen


def play_in_child(task_ids: list[str], out: Path, *, speedups: bool, cache: Path) -> list[list]:
    """play_random in a fresh process, with TurnOPD's engine speed-ups installed or not."""
    off = "" if speedups else "game._cache_game_loading = game._speed_up_text_generation = lambda: None\n"
    script = ("import json\n"
              "import envs.alfworld.game as game\n" + off +
              "from textworld.envs.pddl import textgen\n"
              "from tests.envs.test_alfworld import play_random\n"
              f"seen = play_random({task_ids!r}, turns=25)\n"
              f"assert hasattr(textgen.copy_context, '__wrapped__') is {speedups}\n"
              f"json.dump(seen, open({str(out)!r}, 'w'))\n")
    subprocess.run([sys.executable, "-c", script], check=True, cwd=Path(__file__).parents[2],
                   env={**os.environ, "TURNOPD_CACHE": str(cache)})
    return json.loads(out.read_text())


def test_engine_speedups_write_the_same_text(tmp_path: Path) -> None:
    """envs.alfworld.game caches game loading on disk (PDDL translation, parsed game logic), memoizes
    TextWorld's grammar parsers and copies derivation contexts one level deep: every feedback and
    admissible command must be what TextWorld itself writes, on games of both cpu task types, with
    the disk cache cold (filled by this play) and warm (read back by a second process)."""
    tasks = alfworld(task_types=FAST_TEXT_TASK_TYPES).tasks("valid_unseen")
    task_ids = tasks[:2] + tasks[-2:]
    assert {task_id.split("-")[0] for task_id in task_ids} == set(FAST_TEXT_TASK_TYPES)
    cache = tmp_path / "cache"
    original = play_in_child(task_ids, tmp_path / "original.json", speedups=False, cache=cache)
    assert not cache.exists()
    cold = play_in_child(task_ids, tmp_path / "cold.json", speedups=True, cache=cache)
    cached = {folder.name: len(list(folder.iterdir())) for folder in cache.glob("alfworld-games/*/*")}
    games = [json.loads((resolve_data(DATA_SUBDIR) / "valid_unseen" / t / "game.tw-pddl").read_text()) for t in task_ids]
    # a translation per game with optimize on and off; a parsed logic per distinct grammar text
    assert cached == {"pddl2sas": 2 * len(task_ids), "game-logic": len({game["grammar"] for game in games})}
    warm = play_in_child(task_ids, tmp_path / "warm.json", speedups=True, cache=cache)
    assert len(original) > 60
    assert cold == original
    assert warm == original


def test_disk_cache_of_game_loading(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from envs.alfworld.game import _cached_on_disk

    calls = []

    def square(x: int, *, shift: int = 0) -> dict:
        calls.append(x)
        return {"value": x * x + shift}

    monkeypatch.setenv("TURNOPD_CACHE", str(tmp_path / "cache"))
    cached = _cached_on_disk(square, "square")
    assert cached(3) == {"value": 9} and cached(3) == {"value": 9} and cached(3, shift=1) == {"value": 10}
    assert calls == [3, 3]  # the second call was read back from disk; another argument is another entry
    files = sorted((tmp_path / "cache").rglob("square/*.pkl.z"))
    assert len(files) == 2
    for file in files:
        file.write_bytes(b"torn")  # an unreadable entry is computed again and rewritten
    assert cached(3) == {"value": 9} and calls == [3, 3, 3]
    assert cached(3) == {"value": 9} and calls == [3, 3, 3]
    # a cache folder that cannot be written only costs speed
    (tmp_path / "file").write_text("not a folder")
    monkeypatch.setenv("TURNOPD_CACHE", str(tmp_path / "file"))
    uncached = _cached_on_disk(square, "square")
    assert uncached(4) == {"value": 16} and uncached(4) == {"value": 16} and calls[-2:] == [4, 4]


def test_invalid_actions_do_nothing(spec) -> None:
    env = spec.make()
    first = env.reset(LOOK_GAME)
    garbage = "\x00\ufffd\u202e☃\U0001f600"
    for raw in ["<action>dance with the desklamp</action>", "<action>" + "x" * 10_000 + "</action>",
                f"<action>{garbage}</action>", "<action></action>", "no tags at all"]:
        action = spec.parse_action(raw).action
        outcome = env.step(action)
        assert outcome.observation == "Nothing happens."
        assert outcome.info["invalid"] is True
        assert (outcome.done, outcome.won) == (False, False)
        assert outcome.admissible == first.admissible  # nothing moved
    # case: the model wrote capitals; ALFWorld's engine does not fold case, the parser does
    parsed = spec.parse_action("<think>lamp</think><action>Go to Desk 2</action>")
    assert (parsed.action, parsed.valid) == ("go to desk 2", True)
    assert env.step("Go to Desk 2").observation == "Nothing happens."
    assert env.step(parsed.action).observation.startswith("You arrive at desk 2.")
    env.close()


def test_prompt(spec) -> None:
    ctx = PromptContext(task="examine the alarmclock with the desklamp.", step=3,
                        observation="You arrive at desk 1.",
                        history=[("You arrive at desk 2.", "take alarmclock 1 from desk 2"),
                                 ("You pick up the alarmclock 1 from the desk 2.", "go to desk 1")],
                        admissible=["go to desk 1", "help", "use desklamp 1"], answer_format="think_action")
    prompt = spec.render_prompt(ctx)
    assert "Your task is to: examine the alarmclock with the desklamp." in prompt
    assert "you have already taken 3 step(s)" in prompt
    assert "[Observation 2: 'You arrive at desk 2.', Action 2: 'take alarmclock 1 from desk 2']" in prompt
    assert "[Observation 3: 'You pick up the alarmclock 1 from the desk 2.', Action 3: 'go to desk 1']" in prompt
    assert "You are now at step 4 and your current observation is: You arrive at desk 1." in prompt
    assert "admissible actions of the current situation are: ['go to desk 1', 'use desklamp 1']." in prompt
    assert prompt.endswith("within <action> </action> tags.")
    first = spec.render_prompt(PromptContext(task="t", step=0, observation="Welcome", history=[],
                                             admissible=["look"], answer_format="action"))
    assert "step(s)" not in first and "Your current observation is: Welcome" in first
    assert first.endswith("Present your action for the current step within <action> </action> tags.")


def test_handcoded_task_params() -> None:
    # ALFRED's folder name: <type>-<object>-<movable receptacle>-<receptacle or lamp>-<scene>
    assert task_params("look_at_obj_in_light-AlarmClock-None-DeskLamp-308/trial_T1") == {
        "task_type": "look_at_obj_in_light", "object_target": "alarmclock", "object_sliced": False,
        "mrecep_target": "", "parent_target": "", "toggle_target": "desklamp"}
    assert task_params("pick_two_obj_and_place-Pillow-None-Sofa-219/trial_T2") == {
        "task_type": "pick_two_obj_and_place", "object_target": "pillow", "object_sliced": False,
        "mrecep_target": "", "parent_target": "sofa", "toggle_target": ""}
    assert _as_put("move cd 3 to safe 1") == "put cd 3 in/on safe 1"
    assert _as_put("go to safe 1") == "go to safe 1"


def test_handcoded_expert_wins_a_real_game() -> None:
    spec = alfworld(options={"expert": "handcoded"})
    env = spec.make()
    outcome = env.reset(LOOK_GAME)
    assert "facts" in outcome.info
    expert = spec.expert(LOOK_GAME)
    actions = []
    while not outcome.done and len(actions) < 50:
        actions.append(expert.act(outcome))
        outcome = env.step(actions[-1])
    env.close()
    assert outcome.won
    assert actions[0] == "look"  # as alfworld's expert wrapper, it first looks around
    # it finds the alarm clock by searching: it must have visited desk 2 before taking it there
    assert actions.index("go to desk 2") < actions.index("take alarmclock 1 from desk 2")
    # same task and seed, same episode
    replay_env, replay = spec.make(), spec.expert(LOOK_GAME)
    outcome = replay_env.reset(LOOK_GAME)
    for action in actions:
        assert replay.act(outcome) == action
        outcome = replay_env.step(action)
    replay_env.close()


def _damaged_copy(tmp_path: Path, how: str) -> tuple[Path, str]:
    source = resolve_data(DATA_SUBDIR) / "valid_unseen" / LOOK_GAME / "game.tw-pddl"
    task_id = f"pick_and_place_simple-Pen-None-Desk-1/trial_{how}"
    target = tmp_path / DATA_SUBDIR / "valid_unseen" / task_id / "game.tw-pddl"
    target.parent.mkdir(parents=True)
    if how == "not_json":
        target.write_text('{"pddl_domain": "(define (domain')
    else:  # valid JSON, PDDL cut in half
        game = json.loads(source.read_text())
        game["pddl_problem"] = game["pddl_problem"][: len(game["pddl_problem"]) // 2]
        target.write_text(json.dumps(game))
    return tmp_path, task_id


@pytest.mark.parametrize("how", ["not_json", "cut_pddl"])
def test_corrupted_game_gives_a_named_error(tmp_path: Path, how: str) -> None:
    data_dir, task_id = _damaged_copy(tmp_path, how)
    spec = make_env_spec(EnvConfig(name="alfworld"), str(data_dir))
    assert spec.tasks("valid_unseen") == [task_id]
    with pytest.raises(GameLoadError, match=f"cannot load ALFWorld game .*{task_id}/game.tw-pddl"):
        spec.make().reset(task_id)


def test_corrupted_game_in_the_pool_fails_by_env(tmp_path: Path) -> None:
    data_dir, broken = _damaged_copy(tmp_path, "not_json")
    good = "pick_and_place_simple-Pen-None-Desk-1/trial_good"
    shutil.copytree(resolve_data(DATA_SUBDIR) / "valid_unseen" / LOOK_GAME,
                    data_dir / DATA_SUBDIR / "valid_unseen" / good)
    spec = make_env_spec(EnvConfig(name="alfworld"), str(data_dir))
    with EnvPool(spec, num_workers=1, step_timeout_s=120) as pool:
        bad_outcome, good_outcome = pool.reset([broken, good])
        assert (bad_outcome.done, bad_outcome.won) == (True, False)
        assert "GameLoadError: cannot load ALFWorld game" in bad_outcome.info["env_error"]
        assert broken in bad_outcome.info["env_error"]
        assert good_outcome.info["task"] == "examine the alarmclock with the desklamp."
        assert pool.step({1: "go to desk 2"})[1].observation.startswith("You arrive at desk 2.")
        assert pool.restarts == 0


@pytest.mark.slow
def test_walkthrough_wins_one_game_of_each_type(spec) -> None:
    tasks = spec.tasks("valid_unseen")
    firsts = [next(t for t in tasks if spec.task_type(t) == kind) for kind in TASK_TYPES]
    env = spec.make()
    for task_id in firsts:
        outcome, expert, turns = env.reset(task_id), spec.expert(task_id), 0
        while not outcome.done and turns < 50:
            outcome, turns = env.step(expert.act(outcome)), turns + 1
        assert outcome.won, task_id
    env.close()


def test_cli_play_and_expert(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    from turnopd.cli import main

    # a person types the walkthrough of task 0 (LOOK_GAME), one command in capitals (the parser folds case)
    walkthrough = json.loads((resolve_data(DATA_SUBDIR) / "valid_unseen" / LOOK_GAME / "game.tw-pddl")
                             .read_text())["walkthrough"]
    monkeypatch.setattr("sys.stdin", io.StringIO("go to desk 2\nTAKE alarmclock 1 from desk 2\n"
                                                 "go to desk 1\nuse desklamp 1\n"))
    assert walkthrough == ["go to desk 2", "take alarmclock 1 from desk 2", "go to desk 1", "use desklamp 1"]
    assert main(["env", "play", "alfworld", "--split", "valid_unseen", "--task", "0"]) == 0
    out = capsys.readouterr().out
    assert f"task {LOOK_GAME}" in out and "end after 4 steps: won=True reward=1" in out

    assert main(["env", "expert", "alfworld", "--split", "valid_unseen", "--n", "2", "--workers", "1",
                 "max_turns=3"]) == 0
    out = capsys.readouterr().out
    # both look_at_obj_in_light games need 4 steps: with 3 turns the expert cannot finish them
    assert "2/2 episodes played (0 failed by the env, 0 worker restarts)" in out
    assert "│ all " in out and "0.0%" in out and "3.0" in out

    assert main(["env", "expert", "alfworld", "--split", "test"]) == 2
    assert "unknown ALFWorld split 'test'" in capsys.readouterr().err
