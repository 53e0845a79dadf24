"""GPU check for PCR's host<->device KV transfers (run it when a CUDA machine is at hand).

1. Copy bandwidth: the Triton kernel that moves one layer of K and V between a
   token-indexed device pool and PCR's host chunk slots (scattered tokens, chunk slots out
   of order), host-to-device and device-to-host, against a plain ``copy_`` of one
   contiguous pinned buffer of the same size (the best case a copy engine reaches).
2. Exposed transfer time: a stack of attention layers with Llama-3-8B shapes and random
   weights prefills new tokens behind a cached prefix whose KV comes from host memory,
   and offloads the new tokens' KV back. Synchronous copies (load everything, compute,
   offload everything: ``--pcr-layerwise off``) against the layer-wise pipeline the
   server runs (:class:`~pcr_sglang.transfer.engine.TransferEngine`: loads on a side
   stream, layer i's attention waiting only for layer i; layer i's offload issued right
   after it is written, in the batch of its own request). Exposed time = run time minus
   compute-only time. The host chunks live where the server keeps them: a POSIX
   shared-memory pool registered with ``cudaHostRegister``
   (:class:`~pcr_sglang.tiers.host_pool.HostChunkPool`), not a ``pin_memory()`` buffer.
   With ``--doc`` > 0, the first ``--doc`` cached tokens are also a reused document:
   re-placed into private slots with K rotated by a position delta
   (:meth:`~pcr_sglang.transfer.engine.TransferEngine.replace`, the Triton rotation
   kernel), all at once after the whole load (synchronous) or layer by layer on a second
   side stream, each layer after that layer's load (layer-wise); checked against the
   torch rotation of the host rows.
3. Tickets: after a layer-wise run, how long until every host slot it touched reports
   ready (``host_slot_ready``, an event query: the scheduler never waits on it).

Without a GPU it runs a reduced version on the CPU (torch copy path, no streams) so the
script does not rot, and says so: those figures are not GPU figures.

Usage: python tests/gpu/gpu_transfer_check.py [--layers 32] [--prefix 4096] [--new 1024] [--doc 1024]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from pcr_sglang.tiers.host_pool import HostChunkPool
from pcr_sglang.tiers.layout import HostChunkLayout
from pcr_sglang.transfer.copy_kv import Direction, copy_layer
from pcr_sglang.transfer.engine import LayerwiseMode, TransferEngine
from pcr_sglang.transfer.rope_shift import RopeSpec, shift_keys_torch

# Llama-3-8B attention shapes.
HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 4096, 32, 8, 128


class Timer:
    def __init__(self, cuda: bool):
        self.cuda = cuda

    def run(self, fn, repeats: int) -> float:
        """Median seconds of ``fn()`` over ``repeats`` runs, after one warm-up."""
        fn()
        samples = []
        for _ in range(repeats):
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                samples.append(start.elapsed_time(end) / 1000)
            else:
                t = time.perf_counter()
                fn()
                samples.append(time.perf_counter() - t)
        return statistics.median(samples)


def host_buffer(num_bytes: int, cuda: bool) -> torch.Tensor:
    buf = torch.empty(num_bytes, dtype=torch.uint8)
    return buf.pin_memory() if cuda else buf


def bandwidth(args, device: str, timer: Timer) -> None:
    cuda = device == "cuda"
    dtype = torch.bfloat16
    row_bytes = KV_HEADS * HEAD_DIM * dtype.itemsize
    chunks = args.bw_chunks
    layout = HostChunkLayout(num_slots=chunks * 2, num_layers=1, chunk_size=args.chunk, row_bytes=row_bytes)
    pool_tokens = chunks * args.chunk * 2
    k = torch.randn(pool_tokens, KV_HEADS, HEAD_DIM, device=device).to(dtype)
    v = torch.randn_like(k)
    host = host_buffer(layout.total_bytes, cuda)
    token_slots = torch.randperm(pool_tokens, device=device)[: chunks * args.chunk]
    host_slots = torch.randperm(layout.num_slots, device=device)[:chunks]
    moved = 2 * chunks * args.chunk * row_bytes
    plain_host = host_buffer(moved, cuda)
    plain_dev = torch.empty(moved, dtype=torch.uint8, device=device)
    label = "kernel" if cuda else "torch path"
    print(f"\n[bandwidth] one layer of {chunks} chunks x {args.chunk} tokens, K+V = {moved / 2**20:.1f} MiB")
    for direction in Direction:
        t_kernel = timer.run(
            lambda: copy_layer(direction, k, v, host, token_slots, host_slots, 0, layout), args.repeats
        )
        if direction == Direction.HOST_TO_DEVICE:
            t_plain = timer.run(lambda: plain_dev.copy_(plain_host, non_blocking=True), args.repeats)
        else:
            t_plain = timer.run(lambda: plain_host.copy_(plain_dev, non_blocking=True), args.repeats)
        name = "host->device" if direction == Direction.HOST_TO_DEVICE else "device->host"
        print(
            f"  {name}: {label} {moved / t_kernel / 1e9:6.2f} GB/s, plain copy_ {moved / t_plain / 1e9:6.2f} GB/s "
            f"({label} at {100 * t_plain / t_kernel:.0f}% of plain)"
        )


class AttentionLayer(torch.nn.Module):
    def __init__(self, device, dtype):
        super().__init__()
        self.qkv = torch.nn.Linear(HIDDEN, (HEADS + 2 * KV_HEADS) * HEAD_DIM, bias=False, device=device, dtype=dtype)
        self.out = torch.nn.Linear(HEADS * HEAD_DIM, HIDDEN, bias=False, device=device, dtype=dtype)

    def forward(self, x, prefix_k, prefix_v):
        t = x.shape[0]
        q, k, v = self.qkv(x).split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)
        q = q.view(t, HEADS, HEAD_DIM).transpose(0, 1)
        k_new = k.view(t, KV_HEADS, HEAD_DIM)
        v_new = v.view(t, KV_HEADS, HEAD_DIM)
        keys = torch.cat([prefix_k, k_new]).transpose(0, 1).repeat_interleave(HEADS // KV_HEADS, 0)
        vals = torch.cat([prefix_v, v_new]).transpose(0, 1).repeat_interleave(HEADS // KV_HEADS, 0)
        # Causal over the new tokens, full visibility of the prefix.
        p = prefix_k.shape[0]
        mask = torch.ones(t, p + t, dtype=torch.bool, device=x.device).tril(diagonal=p)
        o = F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask)
        return x + self.out(o.transpose(0, 1).reshape(t, HEADS * HEAD_DIM)), k_new, v_new


def pipeline(args, device: str, timer: Timer) -> bool:
    cuda = device == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    layers = [AttentionLayer(device, dtype) for _ in range(args.layers)]
    row_bytes = KV_HEADS * HEAD_DIM * dtype.itemsize
    prefix_chunks = args.prefix // args.chunk
    new_chunks = args.new // args.chunk
    layout = HostChunkLayout(
        num_slots=prefix_chunks + new_chunks, num_layers=args.layers, chunk_size=args.chunk, row_bytes=row_bytes
    )
    pool = HostChunkPool(layout)  # the server's host tier: shared memory, registered on CUDA
    host = pool.buffer
    host.view(dtype).copy_(torch.randn(layout.total_bytes // dtype.itemsize, dtype=dtype))
    doc = min(args.doc, args.prefix)
    pool_tokens = args.prefix + args.new + doc
    k_pool = [torch.zeros(pool_tokens, KV_HEADS, HEAD_DIM, device=device, dtype=dtype) for _ in range(args.layers)]
    v_pool = [torch.zeros_like(k) for k in k_pool]
    prefix_slots = torch.arange(args.prefix, device=device)
    new_slots = torch.arange(args.prefix, args.prefix + args.new, device=device)
    # A reused document: the first ``doc`` cached tokens re-placed 1000 positions on
    # (Llama-3's RoPE base 500000), into private slots past the new tokens.
    doc_src = prefix_slots[:doc]
    doc_dst = torch.arange(args.prefix + args.new, pool_tokens, device=device)
    doc_delta = torch.full((doc,), 1000, dtype=torch.int64, device=device)
    rope = RopeSpec(HEAD_DIM, HEAD_DIM, True, tuple(500000.0 ** (-2 * i / HEAD_DIM) for i in range(HEAD_DIM // 2)))
    prefix_host = list(range(prefix_chunks))
    new_host = list(range(prefix_chunks, prefix_chunks + new_chunks))
    x0 = torch.randn(args.new, HIDDEN, device=device, dtype=dtype)
    kv_layers = list(zip(k_pool, v_pool))
    whole = TransferEngine(kv_layers, host, layout, LayerwiseMode.OFF)
    layered = TransferEngine(kv_layers, host, layout, LayerwiseMode.BOTH)

    def layer_compute(i, x):
        x, k_new, v_new = layers[i](x, k_pool[i][: args.prefix], v_pool[i][: args.prefix])
        k_pool[i][args.prefix : args.prefix + args.new] = k_new
        v_pool[i][args.prefix : args.prefix + args.new] = v_new
        return x

    def compute_only():
        x = x0
        for i in range(args.layers):
            x = layer_compute(i, x)

    def synchronous():
        whole.load(prefix_slots, prefix_host)
        if doc:
            whole.replace(doc_src, doc_dst, doc_delta, rope)
        compute_only()
        whole.copy_to_host(new_slots, new_host)

    def layerwise(seen: list | None = None):
        # What the server does: admission submits the load, prepare_for_extend plans the
        # request's offloads, run_batch starts them, and the KV pool's hooks drive each layer.
        # ``seen``: the document's private rows as the forward's stream sees them at layer i.
        layered.load(prefix_slots, prefix_host)
        if doc:
            layered.replace(doc_src, doc_dst, doc_delta, rope)
        for c, slot in enumerate(new_host):
            layered.plan_offload("bench", new_slots[c * args.chunk : (c + 1) * args.chunk], slot)
        layered.begin_batch(["bench"])
        layered.note_forward_stream()
        x = x0
        for i in range(args.layers):
            layered.wait_until(i)
            if seen is not None and doc:
                seen.append((k_pool[i][doc_dst].clone(), v_pool[i][doc_dst].clone()))
            x = layer_compute(i, x)
            layered.on_layer_written(i)
        layered.end_batch()

    host_view = host.view(layout.shape)

    def document_rows_ok(layer: int, k_rows: torch.Tensor, v_rows: torch.Tensor) -> bool:
        """The document's private rows of ``layer`` hold its host rows re-placed: V
        exact, K equal to the torch rotation up to bf16 rounding."""
        host_k, host_v = (
            host_view[:prefix_chunks, layer, kv]
            .reshape(args.prefix, -1)[:doc]
            .contiguous()
            .view(dtype)
            .view(doc, KV_HEADS, HEAD_DIM)
            .to(device)
            for kv in (0, 1)
        )
        want_k = shift_keys_torch(host_k, doc_delta, rope)
        return torch.allclose(k_rows.float(), want_k.float(), atol=2e-2, rtol=2e-2) and torch.equal(v_rows, host_v)

    def synchronous_is_correct() -> bool:
        for pool in k_pool + v_pool:
            pool.zero_()
        synchronous()
        if cuda:
            torch.cuda.synchronize()
        return all(document_rows_ok(i, k_pool[i][doc_dst], v_pool[i][doc_dst]) for i in range(args.layers))

    def layerwise_is_correct() -> bool:
        """After a layer-wise run: the prefix rows equal their host chunks and the new
        rows were offloaded to theirs, byte for byte, in every layer; the document's
        private rows were re-placed from the loaded rows by the time the forward's stream
        passed layer i's wait (checked on what that stream read then)."""
        for pool in k_pool + v_pool:
            pool.zero_()
        seen: list = []
        layerwise(seen)
        if cuda:
            torch.cuda.synchronize()
        for i in range(args.layers):
            for kv, pool in ((0, k_pool), (1, v_pool)):
                rows = pool[i].view(torch.uint8).reshape(pool_tokens, row_bytes).cpu()
                if not torch.equal(rows[: args.prefix], host_view[:prefix_chunks, i, kv].reshape(args.prefix, -1)):
                    return False
                if not torch.equal(
                    rows[args.prefix : args.prefix + args.new], host_view[prefix_chunks:, i, kv].reshape(args.new, -1)
                ):
                    return False
            if doc and not document_rows_ok(i, *seen[i]):
                return False
        return True

    correct = layerwise_is_correct()
    sync_correct = not doc or synchronous_is_correct()
    t_compute = timer.run(compute_only, args.repeats)
    t_sync = timer.run(synchronous, args.repeats)
    t_layer = timer.run(layerwise, args.repeats)
    # Tickets: launch one more layer-wise run and poll its host slots without blocking.
    layerwise()
    start, polls = time.perf_counter(), 0
    while not all(layered.host_slot_ready(s) for s in prefix_host + new_host):
        polls += 1
    t_ready = time.perf_counter() - start
    moved = layout.layer_bytes * (prefix_chunks + new_chunks) * args.layers / 2
    print(
        f"\n[pipeline] {args.layers} layers, {args.prefix} cached + {args.new} new tokens, "
        f"{moved / 2**20:.0f} MiB moved per forward, {doc} cached tokens re-placed as a reused document"
    )
    print(f"  compute only      {t_compute * 1000:8.2f} ms")
    print(f"  synchronous       {t_sync * 1000:8.2f} ms  (exposed transfer {1000 * (t_sync - t_compute):7.2f} ms)")
    print(f"  layer-wise        {t_layer * 1000:8.2f} ms  (exposed transfer {1000 * (t_layer - t_compute):7.2f} ms)")
    print(
        f"  layer-wise copies byte-exact in every layer, the document re-placed before each layer's "
        f"read: {correct}; synchronous re-placement right: {sync_correct}"
    )
    print(f"  host slots ready {t_ready * 1000:.2f} ms after the run was launched ({polls} event polls)")
    pool.close()
    return correct and sync_correct


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--prefix", type=int, default=4096, help="cached tokens loaded from host")
    parser.add_argument("--new", type=int, default=1024, help="new tokens computed and offloaded")
    parser.add_argument("--doc", type=int, default=1024, help="cached tokens also re-placed (document reuse)")
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--bw-chunks", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    if cuda:
        print(f"GPU: {torch.cuda.get_device_name()}")
    else:
        print(
            "No GPU found: running a reduced CPU version (torch copy path, no side streams). These are not GPU figures."
        )
        args.layers, args.prefix, args.new = min(args.layers, 2), min(args.prefix, 512), min(args.new, 256)
        args.doc = min(args.doc, 128)
        args.bw_chunks, args.repeats = min(args.bw_chunks, 16), min(args.repeats, 3)
        args.chunk = min(args.chunk, 64)
    timer = Timer(cuda)
    bandwidth(args, device, timer)
    if not pipeline(args, device, timer):
        print("WRONG DATA: a layer-wise copy or a re-placement did not land as expected")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
