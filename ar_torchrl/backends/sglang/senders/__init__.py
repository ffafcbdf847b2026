"""The SGLang weight senders (``WeightSender`` implementations for :class:`SGLangBackend`).

:mod:`.base` (fan-out to every server, version and shape checks), :mod:`.disk`
(``/update_weights_from_disk``), :mod:`.tensor` (``/update_weights_from_tensor`` through shared
memory), :mod:`.distributed` (``/update_weights_from_distributed`` over a gloo/nccl group).
Senders are given a client; they never import it.
"""

from ar_torchrl.backends.sglang.senders.disk import DiskWeightSender
from ar_torchrl.backends.sglang.senders.distributed import DistributedWeightSender
from ar_torchrl.backends.sglang.senders.tensor import TensorWeightSender

__all__ = ["DiskWeightSender", "DistributedWeightSender", "TensorWeightSender"]
