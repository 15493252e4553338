"""Personalized block sampling: each client perturbs one block per step, drawn from its own distribution.

A block is one trainable tensor, or with `blocks=K` one of K contiguous runs of tensors in model order (a
range of layers), balanced by size: fewer, larger blocks are each probed more often and moved less far by
one step. At step t a client draws block b with probability pi_b and perturbs it with
Rademacher noise scaled by 1/sqrt(pi_b) (every other block is left alone):

    z = u_b / sqrt(pi_b),   g = (L(x + eps z) - L(x - eps z)) / (2 eps),   x <- x - lr g z

Then E[z z^T] = I whatever pi is, so the step has MeZO's expected update, while its variance,
sum_b |grad_b|^2 n_b / pi_b, is smallest for pi_b proportional to sqrt(n_b) |grad_b| (Cauchy-Schwarz).
Clients with different data have different gradients, so each gets its own pi. The squared scalar of a
step estimates its block's gradient energy without bias, pi_b g^2 ~ |grad_b|^2, so the estimates come for
free from the scalars already uploaded.

The server keeps those sums per client and for the whole federation (the global estimate is every client's
prior) and sends each client its pi with the round's downlink: clients hold no state between rounds, the
uplink stays one scalar per step, and the server knows every client's distribution exactly.

Optionally (ZO-AdaMU-style shaping) each step's direction also leans towards the server's first moment m,
sent with the downlink: z = (u_b + w m_b / rms(m_b)) / sqrt(pi_b). The server replays with the m it sent.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from zofed import streams
from zofed.zo.perturb import Perturbation
from zofed.zo.reduce import rms as fixed_order_rms


@dataclass(frozen=True)
class BlockSampling:
    """Settings of the personalized distribution.

    mix: share of the size-proportional distribution kept in pi (bounds every importance weight 1/pi_b);
    prior_weight: how many probes the prior is worth when a client's own estimate of a block is shrunk to it.
    """

    mix: float = 0.3
    prior_weight: float = 2.0
    tilt: float = 0.0  # lean of each direction towards the server's first moment (0: off)
    blocks: int = 0  # how many blocks the trainable tensors are cut into (0: one block per tensor)
    shared_seeds: bool = False  # the round's clients share step seeds: one draw picks the same block for like pis
    cost_aware: bool = False  # divide each block's weight by the square root of its share of a pass (its cost)
    precondition: bool = False  # shape each block's noise by the federation's second moment (block_precondition.py)

    def __post_init__(self) -> None:
        if not 0 < self.mix <= 1:
            raise ValueError(f"block sampling mix must be in (0, 1], got {self.mix}")
        if self.prior_weight <= 0:
            raise ValueError(f"block sampling prior_weight must be positive, got {self.prior_weight}")
        if self.blocks < 0:
            raise ValueError(f"block sampling blocks must be 0 (one per tensor) or positive, got {self.blocks}")


@dataclass(frozen=True)
class MomentumTilt:
    """The server's first moment, per block, and how far each step's direction leans towards it."""

    buffers: list[torch.Tensor]  # flat, one per block
    weight: float

    @classmethod
    def from_flat(cls, flat: np.ndarray, like: Sequence[torch.Tensor], weight: float) -> MomentumTilt:
        values = torch.from_numpy(np.ascontiguousarray(flat, dtype=np.float32)).to(like[0].device)
        if values.numel() != sum(t.numel() for t in like):
            raise ValueError(f"momentum for the tilt has {values.numel()} values, the model "
                             f"{sum(t.numel() for t in like)} trainable values")
        if not torch.isfinite(values).all():
            raise ValueError("momentum for the tilt must be finite")
        return cls(list(torch.split(values, [t.numel() for t in like])), weight)

    def rms(self) -> list[float]:
        """Each block's RMS, the same bits on the client that draws the tilted noise and the server that replays it."""
        return [fixed_order_rms(b) for b in self.buffers]


def tensor_blocks(tensors: Sequence[torch.Tensor], blocks: int = 0) -> np.ndarray:
    """The block of each tensor: `blocks` contiguous runs in model order, cut where the running size crosses
    each K-th of the total (a tensor goes where its middle falls); 0 gives every tensor its own block.
    Client and server both derive it from the model's tensor sizes and the round's plan."""
    n = len(tensors)
    if blocks == 0 or blocks == n:
        return np.arange(n)
    if not 0 < blocks < n:
        raise ValueError(f"sampling blocks is {blocks}, but the model has {n} trainable tensors: "
                         f"choose 0 (one block per tensor) up to {n}")
    numels = np.asarray([t.numel() for t in tensors], dtype=np.float64)
    middles = np.cumsum(numels) - numels / 2
    raw = np.floor(blocks * middles / numels.sum()).astype(np.int64)
    return np.unique(raw, return_inverse=True)[1]  # renumbered 0.. in case a very large tensor spans two cuts


def block_sizes(tensors: Sequence[torch.Tensor], masks: Sequence[torch.Tensor | None] | None = None,
                layout: np.ndarray | None = None) -> np.ndarray:
    """Coordinates each block can move (a mask leaves only its True entries); per tensor without a layout."""
    sizes = np.asarray([int(m.count_nonzero()) if masks is not None and m is not None else t.numel()
                        for t, m in zip(tensors, masks if masks is not None else [None] * len(tensors), strict=True)],
                       dtype=np.float64)
    return sizes if layout is None else np.bincount(layout, weights=sizes)


@dataclass
class BlockStats:
    """Sums of probed block energies (pi_b g^2) and probe counts: per client and for the federation."""

    client_sums: np.ndarray  # float64 (clients, blocks)
    client_counts: np.ndarray  # float64 (clients, blocks)
    global_sums: np.ndarray  # float64 (blocks,)
    global_counts: np.ndarray  # float64 (blocks,)

    @classmethod
    def zeros(cls, num_clients: int, num_blocks: int) -> BlockStats:
        return cls(np.zeros((num_clients, num_blocks)), np.zeros((num_clients, num_blocks)),
                   np.zeros(num_blocks), np.zeros(num_blocks))

    def record(self, client_id: int, blocks: Sequence[int], energies: Sequence[float]) -> None:
        # np.add.at adds repeated blocks one after another, in order: the sums of a loop, in one call each
        blocks = np.asarray(blocks, dtype=np.int64)
        energies = np.asarray(energies, dtype=np.float64)
        if blocks.shape != energies.shape:
            raise ValueError(f"{blocks.size} probed blocks but {energies.size} energies")
        np.add.at(self.client_sums[client_id], blocks, energies)
        np.add.at(self.client_counts[client_id], blocks, 1.0)
        np.add.at(self.global_sums, blocks, energies)
        np.add.at(self.global_counts, blocks, 1.0)

    def record_round(self, client_ids: np.ndarray, blocks: np.ndarray, energies: np.ndarray) -> None:
        """`record` for a whole round at once: row c of `blocks` and `energies` (clients, steps) under client
        client_ids[c]. np.add.at adds in row-major order, so every sum gets its terms in `record`'s order."""
        blocks = np.asarray(blocks, dtype=np.int64)
        energies = np.asarray(energies, dtype=np.float64)
        if blocks.shape != energies.shape or blocks.shape[:1] != np.shape(client_ids):
            raise ValueError(f"probed blocks {blocks.shape}, energies {energies.shape}, clients {np.shape(client_ids)}")
        cells = (np.repeat(np.asarray(client_ids, dtype=np.int64), blocks.shape[1]), blocks.reshape(-1))
        np.add.at(self.client_sums, cells, energies.reshape(-1))
        np.add.at(self.client_counts, cells, 1.0)
        np.add.at(self.global_sums, blocks.reshape(-1), energies.reshape(-1))
        self.global_counts += np.bincount(blocks.reshape(-1), minlength=self.global_counts.size)  # whole numbers

    def to_tensors(self) -> dict[str, torch.Tensor]:
        return {k: torch.from_numpy(getattr(self, k).copy()) for k in
                ("client_sums", "client_counts", "global_sums", "global_counts")}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor]) -> BlockStats:
        return cls(*(tensors[k].numpy().astype(np.float64) for k in
                     ("client_sums", "client_counts", "global_sums", "global_counts")))


def global_energy(stats: BlockStats, sizes: np.ndarray, settings: BlockSampling) -> np.ndarray:
    """The federation's estimate of |grad_b|^2: probes shrunk towards a uniform gradient density."""
    probed = stats.global_counts > 0
    density = (stats.global_sums[probed] / stats.global_counts[probed]).sum() / sizes[probed].sum() \
        if probed.any() else 1.0
    w = settings.prior_weight
    return (w * density * sizes + stats.global_sums) / (w + stats.global_counts)


def expected_update_square(energy: np.ndarray, sizes: np.ndarray, numels: np.ndarray, lr: float, queries: int,
                           steps: Sequence[tuple[float, float, int]], layout: np.ndarray | None = None) -> np.ndarray:
    """Each tensor's expected mean of d^2 in a round's mean update, from its block's energy estimate |grad_b|^2.
    `energy` is per block, `sizes` (moving coordinates) and `numels` per tensor, `layout` the tensors' blocks.

    `steps` holds (client weight, pi_b, b) for every step of the round. A step on block b adds
    -lr w g u_b / sqrt(pi_b) with E[g^2] = |grad_b|^2 / pi_b, so it adds lr^2 w^2 |grad_b|^2 / pi_b^2 to each
    of the block's moving coordinates (divided by q when q queries each carry 1/q of the step); the
    directions are independent, so the squares add. This is the steps' noise: their coherent part, the
    gradient itself, is about 1/n_b of it and left out."""
    layout = np.arange(len(sizes)) if layout is None else layout
    total = np.zeros(len(energy))
    for weight, pi_b, b in steps:
        total[b] += (lr * weight) ** 2 / (float(pi_b) ** 2 * queries)
    return (total * energy)[layout] * sizes / numels


def client_distribution(stats: BlockStats, client_id: int, sizes: np.ndarray, settings: BlockSampling,
                        costs: np.ndarray | None = None) -> np.ndarray:
    """pi for one client: its own energies shrunk to the global ones, then the variance-optimal shape
    sqrt(n_b E_b), mixed with the size-proportional distribution. float32, as it travels on the wire.
    With `settings.cost_aware` and each block's cost (its share of a pass, `costs`) the shape is sqrt(n_b E_b /
    c_b), which minimizes the estimate's variance times the expected cost of a step: (sum_b n_b E_b / pi_b) x
    (sum_b pi_b c_b) is least there (Cauchy-Schwarz)."""
    w = settings.prior_weight
    energy = (w * global_energy(stats, sizes, settings) + stats.client_sums[client_id]) \
        / (w + stats.client_counts[client_id])
    if settings.cost_aware and costs is not None:
        energy = energy / costs
    shape = np.sqrt(sizes * np.maximum(energy, 0.0))
    if not np.isfinite(shape).all() or shape.sum() <= 0:
        shape = sizes.copy()
    pi = (1 - settings.mix) * shape / shape.sum() + settings.mix * sizes / sizes.sum()
    return (pi / pi.sum()).astype(np.float32)


def check_distribution(pi: np.ndarray, num_blocks: int) -> None:
    """A received pi (or a stack of them, one a row) must be a probability vector over exactly the model's blocks."""
    if pi.ndim not in (1, 2) or pi.shape[-1] != num_blocks:
        raise ValueError(f"block distribution has {pi.shape[-1] if pi.ndim else 1} entries, the model "
                         f"{num_blocks} blocks")
    if not np.isfinite(pi).all() or (pi < 0).any() or \
            (np.abs(pi.sum(axis=-1, dtype=np.float64) - 1.0) > 1e-4).any():
        raise ValueError("block distribution must be finite, non-negative and sum to 1")


def stack_distributions(states: Sequence[np.ndarray], num_blocks: int) -> np.ndarray:
    """The pis that head many clients' downlink states, one a row (float32), checked as `check_distribution`."""
    flat = np.concatenate(states)  # first: it reads every state once, so the lengths below are read warm
    lengths = np.fromiter(map(len, states), np.int64, len(states))
    if lengths.min() < num_blocks:  # the error one client's check would give
        check_distribution(states[int(lengths.argmin())][:num_blocks], num_blocks)
    if (lengths == lengths[0]).all():  # one concatenation, cheaper than stacking many rows
        pis = flat.reshape(len(states), -1)[:, :num_blocks]
    else:
        pis = np.stack([state[:num_blocks] for state in states])
    check_distribution(pis, num_blocks)
    return pis


@functools.lru_cache(maxsize=1 << 16)
def _block_uniform(step_seed: int) -> float:
    """The uniform number behind a step's block draw (cached: the server draws each step's block again, and
    clients that share a round's seeds all draw with the same number)."""
    return float(streams.block_draw(step_seed).random())


def draw_blocks(step_seeds: Sequence[int], pi: np.ndarray) -> list[int]:
    """The block each step perturbs: a deterministic function of (step seed, pi) that client and server share."""
    cdf = np.cumsum(pi, dtype=np.float64)
    targets = np.array([_block_uniform(int(s)) for s in step_seeds], dtype=np.float64) * cdf[-1]
    return np.minimum(np.searchsorted(cdf, targets, side="right"), len(pi) - 1).tolist()


DRAW_CELLS = 1 << 22  # (client, step, block) comparisons made at once by draw_block_rows (4 MB of bools)


def cdf_rows(pis: np.ndarray) -> np.ndarray:
    """np.cumsum(pi, dtype=float64) of every row: the same sequential float64 sums (torch's CPU cumsum adds along a
    row in order, as numpy's does, and is several times faster across many rows)."""
    return torch.from_numpy(pis.astype(np.float64)).cumsum(dim=1).numpy()


def draw_block_rows(step_seeds: np.ndarray, pis: np.ndarray) -> np.ndarray:
    """`draw_blocks` for many clients at once: row c is draw_blocks(step_seeds[c], pis[c]), the same numbers. Each
    distinct seed's uniform is drawn once (clients that share seeds share them). searchsorted(cdf, x, "right") is
    the count of cdf entries <= x: a row's cdf never decreases, so that is the first entry above x, found by
    exact comparisons (or all of them, when none is above: the last block, as draw_blocks clips it)."""
    unique, inverse = np.unique(step_seeds, return_inverse=True)
    uniforms = np.array([_block_uniform(s) for s in unique.tolist()], dtype=np.float64)
    cdf = cdf_rows(pis)
    targets = uniforms[inverse.reshape(step_seeds.shape)] * cdf[:, -1:]
    blocks = np.empty(step_seeds.shape, dtype=np.int64)
    rows = max(1, DRAW_CELLS // max(1, targets.shape[1] * cdf.shape[1]))
    for first in range(0, len(cdf), rows):
        part = slice(first, first + rows)
        blocks[part] = np.argmax(cdf[part, None, :] > targets[part, :, None], axis=2)
    blocks[cdf[:, -1:] <= targets] = pis.shape[1] - 1
    return blocks


def draw_block(step_seed: int, pi: np.ndarray) -> int:
    """The block one step perturbs (`draw_blocks` for one seed)."""
    return draw_blocks([step_seed], pi)[0]


def block_perturbation(block: int, pi: np.ndarray, kind: str = "rademacher",
                       masks: Sequence[torch.Tensor | None] | None = None,
                       tilt: MomentumTilt | None = None, layout: np.ndarray | None = None,
                       precondition: Sequence[torch.Tensor] | None = None) -> Perturbation:
    """The perturbation of a step that drew `block`: that block's noise scaled by 1/sqrt(pi_b) (and per coordinate
    by `precondition`, flat per tensor), every other block left alone. `layout` maps each tensor to its block (None:
    one block per tensor)."""
    layout = np.arange(len(pi)) if layout is None else layout
    scale = float(1.0 / np.sqrt(np.float64(pi[block])))
    scales = np.where(layout == block, scale, 0.0)  # an array: the aggregator pools it without a copy
    pert = Perturbation(kind=kind, scales=scales, masks=masks, precondition=precondition)
    if tilt is not None and tilt.weight != 0.0:
        pert = replace(pert, momentum=tilt.buffers, momentum_weight=tilt.weight, momentum_rms=tilt.rms())
    return pert


def step_perturbation(step_seed: int, pi: np.ndarray, kind: str = "rademacher",
                      masks: Sequence[torch.Tensor | None] | None = None,
                      tilt: MomentumTilt | None = None, layout: np.ndarray | None = None) -> tuple[Perturbation, int]:
    """The perturbation of one step and the block it drew."""
    b = draw_block(step_seed, pi)
    return block_perturbation(b, pi, kind, masks, tilt, layout), b


def probe_energy(grads: np.ndarray, pi: np.ndarray, blocks: Sequence[int]) -> np.ndarray:
    """pi_b g^2, an unbiased estimate of the drawn block's gradient energy |grad_b|^2, for each step (rows of
    `grads`, one scalar per query) averaged over its queries."""
    return (pi.astype(np.float64)[list(blocks)][:, None] * grads.astype(np.float64) ** 2).mean(axis=1)


def probe_energy_rows(grads: np.ndarray, pis: np.ndarray, blocks: np.ndarray) -> np.ndarray:
    """`probe_energy` for many clients at once (grads (clients, steps, queries), pis (clients, blocks), blocks
    (clients, steps)): the same products, and the same mean over each step's queries."""
    pi_b = np.take_along_axis(pis, blocks, axis=1).astype(np.float64)
    return (pi_b[..., None] * grads.astype(np.float64) ** 2).mean(axis=-1)
