"""zofed's own method: each client perturbs one block a step, drawn from its own distribution (personal.py),
and the server applies adaptive momentum to the rebuilt update, one second moment for the whole update (its
default server optimizer).

The downlink carries the client's block distribution pi (then, with `sampling.precondition`, the round's noise
shape p, and with a tilt the server's first moment); every step's perturbation is a function of its seed and that
state, so the server rebuilds exactly what the client did. The squared scalars the clients upload are the
server's probes of each block's gradient energy, from which it fits every client's next pi (`observe`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from zofed import streams
from zofed.fl.block_precondition import BlockPreconditioner, split_precondition
from zofed.fl.cost import round_passes
from zofed.fl.methods.base import Method, ServerDefault, ServerView, StepSeeds, private_seeds
from zofed.fl.personal import (
    BlockSampling,
    BlockStats,
    MomentumTilt,
    block_perturbation,
    block_sizes,
    check_distribution,
    client_distribution,
    draw_block_rows,
    draw_blocks,
    expected_update_square,
    global_energy,
    probe_energy,
    probe_energy_rows,
    stack_distributions,
    tensor_blocks,
)
from zofed.fl.plan import LocalTraining
from zofed.fl.pooled import RoundSteps, StepBlocks
from zofed.fl.protocol import ClientUpdate, step_seeds
from zofed.zo.perturb import Perturbation


@dataclass
class BlockState:
    """The server's view of the blocks: layout and sizes (fixed by the model), and the probed energies."""

    layout: np.ndarray  # each tensor's block
    tensor_sizes: np.ndarray  # coordinates each tensor can move
    sizes: np.ndarray  # coordinates each block can move
    numels: np.ndarray  # elements of each tensor
    stats: BlockStats
    # each block's share of a full pass from its lowest tensor up: what a step drawing it is charged with
    # (fl/cost.py); None when the plan has no tensor shares (every step charged the whole trainable part)
    shares: np.ndarray | None = None
    precondition: BlockPreconditioner | None = None  # the noise shape's second moment (sampling.precondition)

    def to_tensors(self) -> dict[str, torch.Tensor]:
        extra = self.precondition.to_tensors() if self.precondition is not None else {}
        return {**self.stats.to_tensors(), **extra}

    def load_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        self.stats = BlockStats.from_tensors(tensors)
        if self.precondition is not None:
            self.precondition.load_tensors(tensors)


def split_state(server_state: np.ndarray, local: LocalTraining, like: Sequence[torch.Tensor], num_blocks: int
                ) -> tuple[np.ndarray, list[torch.Tensor] | None, np.ndarray | None]:
    """A zofed downlink's state as (pi, the noise shape p per tensor or None, the tilt's momentum or None), its
    length checked against what the round plan says it holds."""
    numel = sum(t.numel() for t in like)
    expected = num_blocks + numel * (bool(local.precondition) + bool(local.tilt))
    if server_state.shape != (expected,):
        raise ValueError(f"a zofed downlink for this round carries {expected} values (pi over {num_blocks} blocks"
                         f"{', the noise shape' if local.precondition else ''}{', the momentum' if local.tilt else ''}"
                         f"), got {server_state.size}")
    pi, rest = server_state[:num_blocks], server_state[num_blocks:]
    check_distribution(pi, num_blocks)
    shape = split_precondition(rest[:numel], like) if local.precondition else None
    momentum = rest[numel:] if local.precondition else rest
    return pi, shape, momentum if local.tilt else None


def block_probes(update: ClientUpdate, pi: np.ndarray) -> tuple[list[int], list[float]]:
    """The blocks a client's steps drew and their energy estimates pi_b g^2 (mean over queries)."""
    blocks = draw_blocks(step_seeds(update), pi)
    return blocks, probe_energy(update.grads, pi, blocks).tolist()


def block_shares(tensor_shares: Sequence[float], layout: np.ndarray) -> np.ndarray | None:
    """Each block's share of a pass from its lowest tensor up (the largest of its tensors' shares); None without
    tensor shares."""
    if not tensor_shares:
        return None
    if len(tensor_shares) != len(layout):
        raise ValueError(f"{len(tensor_shares)} tensor shares for {len(layout)} trainable tensors")
    shares = np.zeros(int(layout.max()) + 1)
    np.maximum.at(shares, layout, np.asarray(tensor_shares, dtype=np.float64))
    return shares


def round_draws(steps: RoundSteps, num_blocks: int) -> tuple[np.ndarray, np.ndarray]:
    """Every client's pi (clients, blocks) and every step's drawn block (clients, steps), drawn once a round:
    the pooled rebuild and observe both need them."""
    key = f"zofed.draws.{num_blocks}"
    if key not in steps.memo:
        pis = stack_distributions(steps.states, num_blocks)
        steps.memo[key] = (pis, draw_block_rows(steps.seeds, pis))
    return steps.memo[key]


class Zofed(Method):
    name = "zofed"
    summary = ("one block a step, drawn from each client's own distribution; base seed and one scalar a step "
               "uploaded; adaptive momentum on the server, one second moment for the whole update")
    uses_sampling = True
    server_default = ServerDefault("adam", 1e-2, "global", relative=True)

    def default_estimator(self, queries: int) -> str:
        # Several queries a step share one centre pass, q + 1 passes instead of 2 q, so a budget buys more
        # steps. With one query both estimates cost two passes, and the central one has no O(eps) bias.
        return "forward" if queries > 1 else "central"

    def round_method(self, personalize: bool) -> str:
        return self.name if personalize else "zo-seeds"  # without personalization every step is dense

    def round_plan(self, local: LocalTraining, sampling: BlockSampling) -> LocalTraining:
        return replace(local, tilt=sampling.tilt, blocks=sampling.blocks, shared_seeds=int(sampling.shared_seeds),
                       precondition=int(sampling.precondition))

    def shares_seeds(self, shared_seeds_setting: bool) -> bool:
        return shared_seeds_setting

    def step_seeds(self, local: LocalTraining, client_id: int) -> StepSeeds:
        return private_seeds(local, streams.SHARED_OWNER if local.shared_seeds else client_id)

    def perturbations(self, local: LocalTraining, like: Sequence[torch.Tensor],
                      masks: Sequence[torch.Tensor | None] | None, seeds: Sequence[int],
                      server_state: np.ndarray) -> list[Perturbation]:
        layout = tensor_blocks(like, local.blocks)
        pi, shape, momentum = split_state(server_state, local, like, int(layout.max()) + 1)
        tilt = MomentumTilt.from_flat(momentum, like, local.tilt) if momentum is not None else None
        return [block_perturbation(b, pi, local.noise, masks, tilt, layout, shape) for b in draw_blocks(seeds, pi)]

    def step_blocks(self, local: LocalTraining, like: Sequence[torch.Tensor],
                    masks: Sequence[torch.Tensor | None] | None, steps: RoundSteps) -> StepBlocks | None:
        """Each step's drawn block and scale 1/sqrt(pi_b), for all clients at once (`perturbations`' draws)."""
        if local.tilt:
            return None  # a tilted step adds the momentum sent with its own weight: rebuilt client by client
        layout = tensor_blocks(like, local.blocks)
        num_blocks = int(layout.max()) + 1
        shape = None
        if local.precondition:  # every client is sent the round's one p: pooled under it (else client by client)
            _, shape, _ = split_state(steps.states[0], local, like, num_blocks)
            if any(not np.array_equal(state[num_blocks:], steps.states[0][num_blocks:]) for state in steps.states):
                return None
        pis, blocks = round_draws(steps, num_blocks)
        scales = 1.0 / np.sqrt(np.take_along_axis(pis, blocks, axis=1).astype(np.float64))
        return StepBlocks(Perturbation(kind=local.noise, masks=masks, precondition=shape), layout, blocks, scales)

    def init_state(self, server: ServerView) -> BlockState:
        sampling = server.plan.sampling
        if sampling.tilt and "m" not in server.opt_state.buffers:
            raise ValueError("a momentum tilt needs a server optimizer with momentum (adam, yogi or amsgrad)")
        layout = tensor_blocks(server.tensors, sampling.blocks)
        sizes = block_sizes(server.tensors, server.masks, layout)
        return BlockState(layout, block_sizes(server.tensors, server.masks), sizes,
                          np.asarray([t.numel() for t in server.tensors], dtype=np.float64),
                          BlockStats.zeros(server.plan.num_clients, len(sizes)),
                          block_shares(server.plan.tensor_shares, layout),
                          BlockPreconditioner.start(server.tensors, layout) if sampling.precondition else None)

    def least_passes(self, local: LocalTraining, tensor_shares: Sequence[float]) -> float:
        if not tensor_shares:
            return self.forward_passes(local)
        return round_passes(local, False, [min(tensor_shares)] * local.local_steps)

    def client_passes(self, server: ServerView, local: LocalTraining, client_id: int, sent: np.ndarray | None
                      ) -> float:
        """Each step charged from the lowest tensor of the block it drew (a tilt leans within that block too)."""
        state: BlockState = server.method_state
        if state.shares is None or sent is None:
            return self.forward_passes(local)
        blocks = draw_blocks(self.step_seeds(local, client_id).seeds, sent[:len(state.sizes)])
        return round_passes(local, False, state.shares[blocks].tolist())

    def server_state(self, server: ServerView, local: LocalTraining, client_id: int) -> np.ndarray:
        """The client's pi, then the round's noise shape p (`sampling.precondition`) and the server's first moment
        (a tilt)."""
        state: BlockState = server.method_state
        parts = [client_distribution(state.stats, client_id, state.sizes, server.plan.sampling, state.shares)]
        if local.precondition:
            parts.append(state.precondition.for_round(local.round_id))
        if local.tilt:
            parts.append(torch.cat(server.opt_state.buffers["m"]).cpu().numpy().astype(np.float32))
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def observe(self, server: ServerView, local: LocalTraining, accepted: Sequence[ClientUpdate],
                sent: dict[int, np.ndarray], delta: Sequence[torch.Tensor]) -> dict[str, Any]:
        """Files each step's probe under its client and block; with a warm-started server optimizer, returns
        each tensor's expected mean square of this round's update."""
        state: BlockState = server.method_state
        if not accepted:
            return {}
        if state.precondition is not None:
            state.precondition.observe(delta, local.lr, local.local_steps)
        # all clients at once (the same draws, energies and sums as block_probes and record, client by client)
        steps = server.round_steps(accepted, sent)
        pis, blocks = round_draws(steps, len(state.sizes))
        state.stats.record_round(steps.client_ids, blocks, probe_energy_rows(steps.grads, pis, blocks))
        if "expected_square" not in server.optimizer.extras:
            return {}
        pi_b = np.take_along_axis(pis, blocks, axis=1)
        drawn = [(w, p, b) for w, row_p, row_b in zip(steps.weights.tolist(), pi_b.tolist(), blocks.tolist(),
                                                       strict=True) for p, b in zip(row_p, row_b, strict=True)]
        energy = global_energy(state.stats, state.sizes, server.plan.sampling)
        return {"expected_square": expected_update_square(energy, state.tensor_sizes, state.numels, local.lr,
                                                          local.queries, drawn, state.layout)}
