"""Every random stream of a run, named in one place.

A run repeats bit for bit because each random choice draws from its own stream, derived from the run seed and
the coordinates of the choice (round, client, step). Two choices that drew from the same stream would be
correlated (FedKSeed's seed picks once shared the stream of local step 7's batch), so every stream is made
here, with a tag no other stream can take:

| stream                  | seeded by                                       | used for                              |
|-------------------------|-------------------------------------------------|---------------------------------------|
| client sampling         | [run seed, round, CLIENT_SAMPLING]              | the clients of a round                |
| local batch             | [run seed, round, client, step]                 | a client's batch at a local step      |
| FedKSeed picks          | [run seed, KSEED_PICKS, round, client]          | which pool seeds a client's steps use |
| round features          | [run seed, ROUND_FEATURES, round, client]       | the examples a client caches a round  |
| centralized batch       | [run seed, step]                                | centralized fine-tuning's batch       |
| step seeds (derive_seed)| (run seed, round, owner) then (base, step)      | perturbation seeds (zo/noise.py)      |
| centralized step seed   | derive_seed(run seed, step)                     | centralized fine-tuning's perturbation|
| FedKSeed pool           | derive_seed(run seed, KSEED_POOL + j)           | the K candidate seeds                 |
| block draw              | derive_seed(step seed, BLOCK_DRAW)              | zofed's block of a step               |
| held-out split          | run seed                                        | a test fifth of a file with no test   |
| validation split        | [run seed, VALIDATION]                          | data.validation_examples, held out    |
| training cap            | run seed                                        | data.train_examples' subset           |
| test cap                | run seed + 1                                    | data.test_examples' subset            |
| watched test subset     | run seed + 2                                    | data.eval_examples, evaluated per round|
| partition               | partition.seed (data/partition.py)              | the client split, each client's test  |
| attackers               | [run seed, ATTACKERS]                           | which clients attack (attack.fraction)|
| attack noise            | [run seed, ATTACK_NOISE, round, client]         | a random-scalars attacker's scalars   |
| probe set               | [run seed, PROBE_SET]                           | the server's screening examples       |
| central DP noise        | [4 secret words, DP_NOISE, round, client]       | the server's noise on an uplink (the  |
|                         |                                                 | secret: fl/privacy.py, not the seed)  |

Tags sit far above any round, client or step index (those are below 2**32), so no two streams of a run meet.
The data streams are plain integer seeds, kept as they were so existing splits and subsets stay the same: the
training cap draws after the held-out split from the same seed, on the examples the split left.
"""

from __future__ import annotations

import numpy as np

CLIENT_SAMPLING = 11  # third entry of [run seed, round, tag]: no other stream has three entries
KSEED_PICKS = 2**32 + 7  # second entry: above every round index, so never a local batch's stream
SHARED_OWNER = 2**32 - 1  # the owner slot of step seeds that every client of a round shares
KSEED_POOL = 2**40  # derive_seed slot offset of FedKSeed's pool seeds
VALIDATION = 2**32 + 13  # second entry of the validation split's stream
BLOCK_DRAW = 2**41  # derive_seed slot of zofed's block draw, apart from the noise's own use of a step seed
ATTACKERS = 2**32 + 17  # second entry of the attackers' stream
ATTACK_NOISE = 2**32 + 19  # second entry of a random-scalars attacker's stream
PROBE_SET = 2**32 + 23  # second entry of the screening probe set's stream
DP_NOISE = 2**32 + 29  # second entry of the differential-privacy noise's stream
ROUND_FEATURES = 2**32 + 31  # second entry of the stream of the examples a client caches features of in a round


def client_sampling(run_seed: int, round_id: int) -> np.random.Generator:
    return np.random.default_rng([run_seed, round_id, CLIENT_SAMPLING])


def local_batch(run_seed: int, round_id: int, client_id: int, step: int) -> np.random.Generator:
    return np.random.default_rng([run_seed, round_id, client_id, step])


def kseed_picks(run_seed: int, round_id: int, client_id: int) -> np.random.Generator:
    return np.random.default_rng([run_seed, KSEED_PICKS, round_id, client_id])


def round_features(run_seed: int, round_id: int, client_id: int) -> np.random.Generator:
    return np.random.default_rng([run_seed, ROUND_FEATURES, round_id, client_id])


def centralized_batch(seed: int, step: int) -> np.random.Generator:
    return np.random.default_rng([seed, step])


def held_out_split(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def validation_split(seed: int) -> np.random.Generator:
    return np.random.default_rng([seed, VALIDATION])


def training_cap(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def test_cap(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed + 1)


def watched_subset(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed + 2)


def attackers(seed: int) -> np.random.Generator:
    return np.random.default_rng([seed, ATTACKERS])


def attack_noise(seed: int, round_id: int, client_id: int) -> np.random.Generator:
    return np.random.default_rng([seed, ATTACK_NOISE, round_id, client_id])


def probe_set(seed: int) -> np.random.Generator:
    return np.random.default_rng([seed, PROBE_SET])


def dp_noise(secret: list[int], round_id: int, client_id: int) -> np.random.Generator:
    return np.random.default_rng([*secret, DP_NOISE, round_id, client_id])
