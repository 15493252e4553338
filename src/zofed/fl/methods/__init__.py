"""The registry of federated methods: one object per method, registered by name.

| method   | step seeds                              | uplink                        | server rebuild cost        |
|----------|-----------------------------------------|-------------------------------|----------------------------|
| zofed    | private; one block a step, drawn from   | base seed + one scalar a step | clients x steps blocks     |
|          | the client's own distribution           |                               |                            |
| zo-seeds | private, from (run seed, round, client) | base seed + one scalar a step | clients x steps directions |
| decomfl  | shared by every client of the round     | base seed + one scalar a step | steps directions (merged)  |
| hiso     | shared; along z / sqrt(K), K the global | base seed + one scalar a step | steps directions (merged)  |
|          | second moment (sent down each round)    |                               |                            |
| fedkseed | drawn from a fixed pool of K seeds      | seeds + one scalar a step     | at most K directions       |
| fedmezo  | private                                 | the dense update              | none (a weighted sum)      |
| fedavg   | none: back-propagation                  | the dense update              | none                       |
| fedadam  | none: back-propagation                  | the dense update              | none                       |

Adding a method: subclass `Method` (methods/base.py) in a new module, override what differs, and register an
instance here (`register_method`). docs/architecture.md walks through it.
"""

from __future__ import annotations

from zofed.fl.methods.base import Method, ServerDefault, StepSeeds
from zofed.fl.methods.decomfl import DeComFL
from zofed.fl.methods.fedkseed import FedKSeed, kseed_pool
from zofed.fl.methods.fedmezo import FedMeZO
from zofed.fl.methods.first_order import FedAdam, FedAvg
from zofed.fl.methods.hiso import HiSo
from zofed.fl.methods.zo_seeds import ZOSeeds
from zofed.fl.methods.zofed import Zofed

__all__ = ["Method", "ServerDefault", "StepSeeds", "get_method", "kseed_pool", "method_names", "register_method"]

_REGISTRY: dict[str, Method] = {}


def register_method(method: Method) -> Method:
    """Make `method` available by its name to configs, runners, backends and benchmarks."""
    if method.name in _REGISTRY:
        raise ValueError(f"a federated method named {method.name!r} is already registered")
    _REGISTRY[method.name] = method
    return method


def get_method(name: str) -> Method:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown federated method {name!r}; choose one of {', '.join(_REGISTRY)}") from None


def method_names(*, first_order: bool | None = None) -> tuple[str, ...]:
    """Registered method names, in registration order (zofed first); optionally only (non-)first-order ones."""
    return tuple(n for n, m in _REGISTRY.items() if first_order is None or m.first_order == first_order)


for _method in (Zofed(), ZOSeeds(), DeComFL(), HiSo(), FedKSeed(), FedMeZO(), FedAvg(), FedAdam()):
    register_method(_method)
