"""What an EAGLE drafter is made of, before any weight: its config (:class:`DrafterConfig`, what
``config.json`` records), a new one's for a target (:func:`drafter_config`) and the check that a
drafter fits a target (:func:`check_target`). The drafter itself is
:class:`relaxspec.drafting.eagle.EagleDrafter`."""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass

from relaxspec.drafting.family import layer_spec
from relaxspec.errors import RelaxspecError
from relaxspec.models import hf
from relaxspec.models.base import CAPTION_ROWS, TargetModel, fused_layers, layer_count
from relaxspec.models.llamagen.gpt import GPTConfig, block_shape


#: The family of drafters built of LlamaGen blocks (and of every drafter file without a family).
LLAMAGEN = "llamagen"


@dataclass
class DrafterConfig:
    """The drafter's own hyper-parameters; width, grid and vocabulary are the target's.

    ``family`` ``"llamagen"``: ``target`` is a LlamaGen ``GPTConfig`` dict (the blocks' shape).
    Any other family (a transformers ``model_type``): ``target`` is the engine's side of the
    target, ``{"dim", "vocab_size", "block_size"}``, and ``layer`` rebuilds the layers:
    ``{"class": decoder layer class, "config": layer config fields}``
    (:func:`relaxspec.drafting.family.layer_spec`).

    Official LANTERN's layout (defaults: relaxspec's own drafters): ``first_attention_norm`` False
    drops layer 0's input norm (LlamaGen blocks only); ``own_embedding`` gives the drafter its own
    (frozen) token table instead of the target's (a transformers family's covers the model's whole
    vocabulary, ``layer["config"]["vocab_size"]``, as the prompt's tokens need); ``condition_pairs``
    ``P > 0`` makes it read the condition's pairs (module docstring): LlamaGen blocks those of a
    ``P + 1``-token condition, a family drafter those of a prompt of at most ``P + 1`` tokens (with
    its own token table); ``caption_rows`` (LlamaGen blocks reading a caption) says how the rows at
    padded caption positions it reads were computed when it was trained, and so how decoding
    computes them for it: ``"upstream"`` (upstream LlamaGen's, relaxspec's own) or ``"lantern"``
    (official LANTERN's converted target's: its released drafters).

    ``fused_layers`` (EAGLE-3; module docstring): the target layers whose entering streams the
    drafter reads, in that order (at least two, each in ``0 .. L`` of an ``L``-layer target);
    ``None``: the target's final state (EAGLE-1/2's, every drafter written before fused ones)."""

    target: dict
    n_layer: int = 1
    family: str = LLAMAGEN
    layer: dict | None = None
    first_attention_norm: bool = True
    own_embedding: bool = False
    condition_pairs: int = 0
    caption_rows: str = "upstream"
    fused_layers: list[int] | None = None

    def __post_init__(self) -> None:
        if self.n_layer < 1:
            raise RelaxspecError(f"drafter n_layer must be >= 1, got {self.n_layer}")
        if not isinstance(self.family, str) or not self.family:
            raise RelaxspecError(f"drafter family must be a name, got {self.family!r}")
        if self.family == LLAMAGEN and self.layer is not None:
            raise RelaxspecError("a llamagen drafter takes its shape from 'target'; it has no 'layer'")
        if not (isinstance(self.first_attention_norm, bool) and isinstance(self.own_embedding, bool)):
            raise RelaxspecError("drafter first_attention_norm and own_embedding must be true or false")
        if not isinstance(self.condition_pairs, int) or isinstance(self.condition_pairs, bool) \
                or self.condition_pairs < 0:
            raise RelaxspecError(f"drafter condition_pairs must be a count >= 0, got {self.condition_pairs!r}")
        if self.caption_rows not in CAPTION_ROWS:
            raise RelaxspecError(f"drafter caption_rows must be one of {', '.join(CAPTION_ROWS)}, "
                                 f"got {self.caption_rows!r}")
        if self.caption_rows != "upstream" and not (self.family == LLAMAGEN and self.condition_pairs):
            raise RelaxspecError("drafter caption_rows is for LlamaGen blocks that read a caption (condition_pairs)")
        if self.family != LLAMAGEN and not self.first_attention_norm:
            raise RelaxspecError(f"a drafter of the {self.family} family has its target's layers, input norm "
                                 "included: first_attention_norm is for LlamaGen blocks")
        if self.family != LLAMAGEN and self.condition_pairs and not self.own_embedding:
            raise RelaxspecError(f"a drafter of the {self.family} family reads the prompt's tokens with its own "
                                 "token table: condition_pairs needs own_embedding")
        if self.fused_layers is not None:
            layers = self.fused_layers
            if not (isinstance(layers, (list, tuple)) and len(layers) >= 2
                    and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in layers)):
                raise RelaxspecError(f"drafter fused_layers must list at least two target layers (indices >= 0), "
                                     f"got {layers!r}")
            self.fused_layers = [int(i) for i in layers]
            if self.lantern_layout:
                raise RelaxspecError("a fused-feature drafter has relaxspec's own layout: fused_layers does not go "
                                     "with official LANTERN's fields (first_attention_norm, own_embedding, "
                                     "condition_pairs)")
        if self.family != LLAMAGEN:
            layer = self.layer
            if not (isinstance(layer, dict) and isinstance(layer.get("class"), str)
                    and isinstance(layer.get("config"), dict)):
                raise RelaxspecError(f"a drafter of the {self.family} family needs 'layer': "
                                     "{'class': ..., 'config': {...}}")
            if not all(isinstance(self.target.get(key), int) for key in ("dim", "vocab_size", "block_size")):
                raise RelaxspecError(f"a drafter of the {self.family} family needs 'target' with dim, vocab_size "
                                     "and block_size")
            if layer["config"].get("hidden_size") != self.target["dim"]:
                raise RelaxspecError(f"the drafter's layers are {layer['config'].get('hidden_size')} wide, "
                                     f"its target {self.target['dim']}")
            vocabulary = layer["config"].get("vocab_size")
            if self.own_embedding and not (isinstance(vocabulary, int) and vocabulary >= 1):
                raise RelaxspecError(f"a drafter of the {self.family} family with its own token table needs "
                                     "layer.config.vocab_size (the model's vocabulary)")

    @property
    def target_config(self) -> GPTConfig:
        """A llamagen drafter's block shape."""
        if self.family != LLAMAGEN:
            raise RelaxspecError(f"a drafter of the {self.family} family has no LlamaGen block config")
        return GPTConfig.from_dict(self.target)

    @property
    def dim(self) -> int:
        return int(self.target["dim"])

    @property
    def lantern_layout(self) -> bool:
        """Whether any of official LANTERN's departures from relaxspec's own drafter is set."""
        return not self.first_attention_norm or self.own_embedding or self.condition_pairs > 0

    @property
    def fused(self) -> bool:
        """Whether it reads fused target features (EAGLE-3)."""
        return self.fused_layers is not None

    def to_dict(self) -> dict:
        """As ``config.json`` records it; a llamagen drafter's as it always was (no family), and
        LANTERN's fields and ``fused_layers`` only when set."""
        optional = {name: getattr(self, name) for name in OPTIONAL_FIELDS if getattr(self, name) != DEFAULTS[name]}
        if self.family == LLAMAGEN:
            return {"target": self.target, "n_layer": self.n_layer, **optional}
        return {**{key: value for key, value in asdict(self).items() if key not in OPTIONAL_FIELDS}, **optional}

    def with_layers(self, n_layer: int) -> "DrafterConfig":
        """The same drafter with ``n_layer`` layers (a warm start that grows it)."""
        layer = self.layer
        if layer is not None:
            layer = {**layer, "config": {**layer["config"], "num_hidden_layers": int(n_layer)}}
        return dataclasses.replace(self, n_layer=n_layer, layer=layer)


#: Official LANTERN's layout of LlamaGen blocks (:class:`DrafterConfig`) and their defaults.
LANTERN_FIELDS = ("first_attention_norm", "own_embedding", "condition_pairs", "caption_rows")
#: Fields a config.json has only when they are not at their defaults (so older files stay as written).
OPTIONAL_FIELDS = (*LANTERN_FIELDS, "fused_layers")
DEFAULTS = {f.name: f.default for f in dataclasses.fields(DrafterConfig)}


def drafter_target_config(target: TargetModel) -> dict:
    """The target's shape as the drafter's blocks need it (a LlamaGen ``GPTConfig`` dict): a
    LlamaGen target's own config; for any other :class:`TargetModel` one built from its
    ``config`` (``dim``, ``vocab_size``, ``block_size``, ``condition_length``, ``num_classes``,
    ``model_type``), with ``config.n_head`` heads if it says, else heads of 64 dims (or the widest
    that divides ``dim`` in multiples of 4, as the 2D RoPE needs)."""
    config = target.config
    if isinstance(config, GPTConfig):
        return config.to_dict()
    dim = int(config.dim)
    heads = getattr(config, "n_head", None)
    if heads is None or dim % heads or (dim // heads) % 4:
        fits = [h for h in range(1, dim + 1) if dim % h == 0 and (dim // h) % 4 == 0]
        if not fits:
            raise RelaxspecError(f"the target's width {dim} has no head size that is a multiple of 4: "
                                 "an EAGLE drafter cannot be built for it")
        heads = min(fits, key=lambda h: (abs(dim // h - 64), h))
    shape = block_shape(dim=dim, n_head=int(heads), vocab_size=int(config.vocab_size),
                        block_size=int(config.block_size), condition_length=int(config.condition_length),
                        num_classes=max(1, int(getattr(config, "num_classes", 1) or 1)),
                        model_type=getattr(config, "model_type", "c2i"), multiple_of=32)
    return shape.to_dict()


def engine_shape(target: TargetModel) -> dict:
    """What a transformers-family drafter shares with its target: feature width, vocabulary
    (the codebook) and image tokens."""
    config = target.config
    return {"dim": int(config.dim), "vocab_size": int(config.vocab_size), "block_size": int(config.block_size)}


def drafter_config(target: TargetModel, n_layer: int = 1, family: str | None = None,
                   fused_layers: list[int] | bool | None = None) -> DrafterConfig:
    """A new drafter's config for ``target``: of the target's own family (default; LlamaGen blocks
    for a LlamaGen target or one known only by the protocol), or ``family="llamagen"`` for
    LlamaGen blocks sized from any target. ``fused_layers``: a fused-feature (EAGLE-3) drafter
    reading those target layers, or ``True`` for EAGLE-3's (:func:`default_fused_layers`)."""
    own = hf.family_of(target)
    family = family or own or LLAMAGEN
    if fused_layers is True:
        fused_layers = default_fused_layers(target)
    fused = None if fused_layers in (None, False) else [int(i) for i in fused_layers]
    if family == LLAMAGEN:
        config = DrafterConfig(target=drafter_target_config(target), n_layer=n_layer, fused_layers=fused)
    elif family != own:
        raise RelaxspecError(f"a drafter of the {family} family is built of its target's layers; this target is "
                             f"{own or 'not a transformers model'}")
    else:
        config = DrafterConfig(target=engine_shape(target), n_layer=n_layer, family=family,
                               layer=layer_spec(hf.text_model_of(target), n_layer), fused_layers=fused)
    check_target(config, target)
    return config


def default_fused_layers(target: TargetModel) -> list[int]:
    """EAGLE-3's low, middle and high layers of ``target`` (:func:`relaxspec.models.base.fused_layers`);
    refused (one line) for a target that cannot hand its layers' streams over."""
    count = layer_count(target)
    if count is None:
        raise RelaxspecError(f"a fused-feature drafter reads the target's layers; this target "
                             f"({type(target).__name__}) has no num_layers / capture= to hand them over")
    return list(fused_layers(count))


def check_target(config: DrafterConfig, target: TargetModel) -> None:
    """Refuse (one line) a ``target`` the drafter was not made for: another family, or another
    width, vocabulary, grid (or, for LlamaGen blocks, heads), or a condition it cannot read."""
    if config.family == LLAMAGEN:
        tcfg, mine = GPTConfig.from_dict(drafter_target_config(target)), config.target_config
        theirs, ours = (tcfg.dim, tcfg.vocab_size, tcfg.block_size, tcfg.n_head), \
            (mine.dim, mine.vocab_size, mine.block_size, mine.n_head)
        what = "dim/vocab/grid/heads"
        if config.lantern_layout:  # LANTERN's drafter has heads of its own
            theirs, ours, what = theirs[:3], ours[:3], "dim/vocab/grid"
    else:
        own = hf.family_of(target)
        if own != config.family:
            raise RelaxspecError(f"the drafter is of the {config.family} family (its target's layers); this target "
                                 f"is {own or 'not a transformers model'}")
        shape = engine_shape(target)
        theirs, ours = tuple(shape.values()), tuple(config.target[key] for key in shape)
        what = "dim/vocab/grid"
    if theirs != ours:
        raise RelaxspecError(f"the drafter was trained for a different target ({what} {ours} vs {theirs})")
    if config.family != LLAMAGEN and config.own_embedding:
        vocabulary = int(hf.text_model_of(target).config.vocab_size)
        if getattr(target, "code_ids", None) is None or vocabulary != config.layer["config"]["vocab_size"]:
            raise RelaxspecError(f"the drafter's token table covers {config.layer['config']['vocab_size']} tokens; "
                                 f"this target's vocabulary is {vocabulary}")
    if config.fused:
        count = layer_count(target)
        if count is None:
            raise RelaxspecError(f"the drafter reads fused target features; this target ({type(target).__name__}) "
                                 "has no num_layers / capture= to hand its layers' streams over")
        if max(config.fused_layers) > count:
            raise RelaxspecError(f"the drafter reads target layers {config.fused_layers}; this target has {count}")
    if config.condition_pairs:
        cls = int(target.config.condition_length)
        if config.family == LLAMAGEN and cls != config.condition_pairs + 1:
            raise RelaxspecError(f"the drafter reads a {config.condition_pairs + 1}-token condition "
                                 f"({config.condition_pairs} condition pairs); this target's condition is {cls} tokens")
        if config.family != LLAMAGEN and cls > config.condition_pairs + 1:
            raise RelaxspecError(f"the drafter reads prompts of at most {config.condition_pairs + 1} tokens; this "
                                 f"target's are {cls}")
        if config.family != LLAMAGEN and not callable(getattr(target, "condition_tokens", None)):
            raise RelaxspecError("the drafter reads the prompt's tokens; this target has none (condition_tokens)")
