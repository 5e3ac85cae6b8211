"""Trajectories to sequences and to the flat token batch."""

import pytest
import torch

from turnopd.core.types import (
    EpisodeSummary,
    Trajectory,
    Turn,
    build_token_batch,
    describe_env_errors,
    env_errors,
    trajectory_sequences,
)


def turn(index, prompt, action, teacher=None):
    return Turn(index, f"obs{index}", prompt, action, [-0.1 * (j + 1) for j in range(len(action))],
                teacher_logprobs=teacher)


def test_append_only_chat_is_one_sequence():
    # turn 1's prompt = turn 0's prompt + action + new observation tokens
    t0 = turn(0, [1, 2], [3, 4])
    t1 = turn(1, [1, 2, 3, 4, 5], [6])
    seqs = trajectory_sequences(Trajectory("a", "env", [t0, t1]))
    assert len(seqs) == 1
    assert seqs[0].ids == [1, 2, 3, 4, 5, 6]
    assert seqs[0].spans == [(2, 4, 0), (5, 6, 1)]


def test_history_window_prompts_are_one_sequence_per_turn():
    t0 = turn(0, [1, 2], [3])
    t1 = turn(1, [1, 9, 3], [4])  # re-rendered window: not an extension of [1, 2, 3]
    seqs = trajectory_sequences(Trajectory("a", "env", [t0, t1]))
    assert [s.ids for s in seqs] == [[1, 2, 3], [1, 9, 3, 4]]
    assert [s.spans for s in seqs] == [[(2, 3, 0)], [(3, 4, 1)]]


def test_build_token_batch_fields():
    a = Trajectory("a", "env", [turn(0, [1, 2], [3, 4], teacher=[-0.5, -0.6]),
                                turn(1, [1, 2, 3, 4, 5], [6], teacher=[-0.7])])
    b = Trajectory("b", "env", [turn(0, [7], [8], teacher=[-0.9])])
    batch = build_token_batch([a, b])
    assert batch.input_ids.tolist() == [1, 2, 3, 4, 5, 6, 7, 8]
    assert batch.seq_lens.tolist() == [6, 2]
    assert batch.loss_mask.tolist() == [False, False, True, True, False, True, False, True]
    assert batch.traj_ids.tolist() == [0, 0, 0, 0, 0, 0, 1, 1]
    assert batch.turn_ids.tolist() == [-1, -1, 0, 0, -1, 1, -1, 0]
    assert torch.allclose(batch.old_logprobs[batch.loss_mask], torch.tensor([-0.1, -0.2, -0.1, -0.1]))
    assert torch.allclose(batch.teacher_logprobs[batch.loss_mask], torch.tensor([-0.5, -0.6, -0.7, -0.9]))
    assert batch.num_trajectories == 2 and batch.num_action_tokens == 4
    assert [batch.input_ids[s].tolist() for s in batch.sequences()] == [[1, 2, 3, 4, 5, 6], [7, 8]]
    assert batch.teacher_topk_ids is None


def test_top_k_rows_land_on_their_tokens():
    t = Turn(0, "o", [1], [2, 3], [-0.1, -0.2], teacher_logprobs=[-0.3, -0.4],
             teacher_topk_ids=[[2, 5], [3, 5]], teacher_topk_logprobs=[[-0.3, -2.0], [-0.4, -1.5]])
    batch = build_token_batch([Trajectory("a", "env", [t])])
    assert batch.teacher_topk_ids.tolist() == [[0, 0], [2, 5], [3, 5]]
    assert batch.teacher_topk_logprobs[0].tolist() == [float("-inf")] * 2
    assert batch.teacher_topk_logprobs[2].tolist() == pytest.approx([-0.4, -1.5])


def test_a_batch_of_no_trajectories_has_no_sequences():
    batch = build_token_batch([])
    assert (batch.num_tokens, batch.num_action_tokens, batch.sequences()) == (0, 0, [])


def test_env_errors_are_counted_by_message_most_frequent_first():
    trajs = [Trajectory("a", "e", env_error="disk full"), Trajectory("b", "e"),
             Trajectory("c", "e", env_error="worker 1 died"), Trajectory("d", "e", env_error="worker 1 died")]
    summaries = [EpisodeSummary.of(t) for t in trajs]
    assert [s.failed_by_env for s in summaries] == [True, False, True, True]
    assert env_errors(trajs) == env_errors(summaries) == {"worker 1 died": 2, "disk full": 1}
    assert list(env_errors(trajs)) == ["worker 1 died", "disk full"]
    assert env_errors(trajs[1:2]) == {}
    assert describe_env_errors({"worker 1 died": 2, "disk full": 1}, 4) == (
        "3 of 4 episodes were ended by the env, not the agent: worker 1 died (x2); disk full (x1)")
    # one cause can read as many messages (each names its game): two are shown, the rest counted
    assert describe_env_errors({"g1": 1, "g2": 1, "g3": 1, "g4": 1}, 8) == (
        "4 of 8 episodes were ended by the env, not the agent: g1 (x1); g2 (x1); and 2 other errors")


def test_screenshot_turns_read_by_the_student_and_by_a_text_teacher():
    """A student that saw images (7 = the image token, each image 2 positions here) and a teacher that
    reads the pages' text instead: the same action tokens, each reader's own prompt."""
    t0 = Turn(0, "page 0", [1, 7, 7, 2], [3, 4], [-0.1, -0.2], image_keys=["k0"], teacher_prompt_ids=[1, 50, 51, 2])
    t1 = Turn(1, "page 1", [1, 7, 7, 2, 3, 4, 7, 7], [5], [-0.3], image_keys=["k0", "k1"],
              teacher_prompt_ids=[1, 52, 2])  # the student's chat appends, the teacher's window does not
    traj = Trajectory("a", "env", [t0, t1])
    student = trajectory_sequences(traj)
    assert [(s.ids, s.spans, s.image_keys) for s in student] == [
        ([1, 7, 7, 2, 3, 4, 7, 7, 5], [(4, 6, 0), (8, 9, 1)], ["k0", "k1"])]
    teacher = trajectory_sequences(traj, "teacher")
    assert [(s.ids, s.spans, s.image_keys) for s in teacher] == [
        ([1, 50, 51, 2, 3, 4], [(4, 6, 0)], []), ([1, 52, 2, 5], [(3, 4, 1)], [])]
    batch = build_token_batch([traj])
    assert batch.image_keys == [["k0", "k1"]] and batch.input_ids.tolist() == student[0].ids
    assert build_token_batch([Trajectory("b", "env", [turn(0, [1, 2], [3])])]).image_keys == []
    # the teacher's scored tokens: its own prompts (6 + 4), not the student's 9
    assert EpisodeSummary.of(traj).scored_tokens == 10
    with pytest.raises(ValueError, match="reader"):
        trajectory_sequences(traj, "judge")
