"""What ``relaxspec train-drafter`` can set, and what its train state records.

:class:`DrafterTrainConfig` is one validated config whose defaults are LANTERN's recipe (AdamW lr
1e-4, betas (0.9, 0.95), no weight decay, ~20 epochs; loss = SmoothL1 on features + 0.1 x
cross-entropy to the target's distribution; EAGLE's uniform feature noise U(-0.1, 0.1)), every
field overridable from the command line (REFERENCE §1.6; arXiv 2401.15077). The constants say
what a run's train state records (its version, the fields a resume may change) and the names of
the files it writes beside it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from relaxspec.models.weights import PRECISIONS
from relaxspec.pipelines.families import known_inputs, opening_inputs
from relaxspec.sampling import SamplingConfig
from relaxspec.training import common
from relaxspec.errors import RelaxspecError
from relaxspec.inputs import check_threads
from relaxspec.pipelines.open import folder_pipeline_class

#: The format of ``train_state.pt`` (checked when it is read back).
STATE_VERSION = 1
#: A train state saved before training starts (while the self-samples are drawn): the config only.
PREPARING = "preparing"
#: A run's self-samples, saved batch by batch (sampling them is the slow part).
SELF_SAMPLES = "self_samples.npz"
#: Fields a resumed run may change: how long it runs, where, and how chatty it is. Everything
#: else is the recipe and must stay what it was, or the continuation would not be exact.
#: A family's opening inputs of the path kind (``inputs``: its weights' files among them) are where
#: files are: they may change too (see :func:`check_resume`).
RUN_FIELDS = ("out", "epochs", "steps", "device", "threads", "bf16", "progress", "checkpoint_interval",
              "eval_interval", "eval_sequences", "model_path", "prompts_file", "patience", "export", "eval_depths")
#: Fields added after the first train states were written, and what a state without them did.
ADDED_FIELDS = {"law_loss": "ce", "distill_weight": 1.0, "train_depths": 1, "fused": False, "fused_layers": None,
                "depth_decay": 1.0, "through_depths": False}
#: The most draft depths one training step unrolls (``train_depths``, ``eval_depths``): each keeps a
#: batch of features for the backward pass, so memory grows with it; draft chains a step verifies
#: are rarely deeper than ten, and ``--train-depths 100000`` only ran out of memory.
MAX_UNROLLED_DEPTHS = 64
LAW_LOSSES = ("ce", "kl", "tv", "kl+tv")
#: Where a run keeps the weights of its best evaluation (``out/best``).
BEST = common.BEST


@dataclass
class DrafterTrainConfig(common.RecipeConfig):
    """Everything ``relaxspec train-drafter`` can set. Defaults: LANTERN's recipe (REFERENCE §1.6)."""

    what = "drafter training"

    out: str = "out/drafter"
    # the target: a model folder of any family (Janus, Emu3, a LlamaGen folder, ...) and/or what its family
    # opens it with (relaxspec.pipelines.families): input name -> value, e.g. a LlamaGen checkpoint's files
    # and a t2i one's Flan-T5 folder, {"tokenizer_path": DIR} for Lumina-mGPT
    model_path: str | None = None
    inputs: dict = field(default_factory=dict)
    prompts_file: str | None = None  # the self-samples' prompts, one per line (a target that takes prompts)
    prompts_sha256: str | None = None  # set from prompts_file's prompts, so a resume cannot swap them
    image_size: int | None = None
    precision: str = "fp32"  # the target's weights; the drafter trains in fp32
    # data: token files, the target's own samples, and/or an image folder through a VQ model
    data: list[str] = field(default_factory=list)
    label: int | None = None  # class of sources that carry no labels
    self_samples: int = 0
    classes: list[int] | None = None  # classes of the self-samples (default: uniform over all)
    # The self-samples' sampling. `relaxspec train-drafter --model-path` fills in the folder's own
    # defaults (as generate does) for those not given; from Python, set them yourself.
    cfg_scale: float = 4.0
    temperature: float = 1.0
    top_k: int = 0
    top_p: float | None = None  # None = 1.0 (off)
    images: str | None = None  # encoded with the target's image tokenizer (its family's input, e.g. a VQ file)
    val_fraction: float = 0.02  # held out to measure draft accuracy
    # drafter
    n_layer: int = 1
    init_from: str | None = None  # start from this drafter's weights (or grow one with fewer blocks: grow_drafter)
    # EAGLE-3's fused features (relaxspec.drafting.eagle): the drafter reads the streams entering these target
    # layers (fused_layers; default EAGLE-3's 2, L // 2, L - 3) instead of the final state; no feature loss
    fused: bool = False
    fused_layers: list[int] | None = None
    # optimisation
    epochs: float = 20.0
    steps: int | None = None  # overrides epochs
    batch_size: int = 16  # sequences per step (each gives up to two rows: cond and null stream)
    lr: float = 1e-4
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.0
    warmup_steps: int = 100  # linear warm-up, then constant (so a run can be extended exactly)
    grad_clip: float = 0.5  # EAGLE's; 0 = off
    noise: float = 0.1  # input features get U(-noise, noise) (EAGLE)
    feature_weight: float = 1.0
    ce_weight: float = 0.1  # weight of the cross-entropy term (law_loss "ce")
    law_loss: str = "ce"  # "ce" (EAGLE's), or distil the decoding law: "kl", "tv", "kl+tv"
    distill_weight: float = 1.0  # weight of the distillation term (law_loss "kl" / "tv" / "kl+tv")
    train_depths: int = 1  # draft depths trained (unrolled on the drafter's own features)
    depth_decay: float = 1.0  # depth d weighs depth_decay ** (d - 1) in the loss (normalised; EAGLE-3: 0.8)
    through_depths: bool = False  # the gradient also flows through the guesses a depth reads (EAGLE-3's)
    eval_depths: int = 4  # draft depths measured (1 - TV per depth)
    patience: int = 0  # evaluations without a better chain_mal before stopping; 0 = never stop early
    export: str | None = None  # also write the best weights here in fp16 (the shipped format)
    null_fraction: float = 1.0  # share of each batch also trained under the null condition
    seed: int = 0
    bf16: bool = False  # bf16 autocast (CPU or CUDA)
    device: str = "auto"
    threads: int | None = None  # torch CPU threads (default: relaxspec.threads.default_threads)
    # A Ctrl-C loses the steps since the last checkpoint (the loop saves nothing on an interrupt: it may
    # land inside an optimizer step). A checkpoint writes only the drafter and its AdamW moments: cheap
    # next to 100 steps, each a forward pass of the whole target.
    checkpoint_interval: int = 100
    eval_interval: int = 500
    eval_sequences: int = 256
    progress: bool = True

    @classmethod
    def from_dict(cls, data: dict) -> "DrafterTrainConfig":
        """A config from its dict, also one an older run saved (:func:`upgrade`)."""
        return super().from_dict(upgrade(data))

    def __post_init__(self) -> None:
        common.need(isinstance(self.inputs, dict),
                    f"inputs must map family input names to values, got {type(self.inputs).__name__}")
        self.inputs = known_inputs(self.inputs)
        self.data = [str(p) for p in (self.data or [])]
        self.betas = tuple(float(b) for b in self.betas)
        if self.classes is not None:
            self.classes = [int(c) for c in self.classes]
        if self.fused_layers is not None:
            self.fused_layers = [int(i) for i in self.fused_layers]
        self.validate()

    def validate(self) -> None:
        need = common.need
        common.need_finite(self)  # inf / nan mean nothing here (inf epochs: an endless run)
        need(bool(self.out), "out must name a folder")
        need(self.precision in PRECISIONS, f"precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        need(self.self_samples >= 0, f"self_samples must be >= 0, got {self.self_samples}")
        need(self.label is None or self.label >= 0, f"label must be a class id >= 0, got {self.label}")
        need(self.classes is None or (len(self.classes) > 0 and min(self.classes) >= 0),
             f"classes must be a non-empty list of class ids >= 0, got {self.classes}")
        need(0 <= self.val_fraction < 1, f"val_fraction must lie in [0, 1), got {self.val_fraction}")
        need(self.n_layer >= 1, f"n_layer must be >= 1, got {self.n_layer}")
        if self.threads is not None:
            check_threads(self.threads, "threads")
        need(self.epochs > 0, f"epochs must be > 0, got {self.epochs}")
        need(self.steps is None or 0 <= self.steps <= common.MAX_STEPS,
             f"steps must lie in [0, {common.MAX_STEPS:,}], got {self.steps}")
        need(self.batch_size >= 1, f"batch_size must be >= 1, got {self.batch_size}")
        need(self.lr > 0, f"lr must be > 0, got {self.lr}")
        need(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), f"betas must be two numbers in [0, 1), got {self.betas}")
        need(self.weight_decay >= 0, f"weight_decay must be >= 0, got {self.weight_decay}")
        need(self.warmup_steps >= 0, f"warmup_steps must be >= 0, got {self.warmup_steps}")
        need(self.grad_clip >= 0, f"grad_clip must be >= 0 (0 = off), got {self.grad_clip}")
        need(self.noise >= 0, f"noise must be >= 0, got {self.noise}")
        law_weight = self.ce_weight if self.law_loss == "ce" else self.distill_weight
        need(self.feature_weight >= 0 and self.ce_weight >= 0 and self.feature_weight + law_weight > 0,
             f"loss weights must be >= 0 and not both 0, got feature {self.feature_weight} and "
             f"{'ce' if self.law_loss == 'ce' else 'distill'} {law_weight}")
        need(0 <= self.null_fraction <= 1, f"null_fraction must lie in [0, 1], got {self.null_fraction}")
        need(0 < self.depth_decay <= 1, f"depth_decay must lie in (0, 1], got {self.depth_decay}")
        need(self.fused or self.fused_layers is None, "fused_layers are a fused drafter's: give fused too (--fused)")
        need(self.fused_layers is None or (len(self.fused_layers) >= 2 and min(self.fused_layers) >= 0),
             f"fused_layers must name at least two target layers (indices >= 0), got {self.fused_layers}")
        need(not self.fused or self.feature_weight == 0,
             "a fused-feature drafter's outputs are not the target's features: it has no feature loss "
             "(feature_weight 0; --fused sets it)")
        need(self.law_loss in LAW_LOSSES, f"law_loss must be one of {', '.join(LAW_LOSSES)}, got {self.law_loss!r}")
        need(self.distill_weight >= 0, f"distill_weight must be >= 0, got {self.distill_weight}")
        need(1 <= self.train_depths <= MAX_UNROLLED_DEPTHS,
             f"train_depths must lie in [1, {MAX_UNROLLED_DEPTHS}], got {self.train_depths:,}")
        need(1 <= self.eval_depths <= MAX_UNROLLED_DEPTHS,
             f"eval_depths must lie in [1, {MAX_UNROLLED_DEPTHS}], got {self.eval_depths:,}")
        need(self.patience >= 0, f"patience must be >= 0 (0 = never stop early), got {self.patience}")
        if self.law_loss != "ce":
            need(self.temperature > 0, "distilling the decoding law needs temperature > 0 (greedy decoding "
                                       "accepts by argmax, not by the law)")
            need(self.null_fraction == 1 or self.cfg_scale == 1.0,
                 "distilling the guided law needs both CFG streams of every sequence: null_fraction 1")
        need(self.null_fraction > 0 or self.cfg_scale == 1.0,
             "with CFG the drafter runs on both streams while decoding: null_fraction must be > 0")
        need(self.checkpoint_interval >= 1, f"checkpoint_interval must be >= 1, got {self.checkpoint_interval}")
        need(self.eval_interval >= 1, f"eval_interval must be >= 1, got {self.eval_interval}")
        need(self.eval_sequences >= 1, f"eval_sequences must be >= 1, got {self.eval_sequences}")
        need(self.images is None or self.model_path is not None or bool(self.inputs),
             "--images are encoded by the target's image tokenizer: name the target (--model-path DIR, or its "
             "family's files, e.g. LlamaGen's --gpt-ckpt with --vq-ckpt)")
        folder = self.model_path is not None and _prompted_folder(self.model_path)
        need(not folder or (not self.data and self.images is None and self.classes is None),
             "a --model-path target trains on its own samples of prompts: give --self-samples COUNT and "
             "--prompts-file FILE (not --data / --images / --classes)")
        need(not folder or self.prompts_file is not None,
             "--model-path needs --prompts-file FILE (the prompts of its self-samples)")
        need(not folder or self.self_samples >= 1,
             "--model-path trains on the model's own samples: give --self-samples COUNT")
        need(self.prompts_file is None or (self.self_samples >= 1 and not self.data and self.images is None
                                           and self.classes is None),
             "--prompts-file trains a target on its own samples of prompts: give --self-samples COUNT (not --data / "
             "--images / --classes)")
        self.sampling  # validates

    @property
    def sampling(self) -> SamplingConfig:
        """How self-samples are drawn."""
        return SamplingConfig(cfg_scale=self.cfg_scale, temperature=self.temperature, top_k=self.top_k,
                              top_p=1.0 if self.top_p is None else self.top_p)


def _prompted_folder(path) -> bool:
    """Whether the model folder ``path`` is of a family that draws prompts (a transformers
    folder: it trains on its own samples of prompts); a folder that cannot be read counts as one
    (opening it says why)."""
    try:
        return folder_pipeline_class(path).takes == "prompts"
    except RelaxspecError:
        return True


def upgrade(data: dict) -> dict:
    """A saved config dict as today's fields: an older run's fields named as a family's opening
    inputs (a LlamaGen target's files and sizes, ``t5_path``, ``tokenizer_path``,
    ``negative_prompt``) are its ``inputs`` now, those it saved at their default left out (a run
    that never named a tokenizer saved upstream's), so ``--resume`` continues it."""
    data = dict(data)
    known = opening_inputs()
    defaults = {name: declared.default for name, (declared, _) in known.items()}
    old = {name: data.pop(name) for name in known if name in data}
    inputs = {name: value for name, value in old.items() if value is not None and value != defaults.get(name)}
    if inputs or "inputs" in data:
        data["inputs"] = {**inputs, **(data.get("inputs") or {})}
    return data


def check_resume(saved: dict, config: DrafterTrainConfig) -> None:
    """Raise unless ``config`` continues the run whose saved config is ``saved`` (an older run's
    too: :data:`ADDED_FIELDS`, :func:`upgrade`): every field but :data:`RUN_FIELDS` and the family
    inputs that are paths must be what it was. The inputs are compared one by one."""
    saved = upgrade({**ADDED_FIELDS, **saved})
    current = config.to_dict()
    names = sorted(set(saved.get("inputs") or {}) | set(current["inputs"]))
    known = opening_inputs() if names else {}
    # each input a field of its own, by its name (as older runs saved t5_path), unless a field has it
    keys = {name: f"inputs.{name}" if name in current else name for name in names}
    paths = tuple(keys[name] for name in names if name in known and known[name][0].kind == "path")

    def flat(fields: dict) -> dict:
        inputs = fields.get("inputs") or {}
        return {**{k: v for k, v in fields.items() if k != "inputs"},
                **{keys[name]: inputs.get(name) for name in names}}

    common.check_resumable(flat(saved), flat(current), RUN_FIELDS + paths)
