"""A client's compute in a round, in forward passes of the full model: one rule for ZO and first-order clients.

- A pass through part of the model counts its share of a full pass (the plan's `pass_fraction`,
  `backward_fraction` and `head_fraction`, measured from the model's weights by zo/prefix.py).
- A ZO step: the capture pass over the frozen bottom, then its perturbed passes over the top (`forward_equivalents`).
- A first-order step: one full forward, and a backward worth twice the forward of the part it runs through (from
  the lowest trainable tensor to the output: for LoRA, the activation gradients down to the lowest adapter and
  the adapters' weight gradients).
- Steps on cached features (every block frozen, the label head trains): the body runs once a round over the
  cached examples, a pass per batch, and each step costs what it runs on the head: its passes (ZO: 2q central or
  q + 1 one-sided; first-order: a forward and a backward, 3) times the head's share.
- Steps on a round's cached prefixes (a ZO client whose model is split; federation.cached_examples): the frozen
  bottom runs once a round over the cached examples, its share of a pass per batch, and each step costs its
  perturbed passes over the top.
- A ZO step whose perturbation moves only some of the trainable tensors (zofed's block sampling) runs its first
  pass from the lowest trainable block and the others from the block of the lowest tensor it moved (the share
  `tensor_pass_shares` gives that tensor): the blocks below it give what they gave the first pass. A step that
  moves every trainable tensor is charged as before. The server knows each step's drawn tensors from the seeds
  and the distribution it sent, so it charges every client what its draws ran (`Method.client_passes`).
- Where a client's steps carry the top blocks' outputs from step to step (`carries_outputs`: every step runs the
  round's whole cached batch and moves only the tensors it perturbed), a step's first pass reruns only the blocks
  from the lowest one changed since the last pass: the block the previous step moved (the lowest trainable block
  at a round's first step) or, for the central estimate, the block this step perturbs, whichever lies lower.

benchmarks/cost_model.py times each kind of step against a full forward pass and writes the measured ratios
beside these (docs/results/cost_model.md).
"""

from __future__ import annotations

from collections.abc import Sequence

from zofed.fl.plan import LocalTraining
from zofed.zo.prefix import zo_passes

FIRST_ORDER_HEAD_PASSES = 3  # a forward and a backward worth two


def first_order_step(backward_fraction: float) -> float:
    """One back-propagation step: a full forward pass plus a backward through `backward_fraction` of it."""
    return 1.0 + 2.0 * backward_fraction


def head_step(head_fraction: float, first_order: bool, queries: int, estimator: str) -> float:
    """One step on cached features: the passes it makes over the label head, at the head's share of a full pass
    (a per-position share, which overcounts such a step: zo/prefix.py's `head_fraction`)."""
    passes = FIRST_ORDER_HEAD_PASSES if first_order else zo_passes(queries, estimator)
    return passes * head_fraction


def carries_outputs(local: LocalTraining) -> bool:
    """Whether a client's steps keep the top blocks' outputs from one step to the next (`RoundPrefixes.step_loss`):
    ZO steps on a round's cached prefixes whose batch is all the round's examples, each moving only the tensors it
    perturbed (MeZO's update lies along its perturbation, a tilted one too: the tilt leans within the drawn block;
    a stateful optimizer moves every tensor)."""
    return (local.feature_cache > 0 and 0.0 < local.pass_fraction < 1.0 and local.batch_size >= local.feature_cache
            and local.optimizer == "mezo")


def step_passes(local: LocalTraining, first_order: bool, share: float | None = None,
                previous: float | None = None) -> float:
    """One local step's compute in full forward passes (without the round's pass over cached features); `share`:
    the share of a pass from the lowest tensor the step moved up (None: every trainable tensor moved); `previous`:
    where the steps carry their outputs (`carries_outputs`), the share the step before moved (None: its first pass
    runs from the lowest trainable block)."""
    if local.feature_cache and local.pass_fraction == 0.0:  # every block frozen: the steps run the head
        return head_step(local.head_fraction, first_order, local.queries, local.estimator)
    if local.feature_cache:
        if first_order:
            raise ValueError("a round's cached prefixes serve ZO steps; a first-order step runs its own batch")
        return _zo_step(local, share, bottom=0.0, previous=previous)
    if first_order:
        return first_order_step(local.backward_fraction)
    return _zo_step(local, share, bottom=1.0 - local.pass_fraction)


def _moved(local: LocalTraining, share: float | None) -> float:
    """The share of a pass from the lowest tensor a step moved (the whole top when it moved every tensor)."""
    top = local.pass_fraction
    return top if share is None or top >= 1.0 else min(share, top)


def _zo_step(local: LocalTraining, share: float | None, bottom: float, previous: float | None = None) -> float:
    """The frozen bottom's share when each step runs it (`bottom`), one pass from the lowest block changed since the
    last pass, the other passes from the moved tensor's block (whole passes when nothing is cached: pass_fraction
    1). Without carried outputs (`previous` None) the first pass runs from the lowest trainable block; with them
    the centre pass of the one-sided estimate runs from what the previous step moved, and the first perturbed pass
    of the central one from the lower of that and what this step moves."""
    top, passes, moved = local.pass_fraction, zo_passes(local.queries, local.estimator), _moved(local, share)
    if previous is None:  # a new batch: from the lowest trainable block
        previous = top
    first = previous if local.estimator == "forward" else max(previous, moved)
    return bottom + first + (passes - 1) * moved


def round_passes(local: LocalTraining, first_order: bool, shares: Sequence[float] | None = None) -> float:
    """One client's compute in a round: its local steps, plus, with cached features or prefixes, the frozen part's
    pass over the round's `feature_cache` examples in batches (`feature_cache / batch_size` passes of its share).
    `shares`: each step's share from the lowest tensor it moved (`step_passes`); None: every step moved all."""
    body = local.feature_cache / local.batch_size * (1.0 - local.pass_fraction) if local.feature_cache else 0.0
    if shares is None:
        return body + local.local_steps * step_passes(local, first_order)
    if len(shares) != local.local_steps:
        raise ValueError(f"{len(shares)} step shares for a round of {local.local_steps} local steps")
    carried = not first_order and carries_outputs(local)
    total, previous = body, None  # a round's first step finds no outputs kept
    for share in shares:
        total += step_passes(local, first_order, share, previous)
        previous = _moved(local, share) if carried else None
    return total
