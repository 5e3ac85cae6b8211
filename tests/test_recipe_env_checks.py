"""The env's own checks run with the recipe (`turnopd show`, `--dry-run`): a bad env setting or data
folder is one line naming the key, exit 2, before any heavy work."""

from pathlib import Path

import pytest

from turnopd.cli import main

QUICKSTART = Path(__file__).resolve().parents[1] / "recipes" / "quickstart.yaml"
ALFWORLD_TASK_TYPES = ("pick_and_place_simple, look_at_obj_in_light, pick_clean_then_place_in_recep, "
                       "pick_heat_then_place_in_recep, pick_cool_then_place_in_recep, pick_two_obj_and_place")


@pytest.mark.parametrize(
    "override, message",
    [
        ("env.task_types=[look_at_lamp]", "recipe key 'env.task_types': unknown ALFWorld task types "
                                          f"['look_at_lamp']; allowed: {ALFWORLD_TASK_TYPES}"),
        ("env.options.colour=red", "recipe key 'env.options': unknown alfworld options ['colour']; "
                                   "allowed: expert, expert_seed, expert_noise, notes"),
        ("env.options.expert=oracle", "recipe key 'env' (env alfworld): unknown alfworld expert 'oracle'; "
                                      "allowed: walkthrough, handcoded, explorer"),
        ("data_dir=/nonexistent", "recipe key 'data_dir': the recipe's data_dir is '/nonexistent', which is not a folder"),
    ],
)
def test_env_settings_are_checked_with_the_recipe(override, message, capsys):
    """`turnopd show` runs the env's own checks: one line naming the key, exit 2, no traceback."""
    assert main(["show", str(QUICKSTART), override]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {message}") and err.count("\n") == 1, err


def test_a_data_dir_without_the_envs_data_is_refused(tmp_path, capsys):
    assert main(["show", str(QUICKSTART), f"data_dir={tmp_path}"]) == 2
    assert capsys.readouterr().err == (f"error: recipe key 'data_dir': {tmp_path}/alfworld/json_2.1.1 not found: the "
                                       f"recipe's data_dir '{tmp_path}' lacks 'alfworld/json_2.1.1'; point it at the "
                                       "folder holding 'alfworld/json_2.1.1' (or leave data_dir unset)\n")
