"""The trainers of the train step, by `train.trainer`: Pai-Megatron-Patch (`pai`), ms-swift (`swift`) and
a4ray's built-in trainer (`torch`). The pipeline asks `trainer_for(spec)` what it needs (`interface.Trainer`)."""

from a4ray.spec.recipes import RecipeJob
from a4ray.trainers.builtin import TorchTrain
from a4ray.trainers.interface import Trainer
from a4ray.trainers.pai import PaiTrain
from a4ray.trainers.swift import SwiftTrain

TRAINERS: dict[str, type[Trainer]] = {cls.name: cls for cls in (PaiTrain, SwiftTrain, TorchTrain)}


def trainer_for(spec: RecipeJob, workspace: str, checkpoint: str = "") -> Trainer:
    """The trainer `spec.train.trainer` names, for a workspace root as the nodes see it."""
    return TRAINERS[spec.train.trainer](spec, workspace=workspace, checkpoint=checkpoint)
