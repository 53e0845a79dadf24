"""A step with permuted rows sends its positions and indices to the device without a
scheduler-thread wait: through one pinned ring (non-blocking copies), and no host read of a
tensor. Checked on CPU by what the code calls: the ring runs on the recording stand-in for
``torch.cuda`` (tests/unit/transfer/cuda_recorder.py), which records pinned allocations,
copies and host reads. Nothing here ran on a GPU."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pcr_sglang.reuse import rows as permuted_rows
from pcr_sglang.reuse.forward_plan import ForwardPlans
from pcr_sglang.reuse.rows import triton_position_mask
from pcr_sglang.transfer.staging import PinnedStaging
from tests.unit.transfer.cuda_recorder import HostTraffic, RecordingCuda


class Batch(SimpleNamespace):
    """A stand-in for SGLang's ``ScheduleBatch`` (weakly referenceable, as it is)."""


def _bind(plans, forward, batch, rows):
    plans.prepared(batch, rows)
    return plans.bind(forward, batch)


@pytest.fixture
def staged(monkeypatch):
    """``rows.to_device`` as on CUDA: the pinned ring, here on the recording stand-in."""
    cuda = RecordingCuda()
    staging = PinnedStaging(torch.device("cpu"), cuda.pin, cuda.Event, capacity=256)
    calls = []

    def to_device(values, device):
        calls.append(values.numel())
        return staging.to_device(values)

    monkeypatch.setattr(permuted_rows, "to_device", to_device)
    return cuda, calls


def test_on_cuda_host_values_go_through_the_pinned_ring(monkeypatch):
    seen = []
    monkeypatch.setattr(
        permuted_rows,
        "_staging",
        lambda device: SimpleNamespace(to_device=lambda values: seen.append((device, values.tolist())) or values),
    )
    permuted_rows.to_device(torch.tensor([3, 1]), torch.device("cuda", 0))
    assert seen == [(torch.device("cuda", 0), [3, 1])]
    assert permuted_rows.to_device(torch.tensor([2]), torch.device("cpu")).tolist() == [2] and len(seen) == 1


def test_a_step_with_permuted_rows_waits_for_nothing_and_allocates_no_pinned_memory(staged):
    cuda, calls = staged
    mode = SimpleNamespace(is_extend=lambda: True)
    forward = SimpleNamespace(
        positions=torch.zeros(3 + 6, dtype=torch.int32),
        forward_mode=mode,
        extend_prefix_lens_cpu=[4, 2],
        extend_seq_lens_cpu=[3, 6],
        seq_lens_cpu=[7, 8],
    )
    order = torch.tensor([0, 1, 5, 4, 3, 2, 6, 7])
    reqs = [SimpleNamespace(kv=SimpleNamespace(req_pool_idx=7)), SimpleNamespace(kv=SimpleNamespace(req_pool_idx=3))]
    plans = ForwardPlans()
    pinned = len(cuda.pinned)
    traffic = HostTraffic(cuda)
    with traffic:
        for _ in range(3):  # three steps: the ring is reused, nothing new is pinned
            plan = _bind(plans, forward, Batch(reqs=reqs), {1: order})
            mask, indptr = triton_position_mask({1: plan.bound[1][1]}, [7, 8], [4, 2], torch.device("cpu"))
    assert traffic.host_reads == [] and cuda.synchronizations == 0
    assert len(cuda.pinned) == pinned
    staged_copies = [c for c in traffic.copies if c[2]]
    assert len(staged_copies) == len(calls) == 6 and all(non_blocking for _, non_blocking, _ in staged_copies)
    assert forward.positions.tolist() == [0, 0, 0, 5, 4, 3, 2, 6, 7]
    assert indptr.tolist() == [0, 3 * 7, 3 * 7 + 6 * 8]


def _forward_without_companions():
    """A forward whose ``*_cpu`` companions are unset: only the (device) length tensors."""
    mode = SimpleNamespace(is_extend=lambda: True, is_target_verify=lambda: False)
    return SimpleNamespace(
        positions=torch.zeros(3 + 6, dtype=torch.int32),
        forward_mode=mode,
        extend_prefix_lens=torch.tensor([4, 2]),
        extend_seq_lens=torch.tensor([3, 6]),
        seq_lens=torch.tensor([7, 8]),
        extend_prefix_lens_cpu=None,
        extend_seq_lens_cpu=None,
        seq_lens_cpu=None,
    )


def test_without_sglangs_host_companions_the_lengths_come_from_the_batch_and_nothing_waits(staged):
    """SGLang leaves ``extend_seq_lens_cpu``/``seq_lens_cpu`` unset on some paths: the step
    then takes the batch's own host lists, never ``.tolist()`` of the device tensors (a wait
    for the forward in flight), in the positions and in the Triton mask alike."""
    cuda, _ = staged
    forward = _forward_without_companions()
    order = torch.tensor([0, 1, 5, 4, 3, 2, 6, 7])
    reqs = [SimpleNamespace(kv=SimpleNamespace(req_pool_idx=7)), SimpleNamespace(kv=SimpleNamespace(req_pool_idx=3))]
    batch = Batch(reqs=reqs, prefix_lens=[4, 2], extend_lens=[3, 6])
    plans = ForwardPlans()
    backend = SimpleNamespace(forward_metadata=SimpleNamespace(custom_mask=None, mask_indptr=None))
    traffic = HostTraffic(cuda)
    with traffic:
        plan = _bind(plans, forward, batch, {1: order})
        assert permuted_rows.set_triton_position_mask(backend, forward, {1: plan.bound[1][1]}, plan, plans)
    assert traffic.host_reads == [] and cuda.synchronizations == 0 and plans.host_waits == 0
    assert forward.positions.tolist() == [0, 0, 0, 5, 4, 3, 2, 6, 7]
    assert backend.forward_metadata.mask_indptr.tolist() == [0, 3 * 7, 3 * 7 + 6 * 8]


def test_a_length_with_no_host_copy_anywhere_is_read_from_the_device_counted(staged, caplog):
    forward = _forward_without_companions()
    order = torch.tensor([0, 1, 5, 4, 3, 2, 6, 7])
    reqs = [SimpleNamespace(kv=SimpleNamespace(req_pool_idx=7)), SimpleNamespace(kv=SimpleNamespace(req_pool_idx=3))]
    plans = ForwardPlans()
    with caplog.at_level("WARNING"):
        _bind(plans, forward, Batch(reqs=reqs), {1: order})
    assert plans.host_waits == 2 and "waits for the GPU" in caplog.text
    assert forward.positions.tolist() == [0, 0, 0, 5, 4, 3, 2, 6, 7]
