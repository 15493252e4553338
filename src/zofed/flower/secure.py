"""Secure aggregation on Flower (`flower.secure_aggregation: true`): the server learns only the round's sum.

In a round whose clients share their step seeds and whose server needs nothing but the example-weighted mean of
their scalars (DeComFL, HiSo: `Method.sum_suffices`), one client's scalars say nothing the server must see. The
ServerApp then runs the round through Flower's SecAgg+ (`SecAggPlusWorkflow`) and every ClientApp answers through
Flower's `secaggplus_mod`: each client's scalars leave it quantized and masked, and the masks cancel only in
the sum. The server turns the mean it unmasks into one uplink under the round's shared seeds (`summed_uplink`),
which the server role receives, logs and aggregates like any other, so the model is the plain round's up to the
quantization of SecAgg+ (a step of 2 x `flower.secagg_range` / 2^22 on each scalar).

What travels in the clear: each client's id, example count and train loss, and its uplink's header with the
scalars zeroed (so the server can check the round, the seeds and the shapes). Under local DP the uplink already
holds no train loss and the public example count 1 (fl/privacy.py), so neither says anything of the client. A
scalar outside +-`flower.secagg_range` is clipped to it by the client, counted in the round record's
`secagg_clipped`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp.typing import ClientAppCallable
from flwr.common import Code, FitIns, FitRes, Parameters, Status, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS
from flwr.compat.common import recorddict_compat as compat
from flwr.server.compat.grid_client_proxy import GridClientProxy
from flwr.server.compat.legacy_context import LegacyContext
from flwr.server.strategy import FedAvg
from flwr.server.workflow import SecAggPlusWorkflow
from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD, Key
from flwr.serverapp import Grid

from zofed.flower.messages import flower_nbytes

# zofed.fl (and torch with it) is imported where it is used: a ClientApp answering a partition query must not pay
# for it (flower/client.py).

QUANTIZATION_LEVELS = 2**22  # SecAgg+'s default quantization range: each scalar becomes one of these levels
FITINS_KEYS = ("zofed-downlink", "client-id", "round")


def secure_mod(message: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """Flower's SecAgg+ client mod for the messages of a secure round; every other message passes untouched."""
    if RECORD_KEY_CONFIGS in message.content.config_records:
        from flwr.client.mod import secaggplus_mod

        return secaggplus_mod(message, context, call_next)
    return call_next(message, context)


def is_secure_train(message: Message) -> bool:
    return "fitins.config" in message.content.config_records


def read_secure_train(message: Message) -> tuple[bytes, int, int, float]:
    """(downlink, client id, round, scalar range) of a secure round's train message; ValueError if malformed."""
    config = compat.recorddict_to_fitins(message.content, keep_input=True).config
    missing = [k for k in (*FITINS_KEYS, "secagg-range") if k not in config]
    if missing:
        raise ValueError(f"a secure zofed train message lacks {', '.join(missing)}")
    if not isinstance(config["zofed-downlink"], bytes):
        raise ValueError("a secure zofed train message carries its downlink as bytes")
    return (config["zofed-downlink"], int(config["client-id"]), int(config["round"]),
            float(config["secagg-range"]))


def secure_reply(message: Message, uplink: bytes, scalar_range: float) -> Message:
    """The client's reply in the layout `secaggplus_mod` masks: its scalars as the parameters (the mod quantizes,
    masks and removes them), everything else in the clear."""
    from zofed.fl.protocol import ClientUpdate, decode, encode

    update = decode(uplink)
    if not isinstance(update, ClientUpdate) or update.dense is not None:
        raise ValueError("secure aggregation sums seed-and-scalar uplinks; this client produced another kind")
    clipped = int(np.count_nonzero(np.abs(update.grads) > scalar_range))
    scalars = np.clip(update.grads.astype(np.float64), -scalar_range, scalar_range)
    header = encode(update.with_numbers(np.zeros_like(update.grads)))
    metrics = {"client-id": update.client_id, "header": header, "clipped": clipped,
               "train-loss": float(update.metrics.get("train_loss", float("nan")))}
    fitres = FitRes(Status(Code.OK, ""), ndarrays_to_parameters([scalars]), update.num_examples, metrics)
    return Message(compat.fitres_to_recorddict(fitres, keep_input=True), reply_to=message)


class CountingGrid:
    """A Grid that counts the Flower bytes of every message it sends and of every reply it receives."""

    def __init__(self, grid: Grid) -> None:
        self.grid, self.down, self.up = grid, 0, 0

    def send_and_receive(self, messages: Sequence[Message], *, timeout: float | None = None) -> list[Message]:
        messages = list(messages)
        self.down += sum(flower_nbytes(m) for m in messages)
        replies = list(self.grid.send_and_receive(messages, timeout=timeout))
        self.up += sum(flower_nbytes(r) for r in replies if not r.has_error())
        return replies

    def __getattr__(self, name: str) -> Any:
        return getattr(self.grid, name)


class _OneRound(FedAvg):
    """The legacy strategy SecAgg+'s workflow asks for: it hands out this round's downlinks and keeps the
    results the workflow passes on with the unmasked mean in place of each client's parameters."""

    def __init__(self, fitins: dict[int, FitIns], grid: Any) -> None:
        super().__init__()
        self.fitins, self.grid = fitins, grid
        self.results: list[tuple[int, FitRes]] | None = None
        self.failures: list[Any] = []

    def configure_fit(self, server_round: int, parameters: Parameters, client_manager: Any) -> list:
        return [(GridClientProxy(node, self.grid, 0), ins) for node, ins in self.fitins.items()]

    def aggregate_fit(self, server_round: int, results: list, failures: list) -> tuple[None, dict]:
        self.results = [(proxy.node_id, res) for proxy, res in results]
        self.failures = list(failures)
        return None, {}


@dataclass
class SecureRound:
    """What one secure round moved: the summed uplink's parts, and the bytes Flower carried for it."""

    replies: dict[int, Any]  # client id -> the summed uplink's bytes, Summed into it, or a Failure
    clipped: int
    flower_bytes_up: int
    flower_bytes_down: int


def secure_deliver(grid: Grid, round_id: int, downlinks: Sequence[tuple[int, bytes]],
                   client_node: dict[int, int], scalar_range: float, max_examples: int,
                   timeout: float, max_uplink_bytes: int = 64 * 2**20) -> SecureRound:
    """Run one round's messages through SecAgg+; the lowest contributing client id carries the summed uplink,
    the other contributors are `Summed` into it, and a client left out of the sum is a `Failure`. A clear part
    longer than `max_uplink_bytes` (the round plan's bound, protocol.uplink_max_bytes) is refused unread."""
    from zofed.fl.protocol import decode
    from zofed.fl.rounds import Failure, Summed

    counting = CountingGrid(grid)
    fitins = {client_node[c]: FitIns(Parameters([], ""), {"zofed-downlink": d, "client-id": c, "round": round_id,
                                                          "secagg-range": scalar_range})
              for c, d in downlinks}
    strategy = _OneRound(fitins=fitins, grid=counting)
    state = RecordDict({MAIN_CONFIGS_RECORD: ConfigRecord({Key.CURRENT_ROUND: round_id + 1}),
                        MAIN_PARAMS_RECORD: compat.parameters_to_arrayrecord(Parameters([], ""), True)})
    context = LegacyContext(Context(run_id=0, node_id=0, node_config={}, state=state, run_config={}),
                            strategy=strategy)
    workflow = SecAggPlusWorkflow(num_shares=1.0, reconstruction_threshold=0.5, max_weight=float(max_examples),
                                  clipping_range=scalar_range, quantization_range=QUANTIZATION_LEVELS,
                                  timeout=timeout)
    workflow(counting, context)
    node_client = {n: c for c, n in client_node.items()}
    replies: dict[int, Any] = {}
    clipped = 0
    if strategy.results:
        parts = sorted(((node_client[node], res) for node, res in strategy.results), key=lambda part: part[0])
        try:
            mean = np.asarray(parameters_to_ndarrays(parts[0][1].parameters)[0], np.float64)
            headers = [decode(res.metrics["header"], expect_round=round_id, max_bytes=max_uplink_bytes)
                       for _, res in parts]
            losses = [float(res.metrics["train-loss"]) for _, res in parts]
            clipped = sum(int(res.metrics["clipped"]) for _, res in parts)
            uplink = summed_uplink(headers, [c for c, _ in parts], mean, losses)
        except (ValueError, KeyError, TypeError, IndexError) as err:
            # one bad clear part spoils the sum: it cannot be taken apart again
            replies.update({c: Failure(f"bad_reply: the round's secure sum cannot be checked: {err}")
                            for c, _ in parts})
        else:
            carrier = parts[0][0]
            replies[carrier] = uplink
            replies.update({c: Summed(carrier) for c, _ in parts[1:]})
    reason = "secure aggregation left this client out (no reply, an error, or too few shares to unmask)"
    for c, _ in downlinks:
        replies.setdefault(c, Failure(f"client_error: {reason}"))
    return SecureRound(replies, clipped, counting.up, counting.down)


def summed_uplink(headers: Sequence[Any], clients: Sequence[int], mean: np.ndarray,
                  losses: Sequence[float]) -> bytes:
    """One uplink carrying the round's example-weighted mean of scalars under the clients' shared seeds, with
    the clients' summed example count: the server's weighted mean of it alone is the round's mean."""
    from zofed.fl.protocol import ClientUpdate, encode

    first = headers[0]
    for client, header in zip(clients, headers, strict=True):
        if not isinstance(header, ClientUpdate) or header.client_id != client:
            raise ValueError(f"client {client}'s secure reply carries another client's header")
        if header.base_seed != first.base_seed or not np.array_equal(header.seeds, first.seeds) \
                or header.grads.shape != first.grads.shape:
            raise ValueError("secure aggregation needs the round's clients to share their step seeds and shapes")
    if mean.shape != first.grads.shape:
        raise ValueError(f"the unmasked sum has shape {mean.shape}, the uplinks {first.grads.shape}")
    finite = [x for x in losses if np.isfinite(x)]
    metrics = {"train_loss": float(np.mean(finite))} if finite else {}
    total = sum(h.num_examples for h in headers)
    return encode(ClientUpdate(first.round_id, first.client_id, first.seeds, first.base_seed,
                               mean.astype(np.float32), total, metrics))
