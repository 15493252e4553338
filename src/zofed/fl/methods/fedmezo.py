"""FedMeZO (FedZO with one query): MeZO local steps, the dense update uploaded.

The same local steps as zo-seeds, so the same model up to float rounding; the uplink is as large as the
trainable tensors. With `zo.queries > 1` every step averages q two-point estimates (FedZO's q-query form).
"""

from __future__ import annotations

from zofed.fl.methods.base import Method


class FedMeZO(Method):
    name = "fedmezo"
    summary = "MeZO local steps (q queries with zo.queries), the dense update uploaded, plain averaging"
    dense_uplink = True
