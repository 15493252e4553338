"""zo-seeds: plain ZO averaging. MeZO local steps on private seeds, reported as a base seed and one scalar a
step; the server rebuilds clients x steps directions and averages them."""

from __future__ import annotations

from zofed.fl.methods.base import Method


class ZOSeeds(Method):
    name = "zo-seeds"
    summary = "MeZO local steps on private seeds; base seed and one scalar a step uploaded; plain averaging"
