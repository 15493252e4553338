"""What a federated method is: one object that both sides of a round consult.

A method says how a client draws its step seeds, which perturbation each step uses, what its uplink carries
and what a round costs it, and, on the server, what each client's downlink carries besides the weights, how
its uplink turns back into an update (`directions`), and what the server learns from a round (`observe`).
Client and server call the same `perturbations`, so the server's rebuild is the client's update.

Methods are registered by name (methods/__init__.py); the config's choices, the benchmarks' lists and the
server optimizer defaults come from the registry.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import numpy as np
import torch

from zofed.fl.client import ClientContext, run_zo_client
from zofed.fl.cost import round_passes
from zofed.fl.personal import BlockSampling
from zofed.fl.plan import FederationPlan, LocalTraining
from zofed.fl.pooled import PooledTerms, RoundSteps, StepBlocks, pool_steps
from zofed.fl.protocol import ClientUpdate, step_seeds
from zofed.fl.server_opt import ServerOptimizer
from zofed.fl.updates import Directions, StepSeeds
from zofed.zo.noise import derive_seed
from zofed.zo.optim import OptState
from zofed.zo.perturb import Perturbation
from zofed.zo.step import StepRecord


class ServerView(Protocol):
    """What a method's server hooks (`init_state`, `server_state`, `observe`) read of the server: fl/roles.py's
    `ServerRole`, which calls them. The roles sit above the methods, so the methods name only this."""

    plan: FederationPlan
    tensors: list[torch.Tensor]  # the global trainable tensors
    masks: list[torch.Tensor | None] | None
    optimizer: ServerOptimizer
    opt_state: OptState
    method_state: Any  # what the method's `init_state` returned

    def round_steps(self, accepted: Sequence[ClientUpdate], sent: dict[int, np.ndarray]) -> RoundSteps: ...


@dataclass(frozen=True)
class ServerDefault:
    """The server optimizer a method runs when the config leaves it unset."""

    name: str = "sgd"
    lr: float = 1.0
    granularity: str = "coordinate"
    relative: bool = False


def step_records(update: ClientUpdate) -> list[StepRecord]:
    """A seed-and-scalar uplink's local steps as records a local optimizer can replay."""
    seeds = step_seeds(update)
    return [StepRecord(step=t, seed=int(seeds[t]), grads=tuple(float(g) for g in update.grads[t]), loss=math.nan)
            for t in range(update.grads.shape[0])]


def private_seeds(local: LocalTraining, owner: int) -> StepSeeds:
    """Seeds derived from (run seed, round, owner), named on the wire by their base seed."""
    base = derive_seed(local.run_seed, local.round_id, owner)
    return StepSeeds([derive_seed(base, t) for t in range(local.local_steps)], base, False)


class Method:
    """A ZO method with MeZO local steps and a seed-and-scalar uplink; subclasses change what differs."""

    name: ClassVar[str]
    summary: ClassVar[str]  # one line for `zofed methods` and docs
    first_order: ClassVar[bool] = False  # clients back-propagate
    dense_uplink: ClassVar[bool] = False  # the uplink carries the dense update, not seeds and scalars
    uses_sampling: ClassVar[bool] = False  # reads federation.sampling.* (zofed's personalized sampling)
    # the server needs only the example-weighted mean of the round's scalars (shared seeds, no per-client state):
    # what secure aggregation lets it see (flower/secure.py)
    sum_suffices: ClassVar[bool] = False
    server_default: ClassVar[ServerDefault] = ServerDefault()

    # --- the run ---------------------------------------------------------------------------------------
    def default_estimator(self, queries: int) -> str:
        """The two-point estimate its clients use when `zo.estimator` is unset: the published algorithms take
        the central difference."""
        return "central"

    def round_method(self, personalize: bool) -> str:
        """The method the rounds run (zofed without personalization runs zo-seeds' steps)."""
        return self.name

    def round_plan(self, local: LocalTraining, sampling: BlockSampling) -> LocalTraining:
        """The round plan sent to the clients (a method may add its own settings)."""
        return local

    def forward_passes(self, local: LocalTraining) -> float:
        """One client's compute in a round, in forward passes of the full model, by the rule every method shares
        (fl/cost.py): ZO steps with or without a cached prefix, back-propagated steps, steps on cached features.
        The most a round can cost: a method whose steps move some tensors may charge less (`client_passes`)."""
        return round_passes(local, self.first_order)

    def least_passes(self, local: LocalTraining, tensor_shares: Sequence[float]) -> float:
        """The least a client's round can cost (`client_passes` at its cheapest draws): a budget's most rounds."""
        return self.forward_passes(local)

    def client_passes(self, server: ServerView, local: LocalTraining, client_id: int, sent: np.ndarray | None
                      ) -> float:
        """What `client_id`'s round this round cost, by the same rule, from what the server knows of it (its seeds
        and the state it was sent): every step moves every trainable tensor unless the method says otherwise."""
        return self.forward_passes(local)

    def shares_seeds(self, shared_seeds_setting: bool) -> bool:
        """Whether a round's clients step on the same seeds (what the `seed-median` aggregator needs); zofed's
        clients do when `federation.sampling.shared_seeds` says so."""
        return False

    # --- both sides --------------------------------------------------------------------------------------
    def step_seeds(self, local: LocalTraining, client_id: int) -> StepSeeds:
        return private_seeds(local, client_id)

    def perturbations(self, local: LocalTraining, like: Sequence[torch.Tensor],
                      masks: Sequence[torch.Tensor | None] | None, seeds: Sequence[int],
                      server_state: np.ndarray) -> list[Perturbation]:
        """The perturbation of each step, from the seeds and the downlink's server state (same on both sides)."""
        base = Perturbation(kind=local.noise, masks=masks)
        return [base] * len(seeds)

    # --- the client --------------------------------------------------------------------------------------
    def train(self, ctx: ClientContext, start: Sequence[torch.Tensor], client_id: int, indices: np.ndarray,
              local: LocalTraining, server_state: np.ndarray, **options: Any
              ) -> tuple[ClientUpdate, list[torch.Tensor]]:
        """Local training from the global weights; returns the uplink and the client's final tensors."""
        seeds = self.step_seeds(local, client_id)
        perts = self.perturbations(local, start, ctx.trainable.masks, seeds.seeds, server_state)
        return run_zo_client(ctx, start, client_id, indices, local, seeds, perts, dense=self.dense_uplink)

    # --- the server --------------------------------------------------------------------------------------
    def server_state(self, server: ServerView, local: LocalTraining, client_id: int) -> np.ndarray | None:
        """What `client_id`'s downlink carries besides the weights (None: nothing)."""
        return None

    def directions(self, update: ClientUpdate, local: LocalTraining, like: Sequence[torch.Tensor],
                   masks: Sequence[torch.Tensor | None] | None, sent_state: np.ndarray) -> list[Directions]:
        """The client's update as perturbations and (seed, coefficient) terms: sum_t -lr g_t u_t. Steps that
        share a poolable perturbation (equal `pool_key()`) share one group, so an aggregator can merge their seeds."""
        records = step_records(update)
        perts = self.perturbations(local, like, masks, [r.seed for r in records], sent_state)
        groups: list[Directions] = []
        for record, pert in zip(records, perts, strict=True):
            terms = [(seed, -local.lr * g) for seed, g in record.grad_terms()]
            if groups and pert.pool_key() is not None and groups[-1][0].pool_key() == pert.pool_key():
                groups[-1][1].extend(terms)
            else:
                groups.append((pert, terms))
        return groups

    def step_blocks(self, local: LocalTraining, like: Sequence[torch.Tensor],
                    masks: Sequence[torch.Tensor | None] | None, steps: RoundSteps) -> StepBlocks | None:
        """Every step of a round at once, as `perturbations` would give them one by one: the block of tensors each
        moved and its scale, under one perturbation without scales (pooled.py). None when the steps do not pool
        that way: the round then takes the general path, client by client."""
        if type(self).perturbations is not Method.perturbations:
            return None  # a method with its own perturbations must say how they pool
        return StepBlocks.every_tensor(Perturbation(kind=local.noise, masks=masks), len(like), steps)

    def pooled_terms(self, local: LocalTraining, steps: RoundSteps, like: Sequence[torch.Tensor],
                     masks: Sequence[torch.Tensor | None] | None) -> PooledTerms | None:
        """The round's weighted sum of updates as one coefficient per (seed, tensor), computed on arrays for all
        clients at once: bit for bit what pooling their `directions` gives (aggregate.py's `WeightedMean`). None
        when it does not apply: a stateful local optimizer, or steps that do not pool."""
        if not local.linear_steps:
            return None
        where = self.step_blocks(local, like, masks, steps)
        return None if where is None else pool_steps(steps, where, local.lr)

    def observe(self, server: ServerView, local: LocalTraining, accepted: Sequence[ClientUpdate],
                sent: dict[int, np.ndarray], delta: Sequence[torch.Tensor]) -> dict[str, Any]:
        """What the server learns from a round's accepted uplinks (`sent`: the server state each client was sent,
        `delta`: the aggregated update); returns extras for the server optimizer."""
        return {}

    def init_state(self, server: ServerView) -> Any:
        """The method's own server state (checkpointed with `state_tensors`); None when it keeps none."""
        return None
