"""A step's outcome rewards, from its episodes on every rank: WMRL's corrections of the world model's
scores (world_model.debias isotonic, world_model.denoise anchor_weight) and the reward term's
advantages (objective.reward_weight > 0), in WMRL's order (xiyuanyang45/WMRL, wmrl/loop.py):

1. the (verdict, real outcome) pairs of the real episodes the model judged go into the isotonic map
   (before anything is measured with it, so the disagreement below is the calibrated one);
2. each anchor group (a group of one task whose episodes all played the real env) folds its
   calibrated verdicts against its real outcomes into the anchor weight;
3. every model episode's score (1 won, 0 not) goes through the map;
4. the anchor weight goes to the anchor groups' trajectories (Trajectory.loss_weight; the
   trainer keeps the step's total weight), the group-normalised advantage of the scores to every
   trajectory (Trajectory.advantage).

Every rank runs it on the same gathered episodes, so the state (the map's pairs, the running
disagreement) is the same on each; it is saved in the run's checkpoints.
"""

from __future__ import annotations

from typing import Any

import torch

from turnopd.algorithm.objective import ADVANTAGES
from turnopd.algorithm.world_model_corrections import InverseVarianceWeighter, OnlineDebiaser
from turnopd.config import RunConfig
from turnopd.core.distributed import gather_objects, rank_and_world
from turnopd.core.types import EpisodeSummary, Trajectory
from turnopd.rollout.world_model_pool import trace_of


class Outcomes:
    """One per run: what the step's outcome rewards carry from step to step."""

    def __init__(self, cfg: RunConfig):
        wm = cfg.world_model
        def given(**kwargs: Any) -> dict[str, Any]:  # the recipe's schedule keys; null: WMRL's constant
            return {key: value for key, value in kwargs.items() if value is not None}

        self.debiaser = OnlineDebiaser(**given(min_pairs=wm.calibration_min_pairs, refit_every=wm.calibration_refit_every)
                                       ) if wm.path is not None and wm.debias == "isotonic" else None
        self.weighter = InverseVarianceWeighter(**given(warmup=wm.anchor_warmup_groups, half_life=wm.anchor_half_life)
                                                ) if wm.path is not None and wm.denoise == "anchor_weight" else None
        self.reward_weight = cfg.objective.reward_weight
        self.advantage = ADVANTAGES.get(cfg.objective.advantage)

    def apply(self, trajectories: list[Trajectory], episodes: list[EpisodeSummary]) -> dict[str, Any]:
        """Set this rank's trajectories' anchor weights and advantages from the step's `episodes` (every
        rank's, in rank order, this rank's `trajectories` among them); the step record's fields."""
        if self.debiaser is None and self.weighter is None and self.reward_weight == 0:
            return {}
        scores = [float(e.success) for e in episodes]
        graded = [not e.env_error for e in episodes]
        traces = [trace_of(e) for e in episodes]
        judged = [i for i, t in enumerate(traces) if graded[i] and not t.played and t.predicted_success is not None]
        calibrate = self.debiaser.apply if self.debiaser is not None else lambda xs: [float(x) for x in xs]
        if self.debiaser is not None:
            for i in judged:
                self.debiaser.push(traces[i].predicted_success, scores[i])
        groups: dict[str, list[int]] = {}
        for i, e in enumerate(episodes):
            groups.setdefault(e.task_id, []).append(i)
        anchors = [members for members in groups.values() if not any(traces[i].played for i in members)]
        if self.weighter is not None:
            judged_set = set(judged)
            for members in anchors:
                pairs = [i for i in members if i in judged_set]
                if pairs:
                    self.weighter.observe_group(calibrate([traces[i].predicted_success for i in pairs]),
                                                [scores[i] for i in pairs])
        model = [i for i, t in enumerate(traces) if t.played and graded[i]]
        for i, score in zip(model, calibrate([scores[i] for i in model]), strict=True):
            scores[i] = score

        lengths = gather_objects(len(trajectories))
        start = sum(lengths[:rank_and_world()[0]])
        mine = range(start, start + len(trajectories))
        if self.weighter is not None:
            anchored = {i for members in anchors for i in members}
            weight = self.weighter.weight()
            for trajectory, i in zip(trajectories, mine, strict=True):
                trajectory.loss_weight = weight if i in anchored else 1.0
        if self.reward_weight > 0:
            index = {task: g for g, task in enumerate(groups)}
            advantages = self.advantage(torch.tensor(scores, dtype=torch.float64),
                                        torch.tensor([index[e.task_id] for e in episodes]), torch.tensor(graded))
            for trajectory, i in zip(trajectories, mine, strict=True):
                trajectory.advantage = float(advantages[i])
        return self._fields(scores, model, len(anchors))

    def _fields(self, scores: list[float], model: list[int], anchor_groups: int) -> dict[str, Any]:
        """The step record's: with isotonic, the model episodes' mean calibrated score as the debiased
        success rate (no standard error) and the last refit's centred residuals; with anchor_weight the
        weight and the step's anchor groups."""
        fields: dict[str, Any] = {}
        if self.debiaser is not None:
            stats = self.debiaser.stats
            fields.update(world_model_calibrated=self.debiaser.calibration is not None,
                          world_model_bias_before=None if stats is None else stats.before,
                          world_model_bias_after=None if stats is None else stats.after)
            if model:
                fields.update(success_rate_debiased=sum(scores[i] for i in model) / len(model),
                              success_rate_debiased_stderr=None)
        if self.weighter is not None:
            fields.update(world_model_anchor_weight=self.weighter.weight(), world_model_anchor_groups=anchor_groups)
        return fields

    def state_dict(self) -> dict[str, Any]:
        return {"debiaser": None if self.debiaser is None else self.debiaser.state_dict(),
                "weighter": None if self.weighter is None else self.weighter.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.debiaser is not None and state.get("debiaser") is not None:
            self.debiaser.load_state_dict(state["debiaser"])
        if self.weighter is not None and state.get("weighter") is not None:
            self.weighter.load_state_dict(state["weighter"])
