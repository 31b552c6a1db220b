"""TSP: tensor and sequence parallelism folded onto one mesh axis (see docs/design.md).

Every rank p of the ``tsp`` axis (size D) holds 1/D of every weight and 1/D of the tokens
(zigzag layout). Weights move, activations stay:

* attention: each rank's packed (wq, wk, wv, wo) head-group shard is broadcast in turn;
  all ranks project their own tokens with it, all-gather that group's K/V, attend, and
  accumulate the output projection locally;
* gated MLP, embedding, LM head: packed shards travel around a ring (p -> p+1), and each
  rank applies every passing shard to its own tokens;
* backward re-communicates the weights (and K/V) instead of saving them, so autograd
  never holds more than local-token tensors. Attention weight gradients are reduced to
  their owner; ring gradients travel with the shard and arrive home after D hops.

Activations (the ``recompute`` flag, as for every scheme): by default each block saves the
activations of its local tokens, all 1/D-sized: per head group the queries, local K/V,
attention output and log-sum-exp; per FFN shard the gate and up projections. Backward
then moves weights and K/V again but recomputes no GEMM. ``recompute=True`` keeps each
layer's input only and re-runs the layer's forward, transfers included, in backward; the MLP's
part of that re-run happens inside its backward ring (each passing shard's gate and up are
projected again there), so its weights go around once in backward, not twice, and the down
projection, whose output the re-run would discard, is not repeated.

Overlap: weights (and their gradient reductions) travel on a second process group of the
same ranks (``comm.weights``), activations, K/V and travelling gradients on the first, so
on a GPU (NCCL runs one group's collectives in issue order) a weight prefetch never
delays the K/V gather the current step waits for. On each group, transfers are issued in
the order they are waited on. The next shard is always requested before the current one
is used (attention in training keeps two shards and two head groups' K/V in flight ahead
of the one in use, since each transfer is a meeting point of every rank: the slack lets a
rank that fell behind catch up before the others wait for it), and the next layer's first
attention shard is broadcast while the current layer's MLP runs. Norm weights' gradients
are summed in one all-reduce at the end of a backward pass.

bf16/fp16 runs accumulate partial sums in float32: outputs over head groups and shards,
input gradients, travelling gradients and the gradient reductions (sent in float32).
No step synchronises host and device (no ``.item()``, ``nonzero`` or boolean-mask indexing).
"""

from .model import TSPLayer, TSPTransformer
from .moe import TSPMoE
from .shard_math import TSPShardMath
from .streams import broadcast_each, ring_each

__all__ = ["TSPLayer", "TSPMoE", "TSPShardMath", "TSPTransformer", "broadcast_each", "ring_each"]

from ...lazy import submodule_getattr

__getattr__ = submodule_getattr(__name__)  # submodules as attributes on first use
