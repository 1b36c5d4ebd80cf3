"""The trainers of the train step, by `train.trainer`: Pai-Megatron-Patch (`pai`), ms-swift (`swift`), a4ray's
Megatron-core trainer (`megatron`) and its built-in Hugging Face/DDP trainer (`torch`). The pipeline asks
`trainer_for(spec)` what it needs (`interface.Trainer`)."""

from a4ray.spec.recipes import RecipeJob
from a4ray.trainers.builtin import TorchTrain
from a4ray.trainers.interface import Trainer
from a4ray.trainers.megatron import MegatronTrain
from a4ray.trainers.pai import PaiTrain
from a4ray.trainers.swift import SwiftTrain

TRAINERS: dict[str, type[Trainer]] = {cls.name: cls for cls in (PaiTrain, SwiftTrain, MegatronTrain, TorchTrain)}


def trainer_for(spec: RecipeJob, workspace: str, checkpoint: str = "", *, simulated: bool = False) -> Trainer:
    """The trainer `spec.train.trainer` names, for a workspace root as the nodes see it."""
    return TRAINERS[spec.train.trainer](spec, workspace=workspace, checkpoint=checkpoint, simulated=simulated)
