"""`zofed replay RUN_DIR`: rebuild a federated run's final model from its uplink log alone, and check it.

The replay reads no data and trains nothing: it rebuilds the starting trainable tensors from the model the logged
config names (checked against the logged hash), then runs the server's side of every logged round, sampling,
each client's state, validation of the logged uplinks, aggregation and the server step, exactly as the run's
server did. The result is compared bit for bit with the run's `final/` tensors. With `expect`, the log's head
(the hash of its last line, which `zofed run` prints) must first be the one kept outside the run directory: the
hash chain alone can be rewritten by whoever can edit the log.

With `trace`, the replay also records how each round moved the model (`RoundTrace`): the server step's length,
the distance from the start, and the tensor that has grown the most. A run whose loss walked away shows there
whether every tensor drifted or one ran away, without running a forward pass. It also records how far the round's
clients agreed (`agreement`): the mean inner product of two clients' rebuilt updates over the mean squared length of
one. A ZO update is the gradient plus noise that no other client shares, so near 0 the round was mostly noise; the
clients' gradients alone (equal, and without noise) would give 1.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml
from safetensors.torch import load_file

from zofed.fl.server import RoundInbox
from zofed.run.checkpoint import find_checkpoint
from zofed.run.config import ConfigError
from zofed.run.federated import make_server
from zofed.run.federated_config import FederatedConfig
from zofed.run.setup import build_model, prefix_cache
from zofed.run.uplink_log import LOG_NAME, LogError, read_log, tensors_sha256


@dataclass(frozen=True)
class RoundTrace:
    """How one replayed round moved the server's iterate (norms over every trainable value)."""

    round: int
    step: float  # the length of this round's server step
    distance: float  # the distance from the starting tensors after it
    largest: str  # the tensor whose RMS grew the most since the start
    largest_rms: float  # its RMS now
    largest_start_rms: float  # and at the start
    agreement: float | None = None  # how far the round's clients' updates agree (`agreement`); None: under 2, or all 0


@dataclass(frozen=True)
class Replay:
    rounds: int
    uplinks: int
    head: str  # the hash of the log's last line
    matches: bool  # the replayed tensors equal final/ bit for bit
    max_abs_difference: float
    final: Path
    trace: tuple[RoundTrace, ...] = ()


def _norm(tensors: list[torch.Tensor]) -> float:
    return sum(float(t.double().pow(2).sum()) for t in tensors) ** 0.5


def _rms(tensor: torch.Tensor) -> float:
    return float(tensor.double().pow(2).mean().sqrt())


def _trace(round_id: int, names: list[str], start: list[torch.Tensor], start_rms: list[float],
           before: list[torch.Tensor], after: list[torch.Tensor], agreed: float | None) -> RoundTrace:
    now = [_rms(a) for a in after]
    i = max(range(len(names)), key=lambda k: now[k] - start_rms[k])
    return RoundTrace(round_id, _norm([a - b for a, b in zip(after, before, strict=True)]),
                      _norm([a - s for a, s in zip(after, start, strict=True)]), names[i], now[i], start_rms[i],
                      agreed)


def agreement(updates: list[list[torch.Tensor]]) -> float | None:
    """The mean inner product of two different clients' updates over the mean squared length of one (None for
    fewer than two, or updates of length 0)."""
    if len(updates) < 2:
        return None
    flat = torch.stack([torch.cat([t.flatten() for t in u]).double() for u in updates])
    gram = flat @ flat.T
    n, own = len(updates), float(gram.diagonal().sum())
    if own == 0.0:
        return None
    return (float(gram.sum()) - own) / (n - 1) / own


# The shortest prefix of a head `--expect` accepts: 128 bits, too many to forge a log whose head starts alike.
MIN_EXPECT_DIGITS = 32


def check_head(path: Path, head: str, expect: str) -> None:
    """The log's head must be `expect` (the full hash, or a prefix of at least MIN_EXPECT_DIGITS hex digits),
    a value kept outside the run directory: a log rewritten from a changed line on has another head."""
    wanted = expect.strip().lower()
    if not 0 < len(wanted) <= len(head) or any(c not in "0123456789abcdef" for c in wanted):
        raise LogError(f"--expect {expect!r} is not a SHA-256 hash (up to {len(head)} hex digits)")
    if len(wanted) < MIN_EXPECT_DIGITS:
        raise LogError(f"--expect {expect!r} has {len(wanted)} hex digits; give at least {MIN_EXPECT_DIGITS} of "
                       "the head (a shorter prefix could be matched by a forged log)")
    if not head.startswith(wanted):
        raise LogError(f"{path} has head {head}, not the expected {wanted}: the log was changed, cut or extended "
                       "after that head was taken, or it is another run's")


def replay_run(run_dir: str | Path, trace: bool = False, expect: str | None = None) -> Replay:
    """Replay `run_dir`'s uplink log; with `expect`, first check the log's head against it (`check_head`)."""
    run_dir = Path(run_dir)
    header, rounds, head = read_log(run_dir / LOG_NAME)
    if expect is not None:
        check_head(run_dir / LOG_NAME, head, expect)
    try:
        config = FederatedConfig.model_validate(yaml.safe_load(header["config"]))
    except Exception as err:  # noqa: BLE001 - a header whose config does not load is a bad log, whatever the cause
        raise LogError(f"{run_dir / LOG_NAME}: the logged config does not load ({err})") from None
    if config.zo.precondition == "features":  # see zo/feature_scale.py
        raise ConfigError("zofed replay cannot rebuild a zo.precondition=features run: its noise weights come from "
                          "forward passes whose sums depend on the device, BLAS and thread count, so a replay "
                          "would not perturb along the run's exact directions")
    final = run_dir / "final" / "trainable.safetensors"
    if not final.is_file():
        raise ConfigError(f"{run_dir} has no final/trainable.safetensors to check a replay against: the run has "
                          "not finished")
    checkpoint = find_checkpoint(run_dir / "checkpoint")
    trained = json.loads((checkpoint / "meta.json").read_text())["round"] if checkpoint is not None else None
    if trained is not None and trained != len(rounds):
        raise LogError(f"the uplink log holds {len(rounds)} rounds and the run {trained}: the log was switched off "
                       "(federation.log_uplinks) for part of the run")
    model, trainable, task = build_model(config, header["num_classes"], torch.device("cpu"))
    if tensors_sha256(trainable.tensors()) != header["start_sha256"]:
        raise LogError(f"the starting tensors rebuilt from {config.model.name} differ from the ones the run "
                       "logged: another model, or other weights under the same name")
    cache = prefix_cache(config, model, trainable, task)
    server = make_server(config, trainable, int(header["num_clients"]), cache.fraction if cache else 1.0)
    if server.dp_secret is not None:  # central DP: the log holds the numbers the aggregation read, noise included
        if not header.get("server_noised"):
            raise LogError(f"{run_dir / LOG_NAME} holds a private run's uplinks before the server's noise (written "
                           "by a zofed that drew the noise from the run seed): it cannot be replayed")
        server.replaying_noised_log = True
    count, traced = 0, []
    start = [t.clone() for t in server.tensors] if trace else []
    start_rms = [_rms(t) for t in start]  # read each round against the trace's starting point
    for logged in rounds:
        before = [t.clone() for t in server.tensors] if trace else []
        round_id = logged.round - 1
        local = server.round_plan(round_id)
        sampled = set(server.sample(round_id))
        for client_id, _ in logged.uplinks:
            if client_id not in sampled:
                raise LogError(f"round {logged.round}: client {client_id} was not sampled that round")
        for client_id in sorted(sampled):  # the method's state for each sampled client, as the run sent it
            server.send_state(local, client_id)
        inbox = RoundInbox()
        for client_id, data in logged.uplinks:
            server.receive(inbox, local, client_id, data)
        if inbox.rejected:
            raise LogError(f"round {logged.round}: logged uplinks the server refuses on replay: {inbox.rejected}")
        agreed = agreement([server.client_update(u, local) for u in inbox.accepted]) if trace else None
        server.aggregate(local, inbox)
        count += len(logged.uplinks)
        if trace:  # the iterate, not the tail average: the steps the server took
            traced.append(_trace(logged.round, trainable.names, start, start_rms, before, server.tensors, agreed))
    saved = load_file(str(final))
    replayed = {name: t.view_as(p) for name, t, p in zip(trainable.names, server.model_tensors(),
                                                          trainable.params, strict=True)}
    if set(saved) != set(replayed):
        raise LogError(f"final/ holds other tensors ({sorted(saved)[:3]}...) than the logged run trains")
    diff = max(float((saved[k].float() - replayed[k].float()).abs().max()) for k in saved) if saved else 0.0
    matches = all(torch.equal(saved[k], replayed[k].to(saved[k].dtype)) for k in saved)
    return Replay(len(rounds), count, head, matches, diff, final, tuple(traced))
