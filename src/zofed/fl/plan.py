"""What a federated run asks of its clients: the run's plan, and the round plan every client receives.

`FederationPlan` is fixed for the whole run and built once from the config (`federation_plan` in
run/federated_config.py); each round's `LocalTraining` travels to the clients inside the downlink (`to_config` /
`from_config`), so a client needs nothing but the downlink to train. Both are plain data: the method adds its own
settings to a round's plan (`Method.round_plan`, asked by the server role).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

from zofed.fl.personal import BlockSampling
from zofed.zo.optim import MeZO, ZOAdam, ZOSGDMomentum, hyperparameters, make_optimizer

# Local optimizers a federated client can run: a fresh state each round, so the server replays them exactly from
# the round's seeds and scalars. (ZO-AdaMU's annealing and Sparse MeZO's masks would need state across rounds.)
FEDERATED_OPTIMIZERS = ("mezo", "zo-sgd-momentum", "zo-adam")


@dataclass(frozen=True)
class LocalTraining:
    """What the server asks of every client in one round (the round plan)."""

    method: str
    run_seed: int
    round_id: int
    local_steps: int
    lr: float
    eps: float
    queries: int = 1
    batch_size: int = 16
    noise: str = "rademacher"
    pool_size: int = 0  # fedkseed
    tilt: float = 0.0  # zofed: lean towards the server's first moment (sent with the downlink)
    blocks: int = 0  # zofed: how many blocks the trainable tensors are cut into (0: one per tensor)
    shared_seeds: int = 0  # zofed: 1 when the round's clients share their step seeds
    precondition: int = 0  # zofed: 1 when each block's noise is shaped by the second moment sent with the downlink
    pass_fraction: float = 1.0  # share of the model's blocks a perturbed pass runs (below 1: prefix caching)
    # shares of a full pass the client's compute is counted with (fl/cost.py): back-propagation's, from the lowest
    # trainable tensor to the output, and the label head's, which a step on cached features runs
    backward_fraction: float = 1.0
    head_fraction: float = 0.0
    estimator: str = "central"  # the two-point estimate of every step (zo/step.py)
    optimizer: str = "mezo"  # the clients' local ZO optimizer, from zero state every round (FEDERATED_OPTIMIZERS)
    momentum: float = 0.9  # zo-sgd-momentum
    beta1: float = 0.9  # zo-adam
    beta2: float = 0.999
    logit_adjust: float = 0.0  # the clients' training loss adds this x log of their own label frequencies
    feature_cache: int = 0  # examples a client runs through the frozen model once a round, then steps on (0: off)
    scalar_bits: int = 32  # the precision the clients' scalars travel with (16: float16, half the bytes)

    def local_optimizer(self) -> MeZO | ZOSGDMomentum | ZOAdam:
        """The clients' local optimizer, which the server replays to rebuild a client's steps."""
        if self.optimizer not in FEDERATED_OPTIMIZERS:
            raise ValueError(f"federated clients run {', '.join(FEDERATED_OPTIMIZERS)}, not {self.optimizer!r}")
        return make_optimizer(self.optimizer, **hyperparameters(self.optimizer, self))

    @property
    def linear_steps(self) -> bool:
        """Whether a client's update is the sum of its steps' scaled directions (MeZO), so that the server can
        pool clients' terms; a stateful optimizer's update must be replayed client by client."""
        return self.optimizer == "mezo"

    def to_config(self) -> dict[str, float | int | str]:
        """The round plan as the downlink's config entries."""
        return asdict(self)

    @classmethod
    def from_config(cls, config: dict) -> LocalTraining:
        missing = [f.name for f in fields(cls) if f.name not in config]
        if missing:
            raise ValueError(f"round config lacks {', '.join(missing)}")
        casts = {"int": int, "float": float, "str": str}
        try:
            return cls(**{f.name: casts[f.type](config[f.name]) for f in fields(cls)})
        except (TypeError, ValueError) as err:
            raise ValueError(f"round config has a value of the wrong type: {err}") from None


@dataclass(frozen=True)
class FederationPlan:
    """What stays fixed for a whole run: the method the rounds run and how each round is asked of the clients."""

    method: str
    num_clients: int
    clients_per_round: int
    local_steps: int
    lr: float
    eps: float
    run_seed: int = 0
    queries: int = 1
    batch_size: int = 16
    noise: str = "rademacher"
    pool_size: int = 0
    sampling: BlockSampling = field(default_factory=BlockSampling)
    first_order_optimizer: str = "adamw"
    pass_fraction: float = 1.0
    backward_fraction: float = 1.0
    head_fraction: float = 0.0
    estimator: str = "central"
    optimizer: str = "mezo"
    momentum: float = 0.9
    beta1: float = 0.9
    beta2: float = 0.999
    logit_adjust: float = 0.0
    feature_cache: int = 0
    scalar_bits: int = 32
    # each trainable tensor's share of a full pass from its block up (zo/prefix.py `tensor_pass_shares`): what the
    # server charges a step that moved it and nothing below it (fl/cost.py); (): every step moves every tensor
    tensor_shares: tuple[float, ...] = ()

    def round(self, round_id: int) -> LocalTraining:
        """The round plan before the method adds its own settings (`Method.round_plan`): the server role's
        `round_plan` is what the clients receive."""
        shared = {f.name: getattr(self, f.name) for f in fields(LocalTraining) if hasattr(self, f.name)}
        return LocalTraining(**{**shared, "round_id": round_id})
