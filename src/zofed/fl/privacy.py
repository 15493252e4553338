"""Client-level differential privacy for seed-and-scalar federations: clip, add Gaussian noise, account.

Each accepted uplink's numbers (its scalars, or a dense update) are clipped to an L2 norm of C
(`federation.clip_norm`) and get Gaussian noise of standard deviation sigma x C (`federation.dp_noise` = sigma) on
every number. Everything after (the rebuilt update, the aggregate, the server step, zofed's block probes, the
released model) is computed from the noised numbers only, so it is post-processing. On a ZO uplink the noise is
on a handful of scalars, not on every trainable value: sum_t n_t u_t has a per-coordinate standard deviation of
sigma C sqrt(steps x queries), where noise on the dense update would need sigma C on each of the d coordinates
times the directions' spread.

The privacy spent is accounted with the RDP accountant of Google's `dp-accounting`: each round samples m of the
N clients without replacement and applies the Gaussian mechanism to the round's clipped numbers. Two datasets are
neighbours when one client's data is replaced by another's, so one client's numbers move by at most 2C, and the
mechanism's noise multiplier is sigma / 2.

The accountant covers the noised numbers and nothing else, so a noised uplink carries nothing else about its
client: no metrics (the train loss), and the public example count `PUBLIC_EXAMPLES` in place of the client's own.
The aggregate's example-weighted mean then weighs every client alike, a plain mean of the noised numbers: a
function of them alone, so post-processing, where weights taken from the clients' counts would release those
counts unnoised (and let one client's weight, not only its numbers, move the model). A round's record under DP
has no train loss (NaN), nor the number of uplinks the server clipped, for the same reason.

Where the noise comes from decides whom the guarantee holds against. The run seed is no secret (the config and
the uplink log carry it), so no noise is drawn from it:
- central DP (`dp_at: server`): from a 128-bit secret the server draws when the run starts and keeps in its
  checkpoint (a resumed run repeats its noise bit for bit). The uplink log holds each uplink's numbers after
  clipping and noise, what the aggregation read, so `zofed replay` rebuilds the model without the secret, and
  the log reveals no more than the model does. The server itself sees the numbers before noise: central DP trusts
  it.
- local DP (`dp_at: client`): from the client's own entropy, drawn afresh for every uplink and kept nowhere, so
  not even the server can take it off. A round redone after a crash gets new noise.
"""

from __future__ import annotations

import secrets
from dataclasses import replace

import numpy as np
import torch

from zofed import streams
from zofed.fl.protocol import ClientUpdate

SECRET_WORDS = 4  # the server's noise secret as 32-bit words (128 bits), how the checkpoint keeps it
PUBLIC_EXAMPLES = 1  # the example count every noised uplink carries: the same for all, so it says nothing


def add_noise(update: ClientUpdate, noise: float, clip_norm: float, rng: np.random.Generator) -> ClientUpdate:
    """The (already clipped) uplink with N(0, (noise x clip_norm)^2) from `rng` added to each of its numbers, and
    nothing else of its client's: no metrics, and `PUBLIC_EXAMPLES` as its example count (see the module's note)."""
    values = update.numbers
    noised = update.with_numbers(values + rng.normal(0.0, noise * clip_norm, size=values.shape))
    return replace(noised, metrics={}, num_examples=PUBLIC_EXAMPLES)


def new_secret() -> torch.Tensor:
    """A fresh noise secret for a server that adds central DP noise, as the checkpoint keeps it."""
    return torch.tensor([secrets.randbits(32) for _ in range(SECRET_WORDS)], dtype=torch.int64)


def server_noise(secret: torch.Tensor, round_id: int, client_id: int) -> np.random.Generator:
    """The central noise of one client's uplink in one round: a function of the server's secret alone."""
    return streams.dp_noise([int(w) for w in secret], round_id, client_id)


def client_noise() -> np.random.Generator:
    """Local DP noise: fresh entropy from the operating system, known to no one else."""
    return np.random.default_rng()


def epsilon_spent(noise: float, num_clients: int, per_round: int, rounds: int, delta: float) -> float:
    """The epsilon of (epsilon, delta) client-level DP after `rounds` rounds (see the module's note)."""
    import dp_accounting
    from dp_accounting import rdp

    if rounds <= 0:
        return 0.0
    gaussian = dp_accounting.GaussianDpEvent(noise / 2)  # replace-one neighbours: the sensitivity is 2 C
    one_round = gaussian if per_round >= num_clients else \
        dp_accounting.SampledWithoutReplacementDpEvent(num_clients, per_round, gaussian)
    accountant = rdp.RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
    accountant.compose(dp_accounting.SelfComposedDpEvent(one_round, rounds))
    return float(accountant.get_epsilon(delta))
