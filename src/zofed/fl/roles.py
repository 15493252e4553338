"""The server and client roles every backend drives: bytes in, bytes out.

A round, whatever carries the messages (the in-process engine, Flower):

    server.plan(r) -> plan;  server.sample(r) -> client ids
    for each client c:  server.downlink(plan, c) -> bytes  ->  client.train(bytes, c, its examples) -> bytes
                        server.receive(inbox, plan, c, bytes)      (rejects a bad uplink with a reason)
    server.aggregate(plan, inbox) -> round record                  (rebuild, mean, server optimizer, stats)

The server's whole state (global tensors, optimizer state, block statistics) is explicit and saved with
`state_tensors()`, so a run restored from it continues bit for bit.
"""

from __future__ import annotations

import resource
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from zofed.fl.client import ClientContext, LocalTraining, load_tensors_, run_client
from zofed.fl.first_order import FIRST_ORDER_METHODS, run_first_order_client
from zofed.fl.methods import personalized
from zofed.fl.personal import (
    BlockSampling,
    BlockStats,
    MomentumTilt,
    block_sizes,
    check_distribution,
    client_distribution,
    expected_update_square,
    global_energy,
    tensor_blocks,
)
from zofed.fl.protocol import ServerBroadcast, decode, encode
from zofed.fl.server import RoundInbox, block_probes, broadcast, mean_update, receive, unflatten
from zofed.fl.server_opt import ServerOptimizer
from zofed.zo.optim import OptState
from zofed.zo.perturb import Perturbation


@dataclass(frozen=True)
class FederationPlan:
    """What stays fixed for a whole run: the method and how each round is asked of the clients."""

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

    def round(self, round_id: int) -> LocalTraining:
        return LocalTraining(self.method, self.run_seed, round_id, self.local_steps, self.lr, self.eps,
                             self.queries, self.batch_size, self.noise, self.pool_size)


def round_record(plan: LocalTraining, sampled: list[int], inbox: RoundInbox, bytes_down: list[int],
                 losses: list[float], seconds: float) -> dict:
    """The metrics every backend writes for a round (backends may add their own fields)."""
    return {"round": plan.round_id + 1, "clients": sampled, "accepted": len(inbox.accepted),
            "rejected": [{"client": c, "reason": r} for c, r in inbox.rejected],
            "bytes_up_per_client": float(np.mean(inbox.bytes_up)) if inbox.bytes_up else 0.0,
            "bytes_down_per_client": float(np.mean(bytes_down)),
            "train_loss": float(np.mean(losses)) if losses else float("nan"),
            "forward_passes": 2 * plan.queries * plan.local_steps * len(sampled) * (plan.round_id + 1),
            "round_seconds": round(seconds, 3),
            "peak_rss_mib": peak_rss_mib()}


def peak_rss_mib() -> float:
    """This process's peak resident memory so far (Linux reports KiB)."""
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def sample_clients(run_seed: int, round_id: int, num_clients: int, per_round: int) -> list[int]:
    rng = np.random.default_rng([run_seed, round_id, 11])
    return sorted(int(c) for c in rng.choice(num_clients, size=min(per_round, num_clients), replace=False))


class ServerRole:
    """The server's side of every round: plans it, writes each sampled client's downlink, validates the
    uplinks, rebuilds and aggregates them, and keeps the block statistics that shape the clients' sampling."""

    def __init__(self, plan: FederationPlan, tensors: Sequence[torch.Tensor],
                 masks: Sequence[torch.Tensor | None] | None = None, optimizer: ServerOptimizer | None = None,
                 sampling: BlockSampling | None = None) -> None:
        self.plan = plan
        self.tensors = [t.detach().clone() for t in tensors]
        self.masks = masks
        self.optimizer = optimizer or ServerOptimizer()
        self.opt_state = self.optimizer.init(self.tensors)
        self.sampling = sampling or BlockSampling()
        self.layout = tensor_blocks(self.tensors, self.sampling.blocks)  # each tensor's block
        self.tensor_sizes = block_sizes(self.tensors, masks)
        self.sizes = block_sizes(self.tensors, masks, self.layout)
        self.numels = np.asarray([t.numel() for t in self.tensors], dtype=np.float64)
        self.stats = BlockStats.zeros(plan.num_clients, len(self.sizes))
        self.num_trainable = sum(t.numel() for t in self.tensors)
        if self.sampling.tilt and "m" not in self.opt_state.buffers:
            raise ValueError(f"a momentum tilt needs a server optimizer with momentum, not {self.optimizer.name}")
        self._sent_pi: dict[int, np.ndarray] = {}
        self._sent_momentum: np.ndarray | None = None

    def round_plan(self, round_id: int) -> LocalTraining:
        plan = self.plan.round(round_id)
        if not personalized(plan.method):
            return plan
        return replace(plan, tilt=self.sampling.tilt, blocks=self.sampling.blocks,
                       shared_seeds=int(self.sampling.shared_seeds))

    def sample(self, round_id: int) -> list[int]:
        return sample_clients(self.plan.run_seed, round_id, self.plan.num_clients, self.plan.clients_per_round)

    def downlink(self, plan: LocalTraining, client_id: int) -> bytes:
        """The encoded message that starts `client_id`'s round: weights, the plan, its block distribution
        (and, with a tilt, the server's first moment after it)."""
        state = None
        if personalized(plan.method):
            pi = client_distribution(self.stats, client_id, self.sizes, self.sampling)
            self._sent_pi[client_id] = pi
            state = pi
            if plan.tilt:
                self._sent_momentum = torch.cat(self.opt_state.buffers["m"]).numpy().astype(np.float32)
                state = np.concatenate([pi, self._sent_momentum])
        return encode(broadcast(plan.round_id, self.tensors, plan.to_config(), state))

    def receive(self, inbox: RoundInbox, plan: LocalTraining, client_id: int, data: bytes) -> None:
        receive(inbox, data, plan.round_id, client_id, plan, self.num_trainable)

    def aggregate(self, plan: LocalTraining, inbox: RoundInbox) -> None:
        """Rebuild and average the accepted updates, apply the server optimizer, record the block probes.
        A round with no accepted update keeps the model."""
        if not inbox.accepted:
            self._sent_pi.clear()
            self._sent_momentum = None
            return
        perturbation = Perturbation(kind=plan.noise, masks=self.masks)
        pis = {u.client_id: self._sent_pi[u.client_id] for u in inbox.accepted if u.client_id in self._sent_pi}
        tilt = None
        if plan.tilt and self._sent_momentum is not None:
            tilt = MomentumTilt.from_flat(self._sent_momentum, self.tensors, plan.tilt)
        delta = mean_update(self.tensors, inbox.accepted, plan, perturbation, pis, tilt)
        expected_square = None
        if personalized(plan.method):
            probes = {u.client_id: block_probes(u, plan, pis[u.client_id]) for u in inbox.accepted}
            for client_id, (blocks, energies) in probes.items():
                self.stats.record(client_id, blocks, energies)
            if self.optimizer.warm_start:  # the round's own probes are part of the energies it is judged by
                total = sum(u.num_examples for u in inbox.accepted)
                steps = [(u.num_examples / total, pis[u.client_id][b], b)
                         for u in inbox.accepted for b in probes[u.client_id][0]]
                expected_square = expected_update_square(global_energy(self.stats, self.sizes, self.sampling),
                                                         self.tensor_sizes, self.numels, plan.lr, plan.queries,
                                                         steps, self.layout)
        self.opt_state = self.optimizer.apply(self.tensors, self.opt_state, delta, expected_square)
        self._sent_pi.clear()
        self._sent_momentum = None

    def state_tensors(self) -> dict[str, dict[str, torch.Tensor]]:
        """The server's state besides the global tensors, as checkpoint files of named tensors."""
        return {"server_optimizer": self.opt_state.to_tensors(), "server_blocks": self.stats.to_tensors()}

    def load_state(self, tensors: Sequence[torch.Tensor], state: dict[str, dict[str, torch.Tensor]]) -> None:
        self.tensors = [t.detach().clone() for t in tensors]
        self.opt_state = OptState.from_tensors(state["server_optimizer"])
        self.stats = BlockStats.from_tensors(state["server_blocks"])


class ClientRole:
    """Turns a downlink into an uplink: load the weights, train on this client's examples, report."""

    def __init__(self, ctx: ClientContext, first_order_optimizer: str = "adamw") -> None:
        self.ctx = ctx
        self.first_order_optimizer = first_order_optimizer

    def train(self, downlink: bytes, client_id: int, indices: np.ndarray, round_id: int | None = None) -> bytes:
        message = decode(downlink, expect_round=round_id, max_bytes=len(downlink))
        if not isinstance(message, ServerBroadcast) or message.weights is None:
            raise ValueError("a client round starts from a weights downlink")
        plan = LocalTraining.from_config(message.config)
        like = self.ctx.trainable.tensors()
        if message.weights.size != sum(t.numel() for t in like):
            raise ValueError(f"downlink carries {message.weights.size} weights, this model has "
                             f"{sum(t.numel() for t in like)} trainable values")
        start = unflatten(message.weights, like)
        if plan.method in FIRST_ORDER_METHODS:
            update, _ = run_first_order_client(self.ctx, start, client_id, indices, plan, self.first_order_optimizer)
        else:
            pi, tilt = None, None
            if personalized(plan.method):
                num_blocks = int(tensor_blocks(start, plan.blocks).max()) + 1
                pi = message.server_state[:num_blocks]
                check_distribution(pi, num_blocks)
                if plan.tilt:
                    tilt = MomentumTilt.from_flat(message.server_state[num_blocks:], start, plan.tilt)
            update, _ = run_client(self.ctx, start, client_id, indices, plan, pi, tilt)
        return encode(update)

    def load_global(self, tensors: Sequence[torch.Tensor]) -> None:
        load_tensors_(self.ctx.trainable.tensors(), tensors)
