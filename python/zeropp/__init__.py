"""zeropp: ZeRO++ communication for PyTorch, in Rust.

- ``zeropp.torch.fully_shard``: FSDP2's ``fully_shard`` with zeropp moving the
  bytes (qwZ quantized weight gather, hpZ node-local backward gather, qgZ
  two-hop quantized gradient reduce-scatter).
- ``zeropp.quant``: block quantization of your own tensors, in exactly the
  formats zeropp puts on the wire, and its error figures.
- ``zeropp.topology()`` / ``zeropp.routing_plan()``: what zeropp sees of this
  machine and how it would route a job of N nodes x G ranks.

``zeropp.torch`` needs PyTorch; the rest needs only numpy.
"""

import json

from . import quant
from ._zeropp import PeerError, ZeroppError, builtin_corpus
from ._zeropp import cuda_status as _cuda_status
from ._zeropp import routing_plan_json as _routing_plan_json
from ._zeropp import topology_json as _topology_json

__version__ = "0.1.0"
__all__ = [
    "PeerError",
    "ZeroppError",
    "builtin_corpus",
    "cuda_status",
    "quant",
    "routing_plan",
    "topology",
]


def topology(sysfs_root=None):
    """This machine as ``zeropp topo --json`` reports it (NUMA nodes, GPUs and
    the links between them, NICs), as a dict. ``sysfs_root``: a captured tree
    (``zeropp topo capture``) instead of this machine."""
    return json.loads(_topology_json(sysfs_root))


def routing_plan(nodes, ranks_per_node, sysfs_root=None):
    """The routing plan for ``nodes`` nodes like this machine with
    ``ranks_per_node`` ranks each (``zeropp topo plan --json``): the hops, the
    hpZ group, the bits per hop, the NIC of each rank, and why; and under
    ``run_switches`` the switches a run resolves from it (before the links
    it measures at join)."""
    return json.loads(_routing_plan_json(nodes, ranks_per_node, sysfs_root))


def cuda_status():
    """What this machine offers zeropp's CUDA path, as a dict: whether the
    NVIDIA driver loads (``driver``), how many devices it sees (``devices``),
    NCCL's version (``nccl``) or why it cannot be loaded (``nccl_error``)."""
    return json.loads(_cuda_status())
