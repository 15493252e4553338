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
mechanism's noise multiplier is sigma / 2. The noise is drawn from the run seed so that a run and its replay
repeat bit for bit: the guarantee holds against whoever sees the model and not the run's seed (the server's
config and the uplink log hold it, and the log holds the clients' numbers before noise anyway).
"""

from __future__ import annotations

from zofed import streams
from zofed.fl.protocol import ClientUpdate


def add_noise(update: ClientUpdate, noise: float, clip_norm: float, run_seed: int, round_id: int) -> ClientUpdate:
    """The (already clipped) uplink with N(0, (noise x clip_norm)^2) added to each of its numbers."""
    values = update.numbers
    rng = streams.dp_noise(run_seed, round_id, update.client_id)
    return update.with_numbers(values + rng.normal(0.0, noise * clip_norm, size=values.shape))


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
