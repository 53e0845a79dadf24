"""Byte stores below the device KV pool, without tree knowledge: the host chunk pool
(shared memory, pinned on CUDA) and the SSD chunk store."""
