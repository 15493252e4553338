"""One config object for a centralized ZO fine-tuning run, read from YAML with command-line overrides.

Unknown keys and bad values are errors that name the offending key, so a typo never silently falls back
to a default.
"""

from __future__ import annotations

import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from zofed.data.catalog import BUILTIN_PROMPTS
from zofed.data.tasks import TaskConfig
from zofed.fl.methods import get_method
from zofed.models.selection import TrainableConfig
from zofed.zo.noise import NoiseKind
from zofed.zo.optim import OPTIMIZER_NAMES, hyperparameters


class ConfigError(ValueError):
    """A config file or override that cannot be used; the message names the key and the problem."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelSection(_Section):
    name: str = "smollm2-135m"
    kind: Literal["causal-lm", "encoder"] | None = None
    # auto: cuda, else mps, else the CPU; the noise is the same on every device (zo/noise.py)
    device: str = "auto"
    # storage of the frozen linear and embedding weights; compute, trainable tensors and the difference stay fp32
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"


class DataSection(_Section):
    # A built-in name, a file path, or hub:NAME[:CONFIG][[SPLIT]]: hub:imdb (split train), hub:imdb[test],
    # hub:glue:sst2[validation]. No test_source: a seeded fifth of the source is held out for testing.
    source: str = "tweets"
    test_source: str | None = None  # file or hub split for testing (hub:imdb[test]); built-ins bring their own
    format: str | None = None  # files only; None infers it from the extension
    encoding: str = "utf-8"  # files only: a Python codec name for legacy files, e.g. cp1252 or latin-1
    on_bad_lines: Literal["error", "skip"] = "error"  # files only; skip leaves unusable lines out, and says which
    text_columns: list[str] | None = None
    optional_columns: list[str] = Field(default_factory=list)  # text columns that may be empty (Dolly's context)
    label_column: str | None = "label"
    label_names: list[str] | None = None
    train_examples: int | None = Field(None, ge=1)  # cap on training examples (seeded subset)
    eval_examples: int = Field(300, ge=1)  # fixed test subset evaluated during training
    test_examples: int | None = Field(None, ge=1)  # cap on the final test evaluation
    # A seeded validation split carved from the training data (held out from training); with evaluate_on:
    # validation every evaluation, the curves' and the final one, reads it instead of the test split, so
    # settings can be tuned without looking at the test data.
    validation_examples: int | None = Field(None, ge=1)
    evaluate_on: Literal["test", "validation"] = "test"
    # A held-out task: the training records whose `heldout_column` field is one of `heldout_values` leave the
    # training data and become the test set (in place of the source's own), e.g. one Dolly category never trained on.
    heldout_column: str | None = None
    heldout_values: list[str] = Field(default_factory=list)

    @model_validator(mode="after")
    def _validation_exists(self) -> DataSection:
        if self.evaluate_on == "validation" and self.validation_examples is None:
            raise ValueError("evaluate_on: validation needs data.validation_examples (the split carved from "
                             "the training data)")
        if bool(self.heldout_column) != bool(self.heldout_values):
            raise ValueError("a held-out task needs both data.heldout_column (the field) and data.heldout_values "
                             "(the values that make the test set)")
        return self


class ZOSection(_Section):
    noise: NoiseKind = "rademacher"
    eps: float = Field(1e-3, gt=0)
    queries: int = Field(1, ge=1)
    # central: (L(x+eps u) - L(x-eps u)) / 2 eps, 2 q passes a step; forward: (L(x+eps u) - L(x)) / eps around one
    # shared centre pass, q + 1 passes (biased, cheaper for many queries). Unset: the method's own (zofed: forward
    # when a step averages several queries; every other method, and centralized runs: central).
    estimator: Literal["central", "forward"] | None = None
    # What is computed once and reused. prefix: the frozen blocks below the first trainable one run once per
    # batch, and only the blocks above for each perturbed pass (zo/prefix.py): a step then costs (1 - f) + 2 q f
    # forward passes, f the share of blocks run; the losses are the full pass's. auto (the default): prefix
    # wherever the model and task allow it and it saves compute (a decoder whose trainable tensors all lie above
    # its lowest block), else none. features: every block frozen (the label head alone); a federated client runs
    # federation.cached_examples of its examples through the model once a round and steps on their last hidden
    # states. The in-process simulator remembers what it can across rounds by itself (each example's prefix, or
    # its body features; ZOFED_FEATURE_STORE=DIR keeps the latter across runs), with none as well (its clients are
    # charged whole passes and it runs only the blocks above the frozen ones); that saves its time, not a
    # client's, and the compute counted is each client's.
    cache: Literal["auto", "none", "prefix", "features"] = "auto"
    # features: each coordinate's noise scaled by 1 / RMS of the input feature it multiplies, measured once on
    # random tokens through the starting model (zo/feature_scale.py); channels: only the coordinates reading each
    # tensor's `channels` largest such features move; none: the same scale for every coordinate
    precondition: Literal["none", "features", "channels"] = "none"
    channels: int = Field(8, ge=1)  # zo.precondition channels: the input channels of each tensor that move

    @model_validator(mode="before")
    @classmethod
    def _retired(cls, data: Any) -> Any:
        return refuse_retired(data, {"prefix_cache": lambda v: "zo.prefix_cache was replaced by zo.cache: prefix "
                                                               "(zo.cache: auto | none | prefix | features)"})

    def resolved_estimator(self, method: str | None) -> str:
        """The estimator a run uses: the set one, else the federated method's default, else central."""
        if self.estimator is not None:
            return self.estimator
        return get_method(method).default_estimator(self.queries) if method else "central"


class OptimizerSection(_Section):
    name: str = "mezo"
    lr: float = Field(1e-4, gt=0)
    schedule: Literal["constant", "linear", "cosine"] = "constant"
    warmup: int = Field(0, ge=0)
    momentum: float = Field(0.9, ge=0, lt=1)  # zo-sgd-momentum
    beta1: float = Field(0.9, ge=0, lt=1)  # zo-adam, zo-adamu
    beta2: float = Field(0.999, ge=0, lt=1)
    momentum_weight: float = Field(0.5, ge=0)  # zo-adamu
    anneal_steps: int = Field(1000, ge=1)
    density: float = Field(0.25, gt=0, le=1)  # sparse-mezo
    mask_interval: int = Field(50, ge=1)

    @model_validator(mode="after")
    def _known(self) -> OptimizerSection:
        if self.name not in OPTIMIZER_NAMES:
            raise ValueError(f"unknown ZO optimizer {self.name!r}; choose one of {', '.join(OPTIMIZER_NAMES)}")
        return self

    def hyperparameters(self) -> dict[str, float]:
        """Only the hyperparameters the chosen optimizer takes."""
        return hyperparameters(self.name, self)


class TrainSection(_Section):
    steps: int = Field(200, ge=0)
    batch_size: int = Field(16, ge=1)
    eval_every: int = Field(50, ge=1)
    eval_batch_size: int = Field(32, ge=1)
    checkpoint_every: int = Field(50, ge=1)
    seed: int = Field(0, ge=0, lt=2**64)  # keys every random stream of the run (zofed.streams)

    @model_validator(mode="before")
    @classmethod
    def _retired(cls, data: Any) -> Any:
        gone = ("train.remember_features and train.features_dir are gone: with zo.cache: features the in-process "
                "simulator remembers body features by itself; set ZOFED_FEATURE_STORE=DIR to keep them across runs")
        return refuse_retired(data, {"remember_features": lambda v: gone, "features_dir": lambda v: gone})


def refuse_retired(data: Any, retired: dict[str, Any]) -> Any:
    """`data` (a section's raw mapping) unchanged, or an error naming the setting that replaced a retired key it
    holds: `retired` maps each key to a function of its value that gives the message. A stored run config written
    before the key was retired is refused the same way (`zofed` does not guess what it meant)."""
    if isinstance(data, dict):
        for key, message in retired.items():
            if key in data:
                raise ValueError(message(data[key]))
    return data


class FinetuneConfig(_Section):
    model: ModelSection = Field(default_factory=ModelSection)
    data: DataSection = Field(default_factory=DataSection)
    task: TaskConfig = Field(default_factory=TaskConfig)
    trainable: TrainableConfig = Field(default_factory=TrainableConfig)
    zo: ZOSection = Field(default_factory=ZOSection)
    optimizer: OptimizerSection = Field(default_factory=OptimizerSection)
    train: TrainSection = Field(default_factory=TrainSection)
    out_dir: str = "runs/finetune"
    tensorboard_dir: str | None = None  # also write the metrics as TensorBoard scalars there (run/tensorboard.py)

    @model_validator(mode="before")
    @classmethod
    def _builtin_prompt(cls, data: Any) -> Any:
        """A built-in data set's own template and verbalizer, where a prompt-classification config sets neither."""
        if not isinstance(data, dict):
            return data
        source, task = data.get("data", {}), data.get("task", {})
        if not isinstance(source, dict) or not isinstance(task, dict):
            return data  # built section objects: what they hold was chosen already
        source = source.get("source", "tweets")
        if source not in BUILTIN_PROMPTS or task.get("type", "prompt-classification") != "prompt-classification":
            return data
        template, verbalizer = BUILTIN_PROMPTS[source]
        return {**data, "task": {"template": template, "verbalizer": verbalizer, **task}}


def deep_merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    node = tree
    *parents, leaf = dotted.split(".")
    for key in parents:
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {dotted}: {key} is not a section")
        node = child
    node[leaf] = value


def _text_field(schema: type[BaseModel], dotted: str) -> bool | None:
    """Whether the schema declares `dotted` as text that also takes None (True) or as plain str (False); None for
    any other key (not text, or not in the schema: validation then names it)."""
    node: Any = schema
    for key in dotted.split("."):
        if not (isinstance(node, type) and issubclass(node, BaseModel) and key in node.model_fields):
            return None
        node = node.model_fields[key].annotation
    if node is str:
        return False
    if typing.get_origin(node) in (typing.Union, types.UnionType) and str in typing.get_args(node) \
            and set(typing.get_args(node)) <= {str, type(None)}:
        return True
    return None


def parse_overrides(overrides: list[str], schema: type[BaseModel] | None = None) -> list[tuple[str, Any]]:
    """`key.sub=value` strings; values are parsed as YAML so numbers, lists and booleans work. A value YAML cannot
    parse is taken as its plain text. For a key the schema declares as text (a prompt template, a path) the value
    is the text as given unless it is YAML-quoted, or a null the field takes: YAML would read
    `Review: {text} Sentiment:` as a mapping and drop a `# ...` tail as a comment."""
    parsed = []
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form section.key=value")
        key, raw = item.split("=", 1)
        key = key.strip()
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError:
            value = raw
        nullable = _text_field(schema, key) if schema is not None else None
        if nullable is not None:
            quoted = raw.strip()[:1] in ("'", '"') and isinstance(value, str)
            if not quoted and not (nullable and value is None):
                value = raw
        parsed.append((key, value))
    return parsed


def _format_validation(err: ValidationError, origin: str) -> str:
    lines = [f"invalid config ({origin}):"]
    for e in err.errors():
        where = ".".join(str(p) for p in e["loc"]) or "(top level)"
        lines.append(f"  {where}: {e['msg']}")
    return "\n".join(lines)


def load_config(path: str | Path | None = None, overrides: list[str] | None = None,
                defaults: dict[str, Any] | None = None,
                schema: type[FinetuneConfig] = FinetuneConfig) -> FinetuneConfig:
    """Defaults, then the YAML file, then `section.key=value` overrides, validated as one object."""
    tree: dict[str, Any] = dict(defaults or {})
    origin = "defaults"
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        try:
            loaded = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as err:
            raise ConfigError(f"config file {path} is not valid YAML: {err}") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {path} must hold a mapping of sections, not {type(loaded).__name__}")
        tree = deep_merge(tree, loaded)
        origin = str(path)
    for key, value in parse_overrides(overrides or [], schema):
        _set_dotted(tree, key, value)
    try:
        return schema.model_validate(tree)
    except ValidationError as err:
        raise ConfigError(_format_validation(err, origin)) from None
