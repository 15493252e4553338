"""Every random stream of a run, named in one place.

A run repeats bit for bit because each random choice draws from its own stream, derived from a seed and the
coordinates of the choice (round, client, step). Two choices that drew from the same stream would be correlated
(a client's FedKSeed picks would follow one of its batches), so every stream is made here, from a key no other
stream can take (see `_key`):

| stream             | tag | arguments                      | used for                                        |
|--------------------|-----|--------------------------------|-------------------------------------------------|
| client sampling    |  1  | run seed, round                | the clients of a round                          |
| local batch        |  2  | run seed, round, client, step  | a client's batch at a local step                |
| FedKSeed picks     |  3  | run seed, round, client        | which pool seeds a client's steps use           |
| round features     |  4  | run seed, round, client        | the examples a client caches features of        |
| centralized batch  |  5  | run seed, step                 | centralized fine-tuning's batch                 |
| held-out split     |  6  | run seed                       | a test fifth of a file with no test             |
| validation split   |  7  | run seed                       | data.validation_examples, held out              |
| training cap       |  8  | run seed                       | data.train_examples' subset                     |
| test cap           |  9  | run seed                       | data.test_examples' subset                      |
| watched subset     | 10  | run seed                       | data.eval_examples, evaluated per round         |
| attackers          | 11  | run seed                       | which clients attack (attack.fraction)          |
| attack noise       | 12  | run seed, round, client        | a random-scalars attacker's scalars             |
| probe set          | 13  | run seed                       | the server's screening examples                 |
| central DP noise   | 14  | 4 secret words, round, client  | the server's noise on an uplink (the secret:    |
|                    |     |                                | fl/privacy.py, not the seed)                    |
| client evaluation  | 15  | run seed, client               | the capped sample of a client's held-out set    |
| partition          | 16  | partition.seed                 | the client split (data/partition.py)            |
| client test split  | 17  | partition.seed, client         | a client's local test examples                  |
| block draw         | 18  | step seed                      | zofed's block of a step (fl/personal.py)        |
| LoRA init          | 19  | trainable.init_seed            | torch's seed for LoRA's random init             |
| head init          | 20  | trainable.init_seed            | torch's seed for an encoder's new head          |

Not drawn here: the perturbation seeds (`zo.noise.derive_seed` of run seed, round, owner and step; FedKSeed's
pool at `KSEED_POOL + j`), which are seeds, not streams; local DP's noise, fresh entropy that no one may
reproduce (fl/privacy.py); the tiny test models' weights (models/tiny.py) and the fixed probe input of
zo/feature_scale.py, constants of the code rather than streams of a run.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import numpy as np

SHARED_OWNER = 2**32 - 1  # the owner slot of step seeds that every client of a round shares
KSEED_POOL = 2**40  # derive_seed slot offset of FedKSeed's pool seeds

_WORD = 2**32
_LIMIT = 2**64


@enum.unique
class Tag(enum.IntEnum):
    """Each stream's first key word. Fixed numbers: a new stream takes a new one, no existing one moves."""

    CLIENT_SAMPLING = 1
    LOCAL_BATCH = 2
    KSEED_PICKS = 3
    ROUND_FEATURES = 4
    CENTRALIZED_BATCH = 5
    HELD_OUT_SPLIT = 6
    VALIDATION_SPLIT = 7
    TRAINING_CAP = 8
    TEST_CAP = 9
    WATCHED_SUBSET = 10
    ATTACKERS = 11
    ATTACK_NOISE = 12
    PROBE_SET = 13
    DP_NOISE = 14
    CLIENT_EVAL = 15
    PARTITION = 16
    CLIENT_TEST_SPLIT = 17
    BLOCK_DRAW = 18
    LORA_INIT = 19
    HEAD_INIT = 20


def _key(tag: Tag, args: Sequence[int]) -> np.ndarray:
    """The 32-bit words a stream is seeded with: the tag, each argument as exactly two words (low, high), and the
    argument count + 1 last. SeedSequence drops trailing zero words and splits a large int into as many words as
    it needs, so without the fixed widths and the nonzero last word two keys could meet; with them the words give
    back the tag and every argument, and no two (stream, arguments) share a key."""
    words = [int(tag)]
    for arg in args:
        value = int(arg)
        if not 0 <= value < _LIMIT:
            raise ValueError(f"a random stream's arguments are integers in [0, 2**64); got {arg!r} for the "
                             f"{tag.name.lower().replace('_', ' ')} stream")
        words += [value % _WORD, value // _WORD]
    words.append(len(args) + 1)
    return np.array(words, dtype=np.uint32)


def _stream(tag: Tag, *args: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence(_key(tag, args)))


def client_sampling(run_seed: int, round_id: int) -> np.random.Generator:
    return _stream(Tag.CLIENT_SAMPLING, run_seed, round_id)


def local_batch(run_seed: int, round_id: int, client_id: int, step: int) -> np.random.Generator:
    return _stream(Tag.LOCAL_BATCH, run_seed, round_id, client_id, step)


def kseed_picks(run_seed: int, round_id: int, client_id: int) -> np.random.Generator:
    return _stream(Tag.KSEED_PICKS, run_seed, round_id, client_id)


def round_features(run_seed: int, round_id: int, client_id: int) -> np.random.Generator:
    return _stream(Tag.ROUND_FEATURES, run_seed, round_id, client_id)


def centralized_batch(seed: int, step: int) -> np.random.Generator:
    return _stream(Tag.CENTRALIZED_BATCH, seed, step)


def held_out_split(seed: int) -> np.random.Generator:
    return _stream(Tag.HELD_OUT_SPLIT, seed)


def validation_split(seed: int) -> np.random.Generator:
    return _stream(Tag.VALIDATION_SPLIT, seed)


def training_cap(seed: int) -> np.random.Generator:
    return _stream(Tag.TRAINING_CAP, seed)


def test_cap(seed: int) -> np.random.Generator:
    return _stream(Tag.TEST_CAP, seed)


def watched_subset(seed: int) -> np.random.Generator:
    return _stream(Tag.WATCHED_SUBSET, seed)


def attackers(seed: int) -> np.random.Generator:
    return _stream(Tag.ATTACKERS, seed)


def attack_noise(seed: int, round_id: int, client_id: int) -> np.random.Generator:
    return _stream(Tag.ATTACK_NOISE, seed, round_id, client_id)


def probe_set(seed: int) -> np.random.Generator:
    return _stream(Tag.PROBE_SET, seed)


def dp_noise(secret: Sequence[int], round_id: int, client_id: int) -> np.random.Generator:
    return _stream(Tag.DP_NOISE, *secret, round_id, client_id)


def client_eval(seed: int, client_id: int) -> np.random.Generator:
    return _stream(Tag.CLIENT_EVAL, seed, client_id)


def partition(seed: int) -> np.random.Generator:
    return _stream(Tag.PARTITION, seed)


def client_test_split(seed: int, client_id: int) -> np.random.Generator:
    return _stream(Tag.CLIENT_TEST_SPLIT, seed, client_id)


def block_draw(step_seed: int) -> np.random.Generator:
    return _stream(Tag.BLOCK_DRAW, step_seed)


def lora_init(init_seed: int) -> int:
    """torch's seed for LoRA's random init: its own stream, not the new head's (both read trainable.init_seed)."""
    return _torch_seed(Tag.LORA_INIT, init_seed)


def head_init(init_seed: int) -> int:
    """torch's seed for an encoder's new classification head."""
    return _torch_seed(Tag.HEAD_INIT, init_seed)


def _torch_seed(tag: Tag, *args: int) -> int:
    return int(_stream(tag, *args).integers(0, 2**63))
