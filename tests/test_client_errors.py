"""A client whose training fails is its round's rejected uplink on the in-process engine, as on Flower: the run goes
on, and `zofed run` says in one line when no round ever accepted an uplink."""

import numpy as np
import pytest
import torch
from toy_federation import toy_clients, toy_context
from typer.testing import CliRunner

from zofed.cli import app
from zofed.fl.plan import FederationPlan
from zofed.fl.roles import ClientRole, ServerRole
from zofed.sim.engine import simulate


def _server(ctx, lr=1e-2, eps=1e-2):
    plan = FederationPlan("zo-seeds", 6, 3, 2, lr=lr, eps=eps, run_seed=4, batch_size=8)
    return ServerRole(plan, ctx.trainable.tensors(), ctx.trainable.masks)


def test_a_non_finite_loss_is_a_rejected_uplink_and_the_round_keeps_the_model():
    # on this toy model a perturbation of 10 on every weight makes every perturbed loss NaN
    ctx = toy_context(mode="all")
    start = [t.clone() for t in ctx.trainable.tensors()]
    history = []
    result = simulate(ctx, toy_clients(), _server(ctx, lr=1e9, eps=10.0), 1, on_round=history.append)
    assert [r["accepted"] for r in history] == [0]
    for record in history:
        assert [r["client"] for r in record["rejected"]] == record["clients"]
        assert all(r["reason"].startswith("client_error: NonFiniteLossError: non-finite loss")
                   for r in record["rejected"])
        assert np.isnan(record["train_loss"])
    assert all(torch.equal(a, b) for a, b in zip(result.global_tensors, start, strict=True))


class _Failing(ClientRole):
    """An honest client role, except that `fails` raises `error` while it trains."""

    def __init__(self, ctx, fails: int, error: BaseException) -> None:
        super().__init__(ctx)
        self.fails, self.error = fails, error

    def train(self, downlink, client_id, indices, round_id=None):
        if client_id == self.fails:
            raise self.error
        return super().train(downlink, client_id, indices, round_id)


def test_one_failing_client_is_rejected_with_its_first_line_and_the_others_count():
    ctx = toy_context(mode="lora")
    server = _server(ctx)
    failing = server.sample(0)[0]
    history = []
    error = RuntimeError("the client's disk is gone\n  a second line that stays out of the reason")
    result = simulate(ctx, toy_clients(), server, 1, client=_Failing(ctx, failing, error), on_round=history.append)
    (record,) = history
    reason = "client_error: RuntimeError: the client's disk is gone"
    assert record["rejected"] == [{"client": failing, "reason": reason}]
    assert record["accepted"] == 2 and np.isfinite(record["train_loss"])
    assert any(float(t.abs().max()) > 0 for t in result.global_tensors)  # LoRA B moved off zero: the others counted


def test_an_interrupt_is_not_a_client_error():
    ctx = toy_context(mode="lora")
    server = _server(ctx)
    with pytest.raises(KeyboardInterrupt):
        simulate(ctx, toy_clients(), server, 1, client=_Failing(ctx, server.sample(0)[0], KeyboardInterrupt()))


def test_zofed_run_with_every_client_failing_says_so_in_one_line(tiny_workspace, tmp_path):
    out = tmp_path / "run"
    result = CliRunner().invoke(app, [
        "run", "--model", str(tiny_workspace / "model"), "--data", str(tiny_workspace / "train.jsonl"),
        "--out", str(out), "--rounds", "2", "--set", f"data.test_source={tiny_workspace / 'test.jsonl'}",
        "--set", "data.eval_examples=20", "--set", "task.template=review : {text} . sentiment :",
        "--set", "task.verbalizer=[negative, positive]", "--set", "trainable.mode=all", "--set", "train.batch_size=8",
        "--set", "federation.method=zo-seeds", "--set", "federation.clients_per_round=2",
        "--set", "federation.partition.num_clients=4", "--set", "optimizer.lr=1e9", "--set", "zo.eps=100"])
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.output
    assert "Traceback" not in result.output
    (line,) = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert "none of the 2 rounds accepted an uplink" in line and "client_error: NonFiniteLossError" in line
