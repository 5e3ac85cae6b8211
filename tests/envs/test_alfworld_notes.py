"""The ALFWorld notebook (env option `notes`) and the explorer expert that plays from it."""

from __future__ import annotations

import pytest

from envs import make_env_spec
from envs.alfworld.experts import ExplorerExpert
from envs.alfworld.notes import Notebook
from envs.base import PromptContext, StepOutcome
from turnopd.config import EnvConfig

FIRST = ("-= Welcome to TextWorld, ALFRED! =-\n\nYou are in the middle of a room. Looking quickly around "
         "you, you see a shelf 2, a desk 1, a drawer 1, a shelf 1, and a bed 1.\n\n"
         "Your task is to: put some book on shelf.")
LOOK_GAME = "look_at_obj_in_light-AlarmClock-None-DeskLamp-308/trial_T20190908_222917_366542"


BOOK_ON_SHELF = {"task_type": "pick_and_place_simple", "object_target": "book", "object_sliced": False,
                 "mrecep_target": "", "parent_target": "shelf", "toggle_target": ""}


def test_notebook_by_hand() -> None:
    notes = Notebook.for_task(BOOK_ON_SHELF, FIRST)
    assert notes.receptacles == ["shelf 2", "desk 1", "drawer 1", "shelf 1", "bed 1"]
    assert notes.line() == ("[Notes] You are at: the start. Needed here: nothing. You hold: nothing. "
                            "Not visited: shelf 2, desk 1, drawer 1.")
    assert notes.line(admissible=["go to desk 1", "go to bed 1"]) == (  # only places it can go to
        "[Notes] You are at: the start. Needed here: nothing. You hold: nothing. Not visited: desk 1, bed 1.")
    notes.update("go to desk 1", "You arrive at desk 1. On the desk 1, you see a book 3, a book 2, and a pen 1.")
    notes.update("go to bed 9", "Nothing happens.")  # refused: nothing changes
    assert notes.line() == ("[Notes] You are at: desk 1. Needed here: book 2. You hold: nothing. "
                            "Not visited: shelf 2, drawer 1, shelf 1.")  # the lowest-numbered book
    notes.update("take book 2 from desk 1", "You pick up the book 2 from the desk 1.")
    # holding it, the search starts over (now for a shelf)
    assert notes.line() == ("[Notes] You are at: desk 1. Needed here: nothing. You hold: book 2. "
                            "Not visited: shelf 2, shelf 1, drawer 1.")  # shelves first now
    notes.update("move book 2 to shelf 2", "Nothing happens.")  # not there: still held
    assert notes.holding == "book 2"
    notes.update("go to drawer 1", "You arrive at drawer 1. The drawer 1 is closed.")
    assert notes.line().startswith("[Notes] You are at: drawer 1 (closed). Needed here: nothing. You hold: book 2.")
    notes.update("open drawer 1", "You open the drawer 1. The drawer 1 is open. In it, you see nothing.")
    assert notes.line().startswith("[Notes] You are at: drawer 1. Needed here: nothing.")
    notes.update("go to shelf 1", "You arrive at shelf 1. On the shelf 1, you see a vase 1.")
    notes.update("move book 2 to shelf 1", "You move the book 2 to the shelf 1.")
    assert notes.here == ["vase 1", "book 2"] and notes.holding is None
    assert notes.line() == ("[Notes] You are at: shelf 1*. Needed here: book 2. You hold: nothing. "
                            "Not visited: shelf 2, bed 1.")  # a shelf is the goal's kind
    for place in ("shelf 2", "bed 1"):
        notes.update(f"go to {place}", f"You arrive at {place}. On the {place}, you see nothing.")
    # every place visited: the search starts over from the current one
    assert notes.not_visited() == ["shelf 2", "desk 1", "drawer 1", "shelf 1"]


def outcome(observation: str, admissible: list[str]) -> StepOutcome:
    return StepOutcome(observation=observation, admissible=admissible)


def test_explorer_by_hand() -> None:
    expert = ExplorerExpert("pick_and_place_simple-Book-None-Shelf-308/trial_T1")
    go = [f"go to {p}" for p in ("shelf 2", "desk 1", "drawer 1", "shelf 1", "bed 1")]
    assert expert.act(outcome(FIRST, go)) == "go to shelf 2"  # first place not visited
    assert expert.act(outcome("You arrive at shelf 2. On the shelf 2, you see nothing.", go)) == "go to desk 1"
    # the drawer is closed: open it, then look inside
    assert expert.act(outcome("You arrive at desk 1. On the desk 1, you see a pen 1.", go)) == "go to drawer 1"
    drawer = [*go, "open drawer 1"]
    assert expert.act(outcome("You arrive at drawer 1. The drawer 1 is closed.", drawer)) == "open drawer 1"
    opened = [*go, "close drawer 1", "take book 3 from drawer 1", "take book 2 from drawer 1",
              "take bookend 1 from drawer 1"]
    assert expert.act(outcome("You open the drawer 1. In it, you see a book 3, a book 2, a bookend 1.",
                              opened)) == "take book 2 from drawer 1"  # the lowest-numbered book
    # holding it: search again for a shelf, then put it there
    assert expert.act(outcome("You pick up the book 2 from the drawer 1.", go)) == "go to shelf 2"
    assert expert.act(outcome("You arrive at shelf 2. On the shelf 2, you see nothing.",
                              [*go, "move book 2 to shelf 2"])) == "move book 2 to shelf 2"


def test_explorer_noise_plays_marked_detours() -> None:
    go = [f"go to {p}" for p in ("shelf 2", "desk 1", "drawer 1", "shelf 1", "bed 1")]
    noisy = ExplorerExpert("pick_and_place_simple-Book-None-Shelf-308/trial_T1", noise=1.0, seed=3)
    first = noisy.act(outcome(FIRST, go))
    assert noisy.exploring and first != "go to shelf 2"  # a mistake: not the expert's choice
    assert first in go[1:] or first == "go to nowhere"
    calm = ExplorerExpert("pick_and_place_simple-Book-None-Shelf-308/trial_T1", noise=0.0)
    assert calm.act(outcome(FIRST, go)) == "go to shelf 2" and not calm.exploring
    # the same task and seed make the same mistakes
    again = ExplorerExpert("pick_and_place_simple-Book-None-Shelf-308/trial_T1", noise=1.0, seed=3)
    assert again.act(outcome(FIRST, go)) == first


def test_explorer_labels_the_states_another_player_reached() -> None:
    """DAgger relabelling: the notebook follows the commands another player took, and the label is
    the expert's choice from there, never an exploring mistake."""
    go = [f"go to {p}" for p in ("shelf 2", "desk 1", "drawer 1", "shelf 1", "bed 1")]
    expert = ExplorerExpert("pick_and_place_simple-Book-None-Shelf-308/trial_T1", noise=1.0, seed=3)
    assert expert.label(outcome(FIRST, go)) == "go to shelf 2"
    expert.follow("go to bed 1")  # the student went elsewhere: bed 1 is visited, shelf 2 still is not
    assert expert.label(outcome("You arrive at bed 1. On the bed 1, you see nothing.", go)) == "go to shelf 2"
    expert.follow("go to desk 1")
    assert expert.label(outcome("You arrive at desk 1. On the desk 1, you see a book 2.",
                                [*go, "take book 2 from desk 1"])) == "take book 2 from desk 1"
    expert.follow("go to drawer 1")  # it walked away from the book: the search goes on from drawer 1
    assert expert.label(outcome("You arrive at drawer 1. The drawer 1 is closed.",
                                [*go, "open drawer 1"])) == "open drawer 1"
    assert expert.notes is not None and expert.notes.visited == {"bed 1", "desk 1", "drawer 1"}


def test_relabelling_a_real_game_through_the_env() -> None:
    """A refused detour ("Nothing happens.") changes nothing the expert knows, so after it every
    label is the command the expert played in its own episode of the same game."""
    from envs.demonstrations import relabel_episodes

    env_config = EnvConfig(name="alfworld", template="notebook", answer_format="action", history_length=1,
                           num_workers=1, options={"expert": "explorer", "notes": True})
    spec = make_env_spec(env_config)
    env, expert = spec.make(), spec.expert(LOOK_GAME)
    step, own = env.reset(LOOK_GAME), []
    while not step.done:
        own.append(expert.act(step))
        step = env.step(own[-1])
    env.close()
    (demo,) = relabel_episodes(spec, env_config, [(LOOK_GAME, ["go to nowhere", *own])])
    assert demo.relabelled and demo.won and len(demo.steps) == len(own) + 1
    assert [s.action for s in demo.steps] == ["go to nowhere", *own]  # what was played
    assert [s.label for s in demo.steps] == [own[0], *own]  # what the expert says there
    assert demo.steps[1].observation.startswith("Nothing happens.")
    assert all(s.imitate for s in demo.steps)  # every label is admissible where it was given


def test_explorer_refuses_other_task_types() -> None:
    with pytest.raises(ValueError, match="pick_and_place_simple, look_at_obj_in_light.*handcoded"):
        ExplorerExpert("pick_two_obj_and_place-Pillow-None-Sofa-219/trial_T2")


def test_explorer_wins_a_real_game_from_the_notes() -> None:
    spec = make_env_spec(EnvConfig(name="alfworld", template="compact", answer_format="action", history_length=0,
                                   options={"expert": "explorer", "notes": True}))
    env, expert = spec.make(), spec.expert(LOOK_GAME)
    step = env.reset(LOOK_GAME)
    goal = step.info["task"]
    assert goal == "examine the alarmclock with the desklamp."  # the notes are not in the goal
    assert step.observation.splitlines()[-1].startswith("[Notes] You are at: the start. Needed here: nothing.")
    marked = []
    actions = []
    while not step.done and len(actions) < 40:
        actions.append(expert.act(step))
        step = env.step(actions[-1])
        assert step.observation.splitlines()[-1].startswith("[Notes] You are at: ")
        marked += [w for w in ("Needed here: alarmclock", "Needed here: desklamp") if w in step.observation]
    env.close()
    assert step.won and actions[-1] == "use desklamp 1"
    assert not any(a == "look" for a in actions)  # never stuck
    assert list(dict.fromkeys(marked)) == ["Needed here: alarmclock", "Needed here: desklamp"]  # the object, then the lamp
    prompt = spec.render_prompt(PromptContext(task=goal, step=3,
                                              observation=step.observation, history=[], answer_format="action"))
    assert prompt.startswith("Your task is to: examine the alarmclock with the desklamp.\nObservation: ")
    assert prompt.endswith("Present your action for the current step within <action> </action> tags.")


def test_notebook_template_shows_the_goal_last_action_and_notes_line() -> None:
    spec = make_env_spec(EnvConfig(name="alfworld", template="notebook", answer_format="action"))
    observation = "You arrive at desk 1. On the desk 1, you see a book 2.\n" + (
        "[Notes] You are at: desk 1. Needed here: book 2. You hold: nothing. Not visited: shelf 1.")
    prompt = spec.render_prompt(PromptContext(task="put some book on shelf.", step=4, observation=observation,
                                              history=[("...", "go to desk 1")], answer_format="action"))
    assert prompt == ("Your task is to: put some book on shelf.\nYour last actions: go to desk 1\n"
                      "[Notes] You are at: desk 1. Needed here: book 2. You hold: nothing. Not visited: shelf 1.\n"
                      "Present your action for the current step within <action> </action> tags.")
    with pytest.raises(ValueError, match="'notebook' shows the notebook line: set the env option notes: true"):
        spec.render_prompt(PromptContext(task="t", step=0, observation="You arrive at desk 1.", history=[]))
