"""MoePlan: how one forward's MoE layers reach their experts, a value the runner builds and
model.forward carries to DeviceOps.moe (the ops hold no expert store).

A decode step (T <= GEMV_MAX_T) reads every expert through the layer's row of the expert table, a
device array the weights already point at; its plan says only where the step's routing goes (the
routing log the runner reads back for the cache's admissions) and, when misses are staged, the
function that copies a layer's misses and returns the table row to read instead. A prompt chunk's
plan says whether its batches depend on the routing (all experts resident, or a chunk that streams
every non-cached expert in a fixed order: the routing may then be grouped on the device) and gives
the function that hands out each layer's experts batch by batch: for a streamed chunk, the prompt
ring's batches of that chunk, each yielded once the compute stream waits for its copies (the
caller queues a batch's kernels before asking for the next). A prompt chunk's plan may also give the
host's share of its missed experts (`host`, --cpu-experts: strata.engine.experts.host_compute's
ChunkSplit): `may_take(layer)` says whether the host may take any of layer's experts (else the
layer runs as without it, its routing left on the device), `choose(layer, ids)` names the experts
the host computes from the routing on the host, `start(layer, experts, x, ids, weights)` starts
them and returns a wait() that gives the device address of their weighted sum [T, D] (mapped
pinned memory), which the combine adds in. A split decode step's plan (strata.engine.cuda_decode,
run eagerly) carries the decode form of it (host_compute.DecodeStepSplit): `choose(layer, ids)` gives
the host's experts and a cached expert the GPU reads in their slots with weight 0, `start` as above;
moe_decode_split adds the host's sum to the fused kernels' output.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np

# (layer, ascending active expert ids) -> (experts, blob addresses) batches covering them
Batches = Callable[[int, list], Iterator[tuple[list, list]]]
# (layer, the step's routing at that layer on the host) -> device address of the table row to read
Stage = Callable[[int, np.ndarray], int]


@dataclass(frozen=True)
class MoePlan:
    """What DeviceOps.moe reads of the experts in one forward (see the module doc)."""
    resident: bool = True               # every expert in VRAM
    stream_all: bool = False            # a prompt chunk streaming every non-cached expert, in a fixed order
    batches: Batches | None = None      # a prompt chunk's experts, batch by batch
    stage: Stage | None = None          # decode misses staged (routing read on the host per layer)
    route_log: int = 0                  # device int32 [layers, GEMV_MAX_T * A]: a step's routing; 0 for none
    host: object = None                 # the host's share of a chunk or a split decode step (module doc)

    @property
    def routing_free(self) -> bool:
        """The batches do not depend on the routing, so the prompt path may group it on the device."""
        return self.resident or self.stream_all


RESIDENT = MoePlan()
