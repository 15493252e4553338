"""What the server accepts beyond a well-formed message (issue 49): the step seeds the method assigned the client,
at least one example behind a dense update, and no more bytes than the round plan allows."""

from dataclasses import replace

import numpy as np
import pytest
import torch
from toy_federation import toy_clients, toy_context

from zofed.fl.aggregate import Contribution, WeightedMean
from zofed.fl.attacks import Attack
from zofed.fl.methods.base import StepSeeds
from zofed.fl.personal import BlockSampling
from zofed.fl.plan import FederationPlan
from zofed.fl.protocol import MAX_HEADER_BYTES, ClientUpdate, encode, uplink_max_bytes
from zofed.fl.roles import ClientRole, ServerRole
from zofed.fl.server import RoundInbox
from zofed.fl.server_opt import make_server_optimizer
from zofed.sim.engine import simulate

SIZES = (8, 8)
NO_SEEDS = np.zeros(0, np.uint64)


def _server(method: str, **plan) -> ServerRole:
    settings = {"run_seed": 5, "queries": 2, "pool_size": 16, **plan}
    fed = FederationPlan(method, 6, 6, 4, lr=0.1, eps=1e-2, **settings)
    return ServerRole(fed, [torch.zeros(n) for n in SIZES], None, make_server_optimizer("sgd", 1.0))


def _uplink(local, client: int, seeds: StepSeeds, round_id: int | None = None, **changes) -> ClientUpdate:
    """A seed-and-scalar uplink naming `seeds` the way the method names them."""
    grads = np.random.default_rng(client).normal(size=(local.local_steps, local.queries)).astype(np.float32)
    listed = np.asarray(seeds.seeds, np.uint64) if seeds.explicit else NO_SEEDS
    fields = {"round_id": local.round_id if round_id is None else round_id, "client_id": client, "seeds": listed,
              "base_seed": None if seeds.explicit else seeds.base_seed, "grads": grads, "num_examples": 10,
              "metrics": {}, **changes}
    return ClientUpdate(**fields)


def _reasons(server: ServerRole, local, uplinks: list[tuple[int, ClientUpdate]]) -> list[str | None]:
    """The reason code each uplink is refused for, or None where it is accepted."""
    out = []
    for client, update in uplinks:
        inbox = RoundInbox()
        server.receive(inbox, local, client, encode(update))
        out.append(inbox.rejected[0][1].partition(":")[0] if inbox.rejected else None)
    return out


def _lies(server: ServerRole, local, client: int) -> dict[str, ClientUpdate]:
    """Uplinks of `client` on seeds other than its own, each well-formed."""
    method, own = server.method, server.method.step_seeds(local, client)
    lies = {"next round's seeds": _uplink(local, client, method.step_seeds(server.round_plan(1), client)),
            "another run's seeds": _uplink(local, client, method.step_seeds(replace(local, run_seed=6), client))}
    other = method.step_seeds(local, client + 1)
    if other.seeds != own.seeds:  # private seeds: another client's are not this one's
        lies["another client's seeds"] = _uplink(local, client, other)
    if own.explicit:
        flipped = list(own.seeds)
        flipped[2] ^= 1 << 17
        lies["one seed changed"] = _uplink(local, client, StepSeeds(flipped, None, True))
        lies["seeds reordered"] = _uplink(local, client, StepSeeds(own.seeds[::-1], None, True))
        lies["named by a base seed"] = _uplink(local, client, StepSeeds([], 12345, False))
    else:
        lies["base seed plus one"] = _uplink(local, client, StepSeeds([], own.base_seed + 1, False))
        # the right seeds, listed: the method names them by their base, so the uplink is not what it assigned
        lies["the right seeds listed"] = _uplink(local, client, StepSeeds(own.seeds, None, True))
    return lies


@pytest.mark.parametrize("method, plan", [("zo-seeds", {}), ("decomfl", {}), ("fedkseed", {}), ("hiso", {}),
                                          ("zofed", {}), ("zofed", {"sampling": BlockSampling(shared_seeds=True)})])
def test_an_uplink_on_seeds_other_than_its_assigned_ones_is_refused_for_its_seeds(method, plan):
    server = _server(method, **plan)
    local = server.round_plan(0)
    assert local.method == method
    honest = [(c, _uplink(local, c, server.method.step_seeds(local, c))) for c in range(3)]
    assert _reasons(server, local, honest) == [None] * 3
    lies = _lies(server, local, 1)
    assert len(lies) >= 4
    assert dict(zip(lies, _reasons(server, local, [(1, u) for u in lies.values()]), strict=True)) == \
        dict.fromkeys(lies, "seeds")


def test_a_dense_uplink_names_no_seeds():
    server = _server("fedmezo")
    local = server.round_plan(0)
    dense = np.ones(sum(SIZES), np.float32)
    plain = ClientUpdate(0, 1, NO_SEEDS, None, np.zeros((0, 2), np.float32), 10, {}, dense=dense)
    named = ClientUpdate(0, 1, NO_SEEDS, 77, np.zeros((0, 2), np.float32), 10, {}, dense=dense)
    assert _reasons(server, local, [(1, plain), (1, named)]) == [None, "seeds"]


def _grinding_run(attack: Attack | None, drop: frozenset[int] = frozenset()):
    """Three zofed rounds of 3 of 6 toy clients (`drop`: those clients' uplinks lost on the way); the server's
    record of each round and its final tensors."""
    ctx = toy_context(mode="lora")
    plan = FederationPlan("zofed", 6, 3, 2, lr=1e-2, eps=1e-2, run_seed=4, batch_size=8)
    server = ServerRole(plan, ctx.trainable.tensors(), ctx.trainable.masks, make_server_optimizer("adam", lr=1e-2))
    history = []
    simulate(ctx, toy_clients(), server, 3, client=ClientRole(ctx, attack=attack, num_classes=2),
             on_round=history.append, tamper=lambda r, c, data: b"" if c in drop else data)
    return history, server.tensors


def test_seed_grinding_clients_are_refused_for_their_seeds_and_the_model_is_the_honest_clients_one():
    grinders = frozenset({0, 1})
    history, tensors = _grinding_run(Attack("seed-grind", grinders))
    honest_history, honest_tensors = _grinding_run(None, drop=grinders)
    assert any(set(r["clients"]) & grinders for r in history)  # the grinders were sampled
    for record, honest in zip(history, honest_history, strict=True):
        assert record["clients"] == honest["clients"]
        refused = {r["client"]: r["reason"] for r in record["rejected"]}
        assert set(refused) == set(record["clients"]) & grinders  # exactly the attackers ...
        assert all(reason.startswith("seeds: ") for reason in refused.values())  # ... for their seeds
        assert record["accepted"] == len(record["clients"]) - len(refused) == honest["accepted"]
    assert all(torch.equal(a, b) for a, b in zip(tensors, honest_tensors, strict=True))


def test_a_dense_uplink_of_no_examples_is_refused_and_a_round_of_them_keeps_the_model():
    server = _server("fedmezo")
    local, inbox = server.round_plan(0), RoundInbox()
    for c in server.sample(0)[:2]:
        server.receive(inbox, local, c, encode(ClientUpdate(0, c, NO_SEEDS, None, np.zeros((0, 2), np.float32), 0, {},
                                                            dense=np.ones(sum(SIZES), np.float32))))
    assert [reason.partition(":")[0] for _, reason in inbox.rejected] == ["bad_field"] * 2
    server.aggregate(local, inbox)  # before the fix: ZeroDivisionError in the weighted mean
    assert all(float(t.abs().max()) == 0 for t in server.tensors)


def test_the_weighted_mean_of_no_examples_is_a_clear_error():
    like = [torch.zeros(3)]
    nothing = [Contribution(c, 0, [torch.ones(3)], []) for c in range(2)]
    with pytest.raises(ValueError, match="no examples"):
        WeightedMean().update(like, nothing, {})


@pytest.mark.parametrize("method", ["zo-seeds", "fedkseed", "fedmezo"])
def test_an_uplink_larger_than_the_round_plan_allows_is_refused_before_it_is_parsed(method):
    server = _server(method)
    local = server.round_plan(0)
    dense = server.method.dense_uplink
    bound = uplink_max_bytes(local.local_steps, local.queries, server.num_trainable if dense else None)
    # the largest uplink the plan allows fits: a header at its cap and every array at its widest
    if dense:
        widest = ClientUpdate(0, 1, NO_SEEDS, None, np.zeros((0, 2), np.float32), 10, {},
                              dense=np.ones(server.num_trainable, np.float32))
    else:
        widest = _uplink(local, 1, server.method.step_seeds(local, 1))
    padded = _pad_header(widest, MAX_HEADER_BYTES)
    assert _reasons(server, local, [(1, padded)]) == [None]
    if not dense and server.method.step_seeds(local, 1).explicit:
        assert len(encode(padded)) == bound  # the bound is exact for listed seeds
    inbox = RoundInbox()
    server.receive(inbox, local, 1, b"\0" * (bound + 1))  # not even a zofed message: refused on its size alone
    assert inbox.rejected[0][1].startswith("too_large: ")
    rows = 2 * MAX_HEADER_BYTES // (4 * local.queries)  # scalars for far more steps than the plan has
    big = ClientUpdate(0, 1, NO_SEEDS, 3, np.ones((rows, local.queries), np.float32), 10, {})
    assert _reasons(server, local, [(1, big)]) == ["too_large"]


def _pad_header(update: ClientUpdate, header_bytes: int) -> ClientUpdate:
    """`update` with a metric whose name fills its header to exactly `header_bytes`."""
    header = int.from_bytes(encode(replace(update, metrics={"p": 1.0}))[7:11], "little")
    return replace(update, metrics={"p" * (1 + header_bytes - header): 1.0})


def test_a_secure_sum_is_checked_against_the_rounds_shared_seeds():
    pytest.importorskip("flwr", reason="secure aggregation runs on the Flower backend")
    from zofed.flower.secure import summed_uplink

    server = _server("decomfl")
    local = server.round_plan(0)
    shared = server.method.step_seeds(local, 0)
    mean = np.ones((local.local_steps, local.queries))
    for base, refused in ((shared.base_seed, None), (shared.base_seed + 1, "seeds")):
        # the clients agree among themselves, so the sum is made; the server still checks it against the round
        headers = [_uplink(local, c, StepSeeds([], base, False)) for c in (1, 3)]
        inbox = RoundInbox()
        server.receive(inbox, local, 1, summed_uplink(headers, [1, 3], mean, [0.5, 0.7]))
        assert (inbox.rejected[0][1].partition(":")[0] if inbox.rejected else None) == refused
