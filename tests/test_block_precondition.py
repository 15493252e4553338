"""zofed's preconditioned noise (federation.sampling.precondition, fl/block_precondition.py): the server's second
moment shapes each block's noise, the clients' steps follow it and the server rebuilds them exactly, pooled or client
by client, and a run that carries it resumes bit-identical."""

from dataclasses import replace

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from test_pooled_aggregation import _both_paths, _receive, _round
from test_zofed_method import rebuild, run_client
from toy_federation import tiny_federated_config, toy_clients, toy_context

from zofed.fl.block_precondition import BlockPreconditioner, split_precondition
from zofed.fl.methods.zofed import split_state
from zofed.fl.personal import BlockSampling, draw_blocks
from zofed.fl.plan import FederationPlan
from zofed.fl.protocol import decode
from zofed.fl.roles import ClientRole, ServerRole
from zofed.fl.server import RoundInbox
from zofed.fl.server_opt import make_server_optimizer
from zofed.run.federated import run_federated
from zofed.zo.reduce import rms


def test_the_shape_probes_an_outlier_coordinate_less_and_keeps_each_block_its_size():
    tensors = [torch.zeros(6), torch.zeros(4), torch.zeros(5)]
    state = BlockPreconditioner.start(tensors, np.array([0, 0, 1]))
    assert np.array_equal(state.for_round(0), np.ones(15, np.float32))  # nothing moved yet: plain noise
    delta = [torch.full((6,), 1e-3), torch.full((4,), 1e-3), torch.zeros(5)]
    delta[0][2] = 3e-2  # one coordinate's update runs 30 times the rest (an outlier channel)
    state.observe(delta, lr=0.1, local_steps=2)
    p = state.for_round(1)
    block0, block1 = p[:10], p[10:]
    assert rms(block0) == pytest.approx(1.0) and np.array_equal(block1, np.ones(5, np.float32))  # not drawn: kept
    quiet = np.delete(block0, 2)
    assert np.allclose(quiet, quiet[0]) and block0[2] < quiet[0] / 3
    # each K shrunk to its block's mean: the outlier is probed sqrt((K_o + mean) / (K_q + mean)) times less
    k_quiet, k_out = 0.1 * (1e-3 / 0.2) ** 2, 0.1 * (3e-2 / 0.2) ** 2
    mean = (9 * k_quiet + k_out) / 10
    assert quiet[0] / block0[2] == pytest.approx(np.sqrt((k_out + mean) / (k_quiet + mean)), rel=1e-5)
    assert state.for_round(1) is p  # one array a round
    again = BlockPreconditioner.start(tensors, np.array([0, 0, 1]))
    again.load_tensors(state.to_tensors())
    assert np.array_equal(again.for_round(1), p)
    with pytest.raises(ValueError, match="one value per trainable value"):
        split_precondition(p[:-1], tensors)
    with pytest.raises(ValueError, match="finite"):
        split_precondition(np.full(15, np.nan, np.float32), tensors)


def _server_after_a_round(sampling: BlockSampling) -> tuple[ServerRole, ClientRole]:
    """A zofed server that has aggregated one round of two toy clients (so its noise shape has moved)."""
    ctx = toy_context()
    plan = FederationPlan("zofed", 6, 2, 3, lr=1e-2, eps=1e-2, run_seed=3, batch_size=8, sampling=sampling)
    server = ServerRole(plan, ctx.trainable.tensors(), ctx.trainable.masks,
                        make_server_optimizer("adam", 1e-2, granularity="tensor"))
    client = ClientRole(ctx)
    round_plan, inbox = server.round_plan(0), RoundInbox()
    for c in server.sample(0):
        server.receive(inbox, round_plan, c, client.train(server.downlink(round_plan, c), c, toy_clients()[c]))
    server.aggregate(round_plan, inbox)
    return server, client


@pytest.mark.parametrize("tilt", [0.0, 0.5])
def test_preconditioned_steps_are_rebuilt_exactly_from_the_shape_sent(tilt):
    server, _ = _server_after_a_round(BlockSampling(precondition=True, tilt=tilt))
    ctx, round_plan = toy_context(), server.round_plan(1)
    assert round_plan.precondition == 1
    start = [t.clone() for t in server.tensors]
    num_blocks, layout = len(server.method_state.sizes), server.method_state.layout
    for client in range(6):  # one whose steps draw a block the first round moved (its shape no longer all ones)
        state = decode(server.downlink(round_plan, client)).server_state
        pi, shape, momentum = split_state(state, round_plan, start, num_blocks)
        drawn = draw_blocks(server.method.step_seeds(round_plan, client).seeds, pi)
        if any(not torch.equal(shape[i], torch.ones_like(shape[i])) for i in np.flatnonzero(np.isin(layout, drawn))):
            break
    else:
        pytest.fail("no client draws a shaped block")
    assert (momentum is not None) == bool(tilt)
    update, final = run_client(ctx, start, client, toy_clients()[client], round_plan, state)
    rebuilt = torch.cat([r.reshape(-1) for r in rebuild(start, update, round_plan, state)])
    actual = torch.cat([(f - s).reshape(-1) for f, s in zip(final, start, strict=True)])
    assert actual.norm() > 0 and torch.equal(rebuilt, actual)
    plain = replace(round_plan, precondition=0)
    unshaped = np.concatenate([pi, momentum]) if momentum is not None else pi
    assert not torch.equal(torch.cat([r.reshape(-1) for r in rebuild(start, update, plain, unshaped)]), actual)
    with pytest.raises(ValueError, match="carries"):
        split_state(state[:-1], round_plan, start, num_blocks)


def test_a_preconditioned_round_pools_bit_for_bit():
    server, (local, inbox) = _round()
    server.plan = replace(server.plan, sampling=BlockSampling(precondition=True))
    server.method_state = server.method.init_state(server)
    server.aggregate(local, inbox)
    local, inbox = _receive(server, 1)
    assert local.precondition == 1
    shape = server.method_state.precondition.for_round(1)
    assert shape.min() < 0.9 < 1.1 < shape.max()
    (general, general_rows), (pooled, pooled_rows) = _both_paths(server, local, inbox)
    assert len(pooled_rows) == 1 and general_rows[0][0] == pooled_rows[0][0]
    assert all(torch.equal(a, b) for a, b in zip(general, pooled, strict=True))


def test_a_preconditioned_run_resumes_bit_identical(tiny_workspace, tmp_path):
    steps = "federation.local_steps=6"  # enough draws that a later round steps on a block an earlier one shaped
    shaped = (steps, "federation.sampling.precondition=true")
    run_federated(tiny_federated_config(tiny_workspace, tmp_path / "whole", *shaped), show_progress=False)
    run_federated(tiny_federated_config(tiny_workspace, tmp_path / "plain", steps), show_progress=False)
    run_federated(tiny_federated_config(tiny_workspace, tmp_path / "split", *shaped, "federation.rounds=2"),
                  show_progress=False)
    run_federated(tiny_federated_config(tiny_workspace, tmp_path / "split", *shaped), resume=True, show_progress=False)
    final = {name: load_file(str(tmp_path / name / "final" / "trainable.safetensors"))
             for name in ("whole", "split", "plain")}
    assert all(torch.equal(final["whole"][k], final["split"][k]) for k in final["whole"])
    assert any(not torch.equal(final["whole"][k], final["plain"][k]) for k in final["whole"])
