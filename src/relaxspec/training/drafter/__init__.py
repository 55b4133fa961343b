"""Train the EAGLE drafter on a frozen target's features (REFERENCE §1.6; arXiv 2401.15077).

What lives where (each module imports only those above it):

* ``config``      :class:`DrafterTrainConfig` (LANTERN's recipe as defaults) and what a train state records;
* ``data``        the training sequences: token files, the target's own samples, encoded images;
* ``maths``       the pure distillation maths: the pairing, the depth mask, the decoding law, the loss;
* ``passes``      the forward passes: the target's teacher-forced features, the drafter unrolled
  over draft depths, one batch's loss;
* ``checkpoints`` what a run writes in its folder and reads back (train state, fp16 export, plot);
* ``recipe``      :func:`train_drafter`, the loop, and its evaluation.
"""

from relaxspec.runs.folder import TRAIN_STATE
from relaxspec.training.drafter.checkpoints import export_drafter, plot_acceptance, read_train_state
from relaxspec.training.drafter.config import BEST, SELF_SAMPLES, DrafterTrainConfig
from relaxspec.training.drafter.data import (
    DrafterDataset,
    build_dataset,
    encode_images,
    load_token_file,
    sample_from_target,
    sample_prompts,
)
from relaxspec.training.drafter.maths import (
    chain_mal,
    drafter_inputs,
    drafter_loss,
    drafter_targets,
    guided_log_law,
    unrolled_mask,
)
from relaxspec.training.drafter.passes import batch_loss, target_features, teacher_forced, unrolled
from relaxspec.training.drafter.recipe import (
    DrafterTrainResult,
    evaluate_drafter,
    grow_drafter,
    open_target,
    train_drafter,
)

__all__ = [
    "BEST", "SELF_SAMPLES", "TRAIN_STATE", "DrafterDataset", "DrafterTrainConfig", "DrafterTrainResult",
    "batch_loss", "build_dataset", "chain_mal", "drafter_inputs", "drafter_loss", "drafter_targets",
    "encode_images", "evaluate_drafter", "export_drafter", "grow_drafter", "guided_log_law", "load_token_file",
    "open_target", "plot_acceptance", "read_train_state", "sample_from_target", "sample_prompts",
    "target_features", "teacher_forced", "train_drafter", "unrolled", "unrolled_mask",
]
