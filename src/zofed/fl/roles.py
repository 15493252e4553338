"""The server and client roles every backend drives: bytes in, bytes out (rounds.py runs a round with them).

    server.round_plan(r) -> local;  server.sample(r) -> client ids
    for each client c:  server.downlink(local, c) -> bytes  ->  client.train(bytes, c, its examples) -> bytes
                        server.receive(inbox, local, c, bytes)    (rejects a bad uplink with a reason)
    server.aggregate(local, inbox)                               (rebuild, aggregate, server optimizer)

What differs between methods is asked of the method object (fl/methods/); how the clients' updates combine, of
the aggregator (aggregate.py); how the result moves the model, of the server optimizer (server_opt.py). The
server's whole state (global tensors, optimizer, aggregator and method state) is explicit and saved with
`state_tensors()`, so a run restored from it continues bit for bit.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, NamedTuple

import numpy as np
import torch

from zofed import streams
from zofed.fl.aggregate import Contribution, WeightedMean, clip_update
from zofed.fl.attacks import Attack
from zofed.fl.client import ClientContext, load_tensors_
from zofed.fl.methods import get_method
from zofed.fl.plan import FederationPlan, LocalTraining
from zofed.fl.pooled import PooledTerms, RoundSteps
from zofed.fl.privacy import add_noise, client_noise, new_secret, server_noise
from zofed.fl.protocol import ClientUpdate, ServerBroadcast, decode, encode
from zofed.fl.server import ClientSteps, RoundInbox, broadcast, client_steps, rebuild_client_update, receive, unflatten
from zofed.fl.server_opt import ServerOptimizer, make_server_optimizer, movable_values
from zofed.zo.optim import OptState


class Screen(NamedTuple):
    """How the server scores each accepted update (run/screening.py), and the score above which it is refused."""

    # score(global tensors, each client's rebuilt update, each client's steps) -> one float per update
    score: Callable[[Sequence[torch.Tensor], list[list[torch.Tensor]], list[ClientSteps]], list[float]]
    threshold: float
    measure: str = "probe loss change"  # what the score is, in the rejection's reason


def sample_clients(run_seed: int, round_id: int, num_clients: int, per_round: int) -> list[int]:
    rng = streams.client_sampling(run_seed, round_id)
    return sorted(int(c) for c in rng.choice(num_clients, size=min(per_round, num_clients), replace=False))


class ServerRole:
    """The server's side of every round: plans it, writes each sampled client's downlink, validates the
    uplinks, rebuilds and aggregates them, applies the server optimizer and lets the method learn from them."""

    def __init__(self, plan: FederationPlan, tensors: Sequence[torch.Tensor],
                 masks: Sequence[torch.Tensor | None] | None = None, optimizer: ServerOptimizer | None = None,
                 aggregator: Any = None, clip_norm: float | None = None, screen: Screen | None = None,
                 dp_noise: float | None = None, dp_delta: float = 1e-5, dp_at_clients: bool = False,
                 average_from: int | None = None) -> None:
        self.plan = plan
        self.method = get_method(plan.method)
        self.tensors = [t.detach().to("cpu", copy=True) for t in tensors]  # the server computes on the CPU
        self.masks = None if masks is None else [None if m is None else m.cpu() for m in masks]
        self.movable = movable_values(self.tensors, self.masks)
        self.optimizer = optimizer or make_server_optimizer()
        self.opt_state = self.optimizer.init(self.tensors)
        self.aggregator = aggregator or WeightedMean()
        self.clip_norm = clip_norm  # each uplink's scalars (or dense update) clipped to this L2 norm; None: not
        self.last_clipped = 0  # uplinks the last aggregate clipped
        # (global tensors, each client's rebuilt update) -> each update's score, and the score above which an
        # update is refused: the run's probe-set loss change (screening.py); None: every valid uplink counts
        self.screen = screen
        self.dp_noise = dp_noise  # Gaussian noise of dp_noise x clip_norm on each clipped uplink's numbers (privacy.py)
        self.dp_delta = dp_delta  # the delta each round's epsilon is reported for
        self.dp_at_clients = dp_at_clients  # the clients clip and noise their own numbers: the server leaves them be
        if dp_noise is not None and clip_norm is None:
            raise ValueError("differential privacy needs a clip norm: the noise is sized by it")
        # central DP: the secret the noise is drawn from (privacy.py), kept in the checkpoint and nowhere else
        self.dp_secret = new_secret() if dp_noise is not None and not dp_at_clients else None
        # replaying a private run's log: its uplinks hold the numbers after clipping and noise, to take as they are
        self.replaying_noised_log = False
        self.last_screened = 0  # uplinks the last aggregate refused on their score
        self.received: list[tuple[int, bytes]] = []  # this round's accepted uplinks as they arrived (the run log)
        self.last_received: list[tuple[int, bytes]] = []  # ... and the last aggregated round's
        self.last_rejected: list[tuple[int | None, str]] = []  # the last aggregated round's rejections
        self.agg_state = self.aggregator.init()
        # Tail averaging: from round `average_from` on, the model evaluated and released is the mean of the server's
        # iterates since then; the clients still train from the last iterate. None: the last iterate is the model.
        self.average_from = average_from
        self.average: list[torch.Tensor] | None = None
        self.averaged = 0  # iterates in the average
        self.num_trainable = sum(t.numel() for t in self.tensors)
        self.method_state = self.method.init_state(self)
        self._sent: dict[int, np.ndarray] = {}  # each client's server state this round, for its rebuild
        self.spent = 0.0  # the clients' compute so far, in forward passes of the full model (fl/cost.py)
        self._steps: tuple[list, RoundSteps] | None = None  # the round as arrays, and the objects they are of
        self.last_seconds: dict[str, float] = {}  # the last aggregate's time by phase (rebuild, observe, optimizer)

    def round_plan(self, round_id: int) -> LocalTraining:
        """What the clients are asked this round: the run's plan for the round and the method's own settings."""
        return self.method.round_plan(self.plan.round(round_id), self.plan.sampling)

    def sample(self, round_id: int) -> list[int]:
        return sample_clients(self.plan.run_seed, round_id, self.plan.num_clients, self.plan.clients_per_round)

    def send_state(self, local: LocalTraining, client_id: int) -> np.ndarray:
        """The method's state for `client_id` this round, kept to rebuild the client's uplink with."""
        state = self.method.server_state(self, local, client_id)
        self._sent[client_id] = np.zeros(0, np.float32) if state is None else np.asarray(state, np.float32)
        return self._sent[client_id]

    def client_passes(self, local: LocalTraining, client_id: int) -> float:
        """What `client_id`'s round costs by the cost rule (fl/cost.py), from its seeds and the state it was sent:
        known before it trains, and whether it replies or not."""
        return self.method.client_passes(self, local, client_id, self._sent.get(client_id))

    def downlink(self, local: LocalTraining, client_id: int) -> bytes:
        """The encoded message that starts `client_id`'s round: weights, the round plan, the method's state."""
        return encode(broadcast(local.round_id, self.tensors, local.to_config(), self.send_state(local, client_id)))

    def receive(self, inbox: RoundInbox, local: LocalTraining, client_id: int, data: bytes) -> None:
        """Check one uplink against this round and the step seeds the method assigned `client_id` (server.py);
        a refused one is recorded in `inbox` with its reason."""
        accepted = len(inbox.accepted)
        dense = self.method.dense_uplink
        seeds = None if dense else self.method.step_seeds(local, client_id)
        receive(inbox, data, local.round_id, client_id, local, self.num_trainable, dense, seeds)
        if len(inbox.accepted) > accepted:
            self.received.append((client_id, bytes(data)))

    def contribution(self, update: ClientUpdate, local: LocalTraining) -> Contribution:
        """An accepted uplink as the aggregator takes it: dense, or the method's directions."""
        if update.dense is not None:
            return Contribution(update.client_id, update.num_examples, unflatten(update.dense, self.tensors), [])
        sent = self._sent.get(update.client_id, np.zeros(0, np.float32))
        if not local.linear_steps:  # a stateful local optimizer: replay this client's steps densely
            return Contribution(update.client_id, update.num_examples,
                                rebuild_client_update(self.method, self.tensors, update, local, self.masks, sent), [])
        return Contribution(update.client_id, update.num_examples, None,
                            self.method.directions(update, local, self.tensors, self.masks, sent))

    def client_update(self, update: ClientUpdate, local: LocalTraining) -> list[torch.Tensor]:
        """One accepted uplink's local update, rebuilt dense (from the state this round sent its client)."""
        return rebuild_client_update(self.method, self.tensors, update, local, self.masks,
                                     self._sent.get(update.client_id, np.zeros(0, np.float32)))

    def round_steps(self, accepted: Sequence[ClientUpdate], sent: dict[int, np.ndarray]) -> RoundSteps:
        """The round's seed-and-scalar uplinks as arrays, built once per `aggregate`: the pooled mean and the
        method's `observe` both read them."""
        # Keyed on each uplink object and the state it was sent, not on the list: clipping and screening replace
        # the list's items in place (a clipped uplink is a new object), and an inbox may still grow.
        key = [*accepted, *(sent.get(u.client_id) for u in accepted)]
        cached = self._steps
        if cached is None or len(cached[0]) != len(key) or any(a is not b for a, b in zip(cached[0], key, strict=True)):
            self._steps = cached = (key, RoundSteps.of(accepted, sent))
        return cached[1]

    def pooled_terms(self, local: LocalTraining, accepted: Sequence[ClientUpdate]) -> PooledTerms | None:
        """The round pooled per (seed, tensor) on arrays, when the aggregator takes it (`update_pooled`) and the
        method can (`Method.pooled_terms`); None: the general path, a `Contribution` per client."""
        if not accepted or self.method.dense_uplink or not hasattr(self.aggregator, "update_pooled"):
            return None  # (`receive` accepts dense uplinks only from a method that sends them)
        return self.method.pooled_terms(local, self.round_steps(accepted, self._sent), self.tensors, self.masks)

    def aggregate(self, local: LocalTraining, inbox: RoundInbox) -> None:
        """Aggregate the accepted updates, let the method learn from them, apply the server optimizer.
        A round with no accepted update keeps the model."""
        times = [time.perf_counter()]
        self.last_clipped = 0
        server_clips = self.clip_norm is not None and not self.dp_at_clients and not self.replaying_noised_log
        if server_clips:  # before anything reads the numbers
            clipped = [clip_update(u, self.clip_norm) for u in inbox.accepted]
            inbox.accepted[:] = [u for u, _ in clipped]
            self.last_clipped = sum(hit for _, hit in clipped)
        if server_clips and self.dp_secret is not None:  # after clipping, before anything reads them
            inbox.accepted[:] = [add_noise(u, self.dp_noise, self.clip_norm,
                                           server_noise(self.dp_secret, local.round_id, u.client_id))
                                 for u in inbox.accepted]
            self.received = [(u.client_id, encode(u)) for u in inbox.accepted]  # the log keeps the noised numbers
        self.last_screened = 0
        if self.screen is not None and inbox.accepted:
            self._screen(local, inbox)
        if inbox.accepted:
            pooled = self.pooled_terms(local, inbox.accepted)
            if pooled is not None:  # the round summed on arrays: no per-client objects (pooled.py)
                delta, self.agg_state = self.aggregator.update_pooled(self.tensors, pooled, self.agg_state)
            else:
                contributions = [self.contribution(u, local) for u in inbox.accepted]
                delta, self.agg_state = self.aggregator.update(self.tensors, contributions, self.agg_state)
            times.append(time.perf_counter())
            extras = self.method.observe(self, local, inbox.accepted, self._sent, delta)
            times.append(time.perf_counter())
            if self.movable is not None:
                extras["movable"] = self.movable
            self.opt_state = self.optimizer.apply(self.tensors, self.opt_state, delta, **extras)
            times.append(time.perf_counter())
        if self.average_from is not None and local.round_id >= self.average_from:
            self._add_to_average()
        self._sent.clear()
        self._steps = None
        self.last_received, self.received = self.received, []
        self.last_rejected = list(inbox.rejected)
        phases = ("rebuild", "observe", "optimizer")
        self.last_seconds = {p: b - a for p, a, b in zip(phases, times, times[1:], strict=False)}

    def _add_to_average(self) -> None:
        """Fold this round's iterate into the running mean of the averaged rounds."""
        self.averaged += 1
        if self.average is None:
            self.average = [t.clone() for t in self.tensors]
            return
        for a, t in zip(self.average, self.tensors, strict=True):
            a.add_(t - a, alpha=1.0 / self.averaged)

    def model_tensors(self) -> list[torch.Tensor]:
        """The model the run evaluates and releases: the tail average once it has begun, else the last iterate."""
        return self.average if self.average is not None else self.tensors

    def _screen(self, local: LocalTraining, inbox: RoundInbox) -> None:
        """Refuse the updates whose score is above the screen's threshold, as rejected uplinks with their score:
        nothing after this (the aggregator, the method's probes, the uplink log) sees them."""
        score, threshold, measure = self.screen
        updates = [self.contribution(u, local).rebuild(self.tensors) for u in inbox.accepted]
        steps = [client_steps(self.method, self.tensors, u, local, self.masks, self._sent.get(u.client_id))
                 for u in inbox.accepted]
        scores = score(self.tensors, updates, steps)
        keep = [s <= threshold for s in scores]
        for update, kept, s in zip(inbox.accepted, keep, scores, strict=True):
            if not kept:
                inbox.rejected.append((update.client_id, f"screened: {measure} {s:+.4g} > {threshold:g}"))
        inbox.accepted[:] = [u for u, k in zip(inbox.accepted, keep, strict=True) if k]
        self.received = [r for r, k in zip(self.received, keep, strict=True) if k]
        self.last_screened = keep.count(False)

    def state_tensors(self) -> dict[str, dict[str, torch.Tensor]]:
        """The server's state besides the global tensors, as checkpoint files of named tensors."""
        state = {"server_optimizer": self.opt_state.to_tensors()}
        if self.method_state is not None:
            state["method"] = self.method_state.to_tensors()
        if self.agg_state:  # an aggregator with memory across rounds keeps named tensors (the mean has none)
            state["aggregator"] = dict(self.agg_state)
        if self.average is not None:
            state["average"] = {"count": torch.tensor([self.averaged], dtype=torch.int64),
                                **{f"t.{i}": t.contiguous() for i, t in enumerate(self.average)}}
        if self.dp_secret is not None:
            state["privacy"] = {"secret": self.dp_secret}
        return state

    def load_state(self, tensors: Sequence[torch.Tensor], state: dict[str, dict[str, torch.Tensor]]) -> None:
        self.tensors = [t.detach().to("cpu", copy=True) for t in tensors]  # the server computes on the CPU
        self.opt_state = OptState.from_tensors(state["server_optimizer"])
        if self.method_state is not None:
            self.method_state.load_tensors(state["method"])
        self.agg_state = dict(state.get("aggregator", self.aggregator.init()))
        average = state.get("average")
        self.averaged = 0 if average is None else int(average["count"][0])
        self.average = None if average is None else [average[f"t.{i}"].clone() for i in range(len(self.tensors))]
        if self.dp_secret is not None and "privacy" in state:  # (a checkpoint from before the secret: a new one)
            self.dp_secret = state["privacy"]["secret"].clone()


class ClientRole:
    """Turns a downlink into an uplink: load the weights, train on this client's examples, report."""

    def __init__(self, ctx: ClientContext, first_order_optimizer: str = "adamw", attack: Attack | None = None,
                 num_classes: int | None = None, local_dp: tuple[float, float] | None = None) -> None:
        self.ctx = ctx
        self.first_order_optimizer = first_order_optimizer
        self.local_dp = local_dp  # (clip norm, noise multiplier): an honest client's own clipping and noise
        # an attacking client's view: the same model, and the data it trains on (label-flip: wrong labels)
        self.attack = attack
        self.attack_ctx = ctx if attack is None else replace(ctx, train=attack.data(ctx.train, num_classes or 0))
        self._last_uplinks: dict[int, bytes] = {}  # an attacker's last honest uplink (the stale attack re-sends it)

    def train(self, downlink: bytes, client_id: int, indices: np.ndarray, round_id: int | None = None) -> bytes:
        message = decode(downlink, expect_round=round_id, max_bytes=len(downlink))
        if not isinstance(message, ServerBroadcast):
            raise ValueError("a client round starts from a downlink")
        local = LocalTraining.from_config(message.config)
        like = self.ctx.trainable.tensors()
        if message.weights.size != sum(t.numel() for t in like):
            raise ValueError(f"downlink carries {message.weights.size} weights, this model has "
                             f"{sum(t.numel() for t in like)} trainable values")
        start = unflatten(message.weights, like)
        attacking = self.attack is not None and client_id in self.attack.clients
        ctx = self.attack_ctx if attacking else self.ctx
        update, _ = get_method(local.method).train(ctx, start, client_id, indices, local, message.server_state,
                                                   first_order_optimizer=self.first_order_optimizer)
        if not attacking:
            if self.local_dp is not None:  # local DP: the numbers leave the client clipped and noised
                clip_norm, noise = self.local_dp
                update = add_noise(clip_update(update, clip_norm)[0], noise, clip_norm, client_noise())
            return encode(update)
        if self.attack.kind == "stale":
            honest = encode(update)
            sent = self._last_uplinks.get(client_id, honest)
            self._last_uplinks[client_id] = honest
            return sent
        return encode(self.attack.tamper(update, local.round_id, client_id))

    def load_global(self, tensors: Sequence[torch.Tensor]) -> None:
        load_tensors_(self.ctx.trainable.tensors(), tensors)
