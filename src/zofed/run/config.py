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
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from zofed.data.partition import PartitionConfig
from zofed.data.tasks import TaskConfig
from zofed.fl.aggregate import AGGREGATORS
from zofed.fl.attacks import AttackKind
from zofed.fl.methods import get_method
from zofed.fl.server_opt import SERVER_OPTIMIZERS, ServerOptimizer, make_server_optimizer
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
    # Run the frozen blocks below the first trainable one once per batch, and only the blocks above for each
    # perturbed pass (zo/prefix.py): a step then costs (1 - f) + 2 q f forward passes, f the share of blocks run.
    prefix_cache: bool = False
    # features: each coordinate's noise scaled by 1 / RMS of the input feature it multiplies, measured once on
    # random tokens through the starting model (zo/feature_scale.py); none: the same scale for every coordinate
    precondition: Literal["none", "features"] = "none"


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
    seed: int = 0


class FinetuneConfig(_Section):
    model: ModelSection = Field(default_factory=ModelSection)
    data: DataSection = Field(default_factory=DataSection)
    task: TaskConfig = Field(default_factory=TaskConfig)
    trainable: TrainableConfig = Field(default_factory=TrainableConfig)
    zo: ZOSection = Field(default_factory=ZOSection)
    optimizer: OptimizerSection = Field(default_factory=OptimizerSection)
    train: TrainSection = Field(default_factory=TrainSection)
    out_dir: str = "runs/finetune"


class ServerOptimizerSection(_Section):
    """Unset fields take the method's default (its `server_default` in fl/methods/): zofed uses adam with one
    second moment for the whole update (granularity global) and relative steps."""

    name: str | None = None  # a registered server optimizer (fl/server_opt.py): sgd, adam, yogi, amsgrad
    lr: float | None = Field(None, gt=0)
    granularity: Literal["coordinate", "tensor", "global"] | None = None
    beta1: float = Field(0.9, ge=0, lt=1)
    beta1_start: float | None = Field(None, ge=0, lt=1)  # set: beta1 rises linearly from it to beta1 over the run
    beta2: float = Field(0.99, ge=0, lt=1)
    tau: float = Field(1e-6, gt=0)
    warm_start: bool = False  # tensor-wise only: a tensor's v starts from its expected first-round energy
    relative: bool | None = None  # adaptive only: each tensor's step is lr times its own RMS (a LAMB-style trust ratio)
    decay: Literal["constant", "cosine"] = "constant"  # cosine: lr falls to zero over the run's federation.rounds

    def resolved(self, method: str, rounds: int) -> dict[str, Any]:
        """The settings the server optimizer runs with: unset fields filled from the method's default."""
        default = get_method(method).server_default
        name = self.name or default.name
        relative = self.relative if self.relative is not None else (name == default.name and default.relative)
        # An lr only has a meaning for the step it was set for: sgd's 1.0 is not an adam step, nor is a relative
        # step an absolute one.
        same_step = name == default.name and relative == default.relative
        lr = self.lr if self.lr is not None else (default.lr if same_step else SERVER_OPTIMIZERS[name].default_lr)
        settings = {"name": name, "lr": lr, "decay_rounds": rounds if self.decay == "cosine" else 0,
                    "relative": relative, "warm_start": self.warm_start}
        if SERVER_OPTIMIZERS[name].adaptive:
            settings.update(granularity=self.granularity or default.granularity, beta1=self.beta1, beta2=self.beta2,
                            tau=self.tau)
        if self.beta1_start is not None:  # a plain step refuses it (make_server_optimizer says why)
            settings.update(beta1_start=self.beta1_start, ramp_rounds=rounds)
        return settings

    @field_validator("name")
    @classmethod
    def _registered(cls, name: str | None) -> str | None:
        if name is not None and name not in SERVER_OPTIMIZERS:
            raise ValueError(f"unknown server optimizer {name!r}; choose one of {', '.join(SERVER_OPTIMIZERS)}")
        return name

    def build(self, method: str, rounds: int) -> ServerOptimizer:
        try:
            return make_server_optimizer(**self.resolved(method, rounds))
        except ValueError as err:  # settings that are each valid but do not go together
            raise ConfigError(f"federation.server_optimizer: {err}") from None


class SamplingSection(_Section):
    """zofed's personalized block sampling (fl/personal.py); methods that do not read it refuse it."""

    personalize: bool = True  # false: every step perturbs every block (the ablation without personalization)
    mix: float = Field(0.3, gt=0, le=1)  # share of the size-proportional distribution kept in each client's pi
    prior_weight: float = Field(2.0, gt=0)  # probes the global estimate is worth in a client's own estimate
    tilt: float = Field(0.0, ge=0)  # ZO-AdaMU-style lean towards the server's first moment (needs adam/yogi/amsgrad)
    blocks: int = Field(0, ge=0)  # blocks the trainable tensors are cut into, contiguous in model order (0: per tensor)
    shared_seeds: bool = False  # the round's clients share step seeds (DeComFL-style), each drawing from its own pi


class FederationSection(_Section):
    method: str = "zofed"  # a registered method (fl/methods/): zofed, zo-seeds, decomfl, fedkseed, fedmezo, ...
    rounds: int = Field(20, ge=1)
    clients_per_round: int = Field(5, ge=1)
    local_steps: int = Field(10, ge=1)
    pool_size: int = Field(64, ge=1)  # fedkseed's shared seed pool
    first_order_optimizer: Literal["adamw", "sgd"] = "adamw"  # fedavg, fedadam: clients back-propagate
    first_order_lr: float = Field(1e-3, gt=0)
    aggregator: str = "mean"  # how the clients' updates combine (fl/aggregate.py): mean, trimmed-mean, median
    trim: float = Field(0.1, ge=0, lt=0.5)  # trimmed-mean: the share of clients dropped at each end, per coordinate
    # Each accepted uplink's numbers (its scalars, or a dense update) are scaled down to at most this L2 norm
    # before they are aggregated: the bound on how far one client can move a round. None: no bound.
    clip_norm: float | None = Field(None, gt=0)
    # Screening (run/screening.py): an update that raises the loss on the server's probe examples by more than
    # this is refused, as a rejected uplink. None: no screening.
    screen_threshold: float | None = None
    screen_examples: int = Field(32, ge=1)  # the probe examples (a seeded sample of the training data)
    # Client-level differential privacy (fl/privacy.py): every clipped uplink gets Gaussian noise of dp_noise x
    # clip_norm on each number; each round records the epsilon spent so far for dp_delta. None: no noise.
    dp_noise: float | None = Field(None, gt=0)
    dp_delta: float = Field(1e-5, gt=0, lt=1)
    # server: the server clips and noises each accepted uplink (it sees the clients' numbers); client: each honest
    # client clips and noises its own before sending (local DP: no one sees them), and the server leaves them be
    dp_at: Literal["server", "client"] = "server"
    partition: PartitionConfig = Field(default_factory=PartitionConfig)
    server_optimizer: ServerOptimizerSection = Field(default_factory=ServerOptimizerSection)
    sampling: SamplingSection = Field(default_factory=SamplingSection)
    eval_every: int = Field(1, ge=1)  # rounds between evaluations on the fixed test subset
    # Append every accepted uplink, hash-chained, to the run's uplinks.jsonl (run/uplink_log.py, `zofed replay`).
    # A ZO uplink is a few hundred bytes; a dense one (fedavg, fedadam) holds the whole update.
    log_uplinks: bool = True

    @field_validator("method")
    @classmethod
    def _registered(cls, name: str) -> str:
        get_method(name)  # raises naming the registered methods
        return name

    @field_validator("aggregator")
    @classmethod
    def _known_aggregator(cls, name: str) -> str:
        if name not in AGGREGATORS:
            raise ValueError(f"unknown aggregator {name!r}; choose one of {', '.join(AGGREGATORS)}")
        return name

    @model_validator(mode="after")
    def _privacy_settings(self) -> FederationSection:
        if self.dp_noise is not None and self.clip_norm is None:
            raise ValueError("federation.dp_noise needs federation.clip_norm: the noise is sized by the clip norm")
        for key in ("dp_delta", "dp_at"):
            if self.dp_noise is None and getattr(self, key) != FederationSection.model_fields[key].default:
                raise ValueError(f"federation.{key} is a setting of differential privacy: set federation.dp_noise")
        return self

    @model_validator(mode="after")
    def _screen_examples_only_when_screening(self) -> FederationSection:
        if self.screen_threshold is None and self.screen_examples != FederationSection.model_fields[
                "screen_examples"].default:
            raise ValueError("federation.screen_examples is a setting of screening: set federation.screen_threshold")
        return self

    @model_validator(mode="after")
    def _trim_only_where_read(self) -> FederationSection:
        if self.trim != FederationSection.model_fields["trim"].default and self.aggregator != "trimmed-mean":
            raise ValueError(f"federation.trim is a setting of the trimmed-mean aggregator, not of "
                             f"{self.aggregator}")
        return self

    @model_validator(mode="after")
    def _sampling_only_where_read(self) -> FederationSection:
        # Only a set value that differs from the default is refused, so dumped configs load again.
        if get_method(self.method).uses_sampling:
            return self
        for key in sorted(self.sampling.model_fields_set):
            if getattr(self.sampling, key) != SamplingSection.model_fields[key].default:
                raise ValueError(f"sampling.{key} is a setting of zofed's personalized sampling, which "
                                 f"{self.method} does not use")
        return self


class FlowerSection(_Section):
    """Settings only the Flower backend reads (`zofed run --backend flower`, docs/flower.md)."""

    min_clients: int | None = Field(None, ge=1)  # fewer usable replies in a round fail the run; None: all sampled
    reply_timeout: float = Field(600.0, gt=0)  # seconds a round waits for its replies; later ones count as missing
    node_timeout: float = Field(120.0, gt=0)  # seconds to wait for every SuperNode to connect
    client_cpus: float = Field(1.0, gt=0)  # simulation: cores each simulated SuperNode holds
    client_gpus: float = Field(0.0, ge=0)  # simulation: share of a GPU each simulated SuperNode holds (0.25: 4 a GPU)


class AttackSection(_Section):
    """Clients that lie (fl/attacks.py), to measure the server's defenses: a seeded share of the clients attacks
    whenever it is sampled."""

    kind: AttackKind = "none"  # sign-flip, scale, random, label-flip, stale
    fraction: float = Field(0.0, ge=0, le=1)  # share of the clients that attack, rounded up
    scale: float = Field(100.0, gt=0)  # kind scale: the factor on the attackers' scalars

    @model_validator(mode="after")
    def _whole(self) -> AttackSection:
        if (self.kind == "none") != (self.fraction == 0):
            raise ValueError("an attack needs both attack.kind and attack.fraction > 0 (kind none: fraction 0)")
        if self.kind != "scale" and self.scale != AttackSection.model_fields["scale"].default:
            raise ValueError(f"attack.scale is a setting of attack.kind scale, not of {self.kind}")
        return self


class FederatedConfig(FinetuneConfig):
    """A federated run: the centralized sections (model, data, task, trainable, zo, local optimizer, train)
    plus the federation. `train.batch_size` is the clients' local batch; `train.seed` the run seed."""

    federation: FederationSection = Field(default_factory=FederationSection)
    flower: FlowerSection = Field(default_factory=FlowerSection)
    attack: AttackSection = Field(default_factory=AttackSection)
    out_dir: str = "runs/federated"

    @model_validator(mode="after")
    def _no_centralized_only(self) -> FederatedConfig:
        # Only a set value that differs from the default is refused: dumped configs (config.yaml, the Flower apps'
        # config text) hold every key at its default, and must load again.
        for dotted, instead in CENTRALIZED_ONLY.items():
            section_name, key = dotted.split(".")
            section = getattr(self, section_name)
            if key in section.model_fields_set and getattr(section, key) != type(section).model_fields[key].default:
                raise ValueError(f"{dotted} is a centralized setting (zofed finetune) that a federated run would "
                                 f"ignore; {instead}")
        return self


# Keys of the centralized sections that a federated run has no use for, and what it uses instead.
CENTRALIZED_ONLY = {
    "optimizer.schedule": "clients step at a constant optimizer.lr (the server step's decay is set under "
                          "federation.server_optimizer)",
    "optimizer.warmup": "clients step at a constant optimizer.lr from the first round",
    "train.steps": "set federation.rounds (and federation.local_steps for each client's steps a round)",
    "train.eval_every": "set federation.eval_every (in rounds)",
    "train.checkpoint_every": "a federated run checkpoints after every round",
}


def _deep_merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _deep_merge(merged[key], value)
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
        tree = _deep_merge(tree, loaded)
        origin = str(path)
    for key, value in parse_overrides(overrides or [], schema):
        _set_dotted(tree, key, value)
    try:
        return schema.model_validate(tree)
    except ValidationError as err:
        raise ConfigError(_format_validation(err, origin)) from None
