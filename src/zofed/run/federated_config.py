"""The federated part of a run's config: the federation (method, rounds, partition, server optimizer, sampling,
aggregation and its defenses), the Flower backend's settings and the attackers. `FederatedConfig` adds them to
the centralized sections (run/config.py), and is loaded the same way (`load_config(..., schema=FederatedConfig)`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from zofed.data.partition import PartitionConfig
from zofed.fl.aggregate import AGGREGATORS
from zofed.fl.attacks import AttackKind
from zofed.fl.methods import get_method
from zofed.fl.personal import BlockSampling
from zofed.fl.plan import FederationPlan
from zofed.fl.server_opt import SERVER_OPTIMIZERS, ServerOptimizer, make_server_optimizer
from zofed.run.config import ConfigError, FinetuneConfig, _Section, refuse_retired
from zofed.run.recipes import Recipe, apply_recipe


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
    relative_to: Literal["current", "start"] = "current"  # that RMS now, or the tensor's at the start of the run
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
        # only a run that asks for it carries the key, so the other runs' resolved settings do not change
        if self.relative_to != "current":
            settings["relative_to"] = self.relative_to
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
    # pi_b proportional to sqrt(n_b E_b / c_b), c_b the block's share of a pass: the least variance per pass where a
    # step's cost depends on its block (a cached prefix); no effect where every step runs the whole model
    cost_aware: bool = False
    # each block's noise shaped per coordinate by the federation's second moment of the update, sent down each round
    # (fl/block_precondition.py): outlier coordinates probed less
    precondition: bool = False


class FederationSection(_Section):
    method: str = "zofed"  # a registered method (fl/methods/): zofed, zo-seeds, decomfl, fedkseed, fedmezo, ...
    # zofed's recommended settings filled in where the config leaves them unset (run/recipes.py): auto picks weights
    # (the label head and the top block's norm gains on a round's cached prefixes) for zofed on prompt
    # classification with a decoder when nothing says what trains; head is the label head alone on cached
    # features; a validated config holds what auto resolved to
    recipe: Recipe = "auto"
    rounds: int = Field(20, ge=1)
    clients_per_round: int = Field(5, ge=1)
    local_steps: int = Field(10, ge=1)
    pool_size: int = Field(64, ge=1)  # fedkseed's shared seed pool
    first_order_optimizer: Literal["adamw", "sgd"] = "adamw"  # fedavg, fedadam: clients back-propagate
    first_order_lr: float = Field(1e-3, gt=0)
    # Logit adjustment against label skew (data/tasks.py, label_shift): each client's training loss adds this x
    # the log of its own label frequencies to the logits, so its local steps fit its class prior into those
    # offsets rather than into the shared classifier. Classification tasks only; 0: off.
    logit_adjust: float = Field(0.0, ge=0)
    # With zo.cache: features (prompt classification with every block frozen, e.g. the label head alone): a
    # client runs this many of its examples through the frozen model once a round (all of them when it has fewer,
    # charged as this many) and takes its local steps on their last hidden states, so a step costs the head alone
    # and a round can hold many. None: train.batch_size (one pass a round). With a frozen bottom cached (zo.cache:
    # prefix, or auto where it splits the model; ZO methods): the same for the blocks above it, each step running
    # only them on the round's kept prefixes, so the bottom's compute is paid once a round, not once a step.
    # None: train.batch_size; 0: every step captures its own batch.
    cached_examples: int | None = Field(None, ge=0)
    # The precision of the clients' scalars on the wire: 16 sends each as float16 (2 bytes, about 3 significant
    # digits, saturating at 65504), so twice the steps fit the same uplink. Clients round each scalar before
    # their step uses it, so the server's replay stays exact.
    scalar_bits: Literal[32, 16] = 32
    # how the clients' updates combine (fl/aggregate.py): mean, trimmed-mean, median, seed-median (shared seeds)
    aggregator: str = "mean"
    trim: float = Field(0.1, ge=0, lt=0.5)  # trimmed-mean: the share of clients dropped at each end, per coordinate
    # Each accepted uplink's numbers (its scalars, or a dense update) are scaled down to at most this L2 norm
    # before they are aggregated: the bound on how far one client can move a round. None: no bound.
    clip_norm: float | None = Field(None, gt=0)
    # Screening (run/screening.py): an update that raises the loss on the server's probe examples by more than
    # this is refused, as a rejected uplink. None: no screening.
    screen_threshold: float | None = None
    screen_examples: int = Field(32, ge=1)  # the probe examples (a seeded sample of the training data)
    # alone: the loss change an update causes by itself; leave-one-out: the change it causes to the round's mean;
    # agreement: minus the rank correlation of the client's scalars with the probe's own along the same directions
    screen_score: Literal["alone", "leave-one-out", "agreement"] = "alone"
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
    # The final per-client evaluation reads at most this many of each client's held-out examples (a seeded
    # sample): with 20% held out, ten clients of thousands would otherwise cost more passes than the run. None: all.
    client_eval_examples: int | None = Field(200, ge=1)
    # Tail averaging: after this share of the rounds, the model evaluated and released is the mean of the server's
    # iterates since (the clients still train from the last one). None: the last iterate.
    average_from: float | None = Field(None, ge=0, lt=1)
    # Append every accepted uplink, hash-chained, to the run's uplinks.jsonl (run/uplink_log.py, `zofed replay`).
    # A ZO uplink is a few hundred bytes; a dense one (fedavg, fedadam) holds the whole update.
    log_uplinks: bool = True

    def average_start(self) -> int | None:
        """The first round (0-based) whose iterate is averaged, or None."""
        return None if self.average_from is None else int(self.average_from * self.rounds)

    @field_validator("method")
    @classmethod
    def _registered(cls, name: str) -> str:
        get_method(name)  # raises naming the registered methods
        return name

    @model_validator(mode="before")
    @classmethod
    def _retired(cls, data: Any) -> Any:
        return refuse_retired(data, {"feature_cache": lambda n: (
            f"federation.feature_cache={n} was replaced by zo.cache: features with federation.cached_examples={n}"
            if n else "federation.feature_cache was replaced by zo.cache: features with federation.cached_examples=N "
            "(0, off, is zo.cache: none or prefix)")})

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
    def _screen_settings_only_when_screening(self) -> FederationSection:
        for key in ("screen_examples", "screen_score"):
            if self.screen_threshold is None and getattr(self, key) != FederationSection.model_fields[key].default:
                raise ValueError(f"federation.{key} is a setting of screening: set federation.screen_threshold")
        return self

    @model_validator(mode="after")
    def _trim_only_where_read(self) -> FederationSection:
        if self.trim != FederationSection.model_fields["trim"].default and self.aggregator != "trimmed-mean":
            raise ValueError(f"federation.trim is a setting of the trimmed-mean aggregator, not of "
                             f"{self.aggregator}")
        return self

    @model_validator(mode="after")
    def _seed_median_needs_shared_seeds(self) -> FederationSection:
        if self.aggregator != "seed-median":
            return self
        rounds = get_method(get_method(self.method).round_method(self.sampling.personalize))
        if not rounds.shares_seeds(self.sampling.shared_seeds):
            raise ValueError(f"federation.aggregator seed-median needs a round's clients to share their step seeds; "
                             f"{self.method}'s do not here (decomfl and hiso share them, zofed with "
                             f"federation.sampling.shared_seeds=true): use median")
        return self

    @model_validator(mode="after")
    def _agreement_needs_scalars(self) -> FederationSection:
        if self.screen_score == "agreement" and get_method(self.method).dense_uplink:
            raise ValueError(f"federation.screen_score agreement checks a client's scalars, and {self.method} "
                             f"uploads a dense update: use alone or leave-one-out")
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
    # SecAgg+ (flower/secure.py): the server learns only the round's example-weighted mean of the clients' scalars,
    # for methods whose server needs no more (decomfl, hiso). Each scalar is clipped to +-secagg_range and
    # quantized to 2^22 levels over that range.
    secure_aggregation: bool = False
    secagg_range: float = Field(100.0, gt=0)

    @model_validator(mode="after")
    def _range_only_when_secure(self) -> FlowerSection:
        if not self.secure_aggregation and self.secagg_range != FlowerSection.model_fields["secagg_range"].default:
            raise ValueError("flower.secagg_range is a setting of flower.secure_aggregation: set it to true")
        return self


class AttackSection(_Section):
    """Clients that lie (fl/attacks.py), to measure the server's defenses: a seeded share of the clients attacks
    whenever it is sampled."""

    kind: AttackKind = "none"  # sign-flip, scale, random, label-flip, stale, seed-grind
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

    @model_validator(mode="before")
    @classmethod
    def _recipe(cls, data: Any) -> Any:
        return apply_recipe(data) if isinstance(data, dict) else data

    @model_validator(mode="after")
    def _seed_median_needs_linear_steps(self) -> FederatedConfig:
        if self.federation.aggregator == "seed-median" and self.optimizer.name != "mezo":
            raise ValueError(f"federation.aggregator seed-median pools each client's steps per seed, which a "
                             f"stateful local optimizer's update is not; optimizer.name={self.optimizer.name!r} "
                             f"needs mezo (or use median)")
        return self

    @model_validator(mode="after")
    def _secure_aggregation_where_a_sum_suffices(self) -> FederatedConfig:
        if not self.flower.secure_aggregation:
            return self
        fed = self.federation
        rounds = get_method(get_method(fed.method).round_method(fed.sampling.personalize))
        problems = []
        if not rounds.sum_suffices:
            problems.append(f"{fed.method}'s server needs each client's own numbers (secure aggregation serves "
                            f"decomfl and hiso, whose clients share seeds and whose server reads only their sum)")
        if fed.aggregator != "mean":
            problems.append(f"federation.aggregator {fed.aggregator} looks at each client's update; use mean")
        if fed.clip_norm is not None and fed.dp_at != "client":
            problems.append("the server cannot clip numbers it never sees: drop federation.clip_norm, or clip at "
                            "the clients with federation.dp_at=client")
        if fed.screen_threshold is not None:
            problems.append("screening scores each client's update, which the server never sees")
        if self.optimizer.name != "mezo":
            problems.append(f"optimizer.name={self.optimizer.name!r}: a stateful local optimizer's update is not a "
                            f"sum of scalars along the shared seeds; use mezo")
        if fed.clients_per_round < 2:
            problems.append("a sum of one client is that client's numbers: set federation.clients_per_round >= 2")
        if problems:
            raise ValueError("flower.secure_aggregation: " + "; ".join(problems))
        return self

    @model_validator(mode="after")
    def _logit_adjust_needs_classes(self) -> FederatedConfig:
        if self.federation.logit_adjust and self.task.type == "causal-lm":
            raise ValueError(f"federation.logit_adjust={self.federation.logit_adjust} shifts class logits; "
                             "task.type causal-lm has no classes (set it to 0)")
        return self

    @model_validator(mode="after")
    def _cached_features_need_a_head(self) -> FederatedConfig:
        fed = self.federation
        if fed.cached_examples is not None and self.zo.cache == "none":
            raise ValueError(f"federation.cached_examples={fed.cached_examples} counts the examples a client runs "
                             f"through its frozen part once a round with zo.cache: features (the label head) or "
                             f"prefix (blocks above a frozen bottom; auto where it splits the model); this run has "
                             f"zo.cache: {self.zo.cache} (leave cached_examples unset, or set zo.cache)")
        if fed.cached_examples == 0 and self.zo.cache == "features":
            raise ValueError("federation.cached_examples=0 (every step captures its own batch) is for zo.cache: "
                             "prefix; with zo.cache: features every step draws from the round's cached rows")
        if fed.cached_examples is not None and self.zo.cache != "features" and get_method(fed.method).first_order:
            raise ValueError(f"federation.cached_examples with zo.cache: {self.zo.cache} keeps a round's prefixes "
                             f"for ZO steps; {fed.method} back-propagates through the top blocks on every batch "
                             f"(leave cached_examples unset)")
        if self.zo.cache == "features" and self.task.type != "prompt-classification":
            raise ValueError(f"zo.cache: features caches what a prompt classifier's head reads; task.type "
                             f"{self.task.type} has no such head (use zo.cache: prefix)")
        return self

    def feature_cache(self, prefix_split: bool = False) -> int:
        """The examples a client runs through its frozen part once a round, then draws every step's batch from
        (0: every step runs its own batch; train.batch_size unless federation.cached_examples says otherwise): with
        zo.cache: features, and for a ZO method with a frozen bottom cached, zo.cache: prefix or, with auto, where
        the setup split the model (`prefix_split`, which the config alone cannot know)."""
        fed = self.federation
        if self.zo.cache == "features":
            return fed.cached_examples or self.train.batch_size
        split = self.zo.cache == "prefix" or (self.zo.cache == "auto" and prefix_split)
        if not split or get_method(fed.method).first_order:
            return 0
        return self.train.batch_size if fed.cached_examples is None else fed.cached_examples

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


def federation_plan(config: FederatedConfig, num_clients: int, pass_fraction: float = 1.0, *,
                    backward_fraction: float = 1.0, head_fraction: float = 0.0,
                    tensor_shares: tuple[float, ...] = ()) -> FederationPlan:
    """The plan of a configured run over `num_clients` clients (the partition decides how many);
    `pass_fraction` is the share of blocks a perturbed pass runs (the setup's prefix cache knows it), and
    `backward_fraction`, `head_fraction` and `tensor_shares` the shares a client's compute is counted with
    (fl/cost.py). A first-order client runs the whole model (pass_fraction 1) unless it steps on cached features."""
    fed, sampling = config.federation, config.federation.sampling
    method = get_method(fed.method)
    cache = config.feature_cache(prefix_split=pass_fraction < 1.0)
    settings: dict[str, Any] = {
        "method": method.round_method(sampling.personalize), "num_clients": num_clients,
        "clients_per_round": fed.clients_per_round, "local_steps": fed.local_steps,
        "lr": fed.first_order_lr if method.first_order else config.optimizer.lr, "eps": config.zo.eps,
        "run_seed": config.train.seed, "queries": config.zo.queries, "batch_size": config.train.batch_size,
        "noise": config.zo.noise, "pool_size": fed.pool_size,
        "sampling": BlockSampling(**sampling.model_dump(exclude={"personalize"})),
        "first_order_optimizer": fed.first_order_optimizer,
        "pass_fraction": 1.0 if method.first_order and not cache else pass_fraction,
        "backward_fraction": backward_fraction, "head_fraction": head_fraction,
        "estimator": config.zo.resolved_estimator(fed.method),
        "optimizer": "mezo" if method.first_order else config.optimizer.name, "momentum": config.optimizer.momentum,
        "beta1": config.optimizer.beta1, "beta2": config.optimizer.beta2, "logit_adjust": fed.logit_adjust,
        "feature_cache": cache, "scalar_bits": fed.scalar_bits,
        "tensor_shares": () if method.first_order else tensor_shares}
    return FederationPlan(**settings)
