"""Every random stream of zofed.streams is its own: no two names and argument tuples draw the same numbers."""

from __future__ import annotations

import inspect
import itertools
import re
from pathlib import Path

import numpy as np
import pytest

from zofed import streams

# Edge values of the keying: 0 (SeedSequence drops trailing zero words), 11 (an old tag), and the 32-bit border
# (an int >= 2**32 takes two words, so a big argument could pass for two small ones).
GRID = [0, 1, 11, 2**32 - 1, 2**32, 2**32 + 5]
SECRETS = [[0, 0, 0, 0], [1, 2, 3, 4], [5, 1, 3, 0], [2**32 - 1, 0, 0, 11]]
SRC = Path(__file__).resolve().parents[1] / "src" / "zofed"


def stream_functions() -> dict[str, inspect.Signature]:
    """Every public function of the module: each makes a Generator, or a torch seed drawn from one."""
    return {name: inspect.signature(fn) for name, fn in vars(streams).items()
            if inspect.isfunction(fn) and not name.startswith("_") and fn.__module__ == streams.__name__}


def argument_tuples(name: str, signature: inspect.Signature) -> list[tuple]:
    if name == "dp_noise":  # a secret of 4 words, then round and client
        return [(list(secret), r, c) for secret in SECRETS for r, c in itertools.product(GRID, repeat=2)]
    return list(itertools.product(GRID, repeat=len(signature.parameters)))


def first_draw(made: np.random.Generator | int) -> bytes:
    """A Generator's first four uint64s, or a torch seed as it is."""
    if isinstance(made, int):
        return b"torch seed" + made.to_bytes(8, "little")
    return made.integers(0, 2**64, size=4, dtype=np.uint64).tobytes()


def test_every_stream_and_argument_tuple_draws_its_own_numbers() -> None:
    functions = stream_functions()
    assert len(functions) >= 20  # the module's table: a stream dropped from it would go untested here
    first: dict[bytes, tuple] = {}
    for name, signature in functions.items():
        for args in argument_tuples(name, signature):
            draw = first_draw(getattr(streams, name)(*args))
            assert draw not in first, f"{name}{args} draws what {first.get(draw)} draws"
            first[draw] = (name, args)


def test_streams_known_to_have_met_now_differ() -> None:
    """The collisions of the old keying, by name: a prefix tag with trailing zeros or a 2**32 carry."""
    def draw(gen: np.random.Generator) -> list[int]:
        return gen.integers(0, 2**63, size=4).tolist()

    assert draw(streams.client_sampling(3, 2)) != draw(streams.local_batch(3, 2, 11, 0))
    assert draw(streams.held_out_split(3)) != draw(streams.training_cap(3))
    assert draw(streams.held_out_split(3)) != draw(streams.centralized_batch(3, 0))
    assert draw(streams.local_batch(2**32 + 5, 3, 0, 0)) != draw(streams.local_batch(5, 1, 3, 0))
    assert draw(streams.client_eval(3, 0)) != draw(streams.local_batch(3, 0, 0, 0))
    assert draw(streams.partition(3)) != draw(streams.held_out_split(3))
    assert streams.lora_init(0) != streams.head_init(0)  # both once seeded torch with trainable.init_seed itself


@pytest.mark.parametrize("bad", [-1, 2**64, 2**70])
def test_an_argument_outside_64_bits_is_refused(bad: int) -> None:
    with pytest.raises(ValueError, match=r"\[0, 2\*\*64\).*local batch"):
        streams.local_batch(0, bad, 0, 0)


def test_the_same_arguments_give_the_same_stream() -> None:
    a = streams.local_batch(7, 1, 2, 3).integers(0, 2**63, size=8)
    assert np.array_equal(a, streams.local_batch(7, 1, 2, 3).integers(0, 2**63, size=8))


def test_no_random_stream_is_seeded_outside_streams_py() -> None:
    """Seeding numpy or torch anywhere else could bring back a collision. Made elsewhere: local DP's unseeded
    (fresh-entropy) generator, torch seeded with constants of the code (the tiny test models' weights, the
    feature scales' fixed probe input), and models/global_rng.py, which seeds torch's global generator with a seed
    its callers draw from a stream here (streams.lora_init, streams.head_init)."""
    seeded = re.compile(r"default_rng\(\s*[^)\s]|SeedSequence\(|np\.random\.seed\(|RandomState\("
                        r"|manual_seed\((?!streams\.)")
    constants = {"models/tiny.py", "zo/feature_scale.py", "models/global_rng.py"}
    found = [f"{path.relative_to(SRC)}:{n}" for path in SRC.rglob("*.py")
             if path.name != "streams.py" and str(path.relative_to(SRC)) not in constants
             for n, line in enumerate(path.read_text().splitlines(), 1) if seeded.search(line)]
    assert not found, f"random streams seeded outside zofed/streams.py: {found}"
