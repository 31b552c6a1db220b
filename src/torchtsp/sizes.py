"""Sizes the runtime works in that the analytic models (analysis/, torch-free) predict memory from: each is
defined here once, beside the reason for its value, and imported by both sides (torch-free)."""

# Keys per block of the block-wise attention kernels (kernels.py: the portable kernel and ``masked_attention``,
# which every KV-cache read goes through): bounds a score buffer to [queries, KEY_BLOCK] however long the cache,
# while a block stays large enough for one matrix product to dominate its loop step.
KEY_BLOCK = 1024

# ZeRO-2 (train/zero.py): reduce-scatters in flight before the oldest is waited for and its float32 bucket freed.
# Two keep the network busy while backward fills the next bucket; each more holds one more bucket of gradient.
ZERO_IN_FLIGHT = 2
