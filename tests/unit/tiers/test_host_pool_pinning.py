"""Pinning the host pool as SGLang's HiCache does, checked on CPU by what it calls.

No GPU here: ``torch.cuda.cudart()`` is replaced by a recorder of the two calls the pool
makes (``cudaHostRegister``, ``cudaHostUnregister``), which can be told to fail. What is
checked is the sequence of calls on the real shared-memory segment: pieces of at most
``$SGLANG_HICACHE_HOST_REGISTER_CHUNK_GB`` GiB, whole chunk slots each, each unregistered
by its own base address, a failure rolled back. Nothing here ran on a GPU."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from pcr_sglang.tiers import host_pool
from pcr_sglang.tiers.host_pool import (
    REGISTER_CHUNK_ENV,
    HostChunkPool,
    HostPoolError,
    register_in_pieces,
    register_piece_bytes,
)
from pcr_sglang.tiers.layout import HostChunkLayout


class RecordingCudart:
    """Stand-in for ``torch.cuda.cudart()``: records each call; ``fail_at`` makes the n-th
    registration (0-based) return an error code."""

    def __init__(self, fail_at: int | None = None):
        self.calls: list[tuple[str, int, int]] = []
        self.fail_at = fail_at
        self.registered: dict[int, int] = {}

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
        self.calls.append(("register", ptr, size))
        if self.fail_at is not None and sum(c[0] == "register" for c in self.calls) - 1 == self.fail_at:
            return 2
        assert flags == 0
        self.registered[ptr] = size
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:
        self.calls.append(("unregister", ptr, 0))
        assert ptr in self.registered, "unregistering an address that no registration started at"
        del self.registered[ptr]
        return 0


@pytest.fixture
def cudart(monkeypatch):
    recorder = RecordingCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: recorder)
    return recorder


def test_piece_size_follows_hicaches_variable_in_whole_slots(monkeypatch):
    monkeypatch.delenv(REGISTER_CHUNK_ENV, raising=False)
    assert register_piece_bytes(1 << 20) == 256 << 30  # HiCache's default
    monkeypatch.setenv(REGISTER_CHUNK_ENV, "1")
    slot = 3 * (1 << 20) + 512  # not a divisor of 1 GiB
    piece = register_piece_bytes(slot)
    assert piece % slot == 0 and (1 << 30) - slot < piece <= 1 << 30
    monkeypatch.setenv(REGISTER_CHUNK_ENV, "0")  # HiCache: at least 1 GiB
    assert register_piece_bytes(slot) == piece
    assert register_piece_bytes(3 << 30) == 3 << 30  # a slot above the limit: one slot per piece
    monkeypatch.setenv(REGISTER_CHUNK_ENV, "lots")
    with pytest.raises(HostPoolError, match=REGISTER_CHUNK_ENV):
        register_piece_bytes(slot)


def test_a_large_region_is_registered_in_pieces_with_progress_and_unregistered_by_each_base(caplog):
    recorder = RecordingCudart()
    gib = 1 << 30
    total, piece = 40 * gib + 123, 16 * gib  # addresses only: nothing is allocated
    with caplog.at_level(logging.INFO, logger=host_pool.__name__):
        ranges = register_in_pieces(recorder, 4096, total, piece)
    assert ranges == [(4096, piece), (4096 + piece, piece), (4096 + 2 * piece, total - 2 * piece)]
    assert [c[0] for c in recorder.calls] == ["register"] * 3
    progress = [r.getMessage() for r in caplog.records if "pinned" in r.getMessage()]
    assert len(progress) == 3 and "40.0 of 40.0 GiB" in progress[-1]
    host_pool.unregister_ranges(recorder, ranges, "test")
    assert [c[1] for c in recorder.calls[3:]] == [4096 + 2 * piece, 4096 + piece, 4096]
    assert recorder.registered == {}


def test_a_failed_piece_rolls_back_the_pieces_done_and_names_the_fix():
    recorder = RecordingCudart(fail_at=2)
    with pytest.raises(HostPoolError, match=f"cudaHostRegister failed with code 2 .*{REGISTER_CHUNK_ENV}"):
        register_in_pieces(recorder, 0, 10 << 30, 4 << 30)
    assert recorder.registered == {}
    assert [c[0] for c in recorder.calls] == ["register"] * 3 + ["unregister"] * 2


def test_the_pool_pins_in_whole_slot_pieces_and_unpins_each_on_close(cudart, monkeypatch):
    monkeypatch.setenv(REGISTER_CHUNK_ENV, "1")
    # The piece size's rounding is tested above; here a piece of two slots on a small pool.
    layout = HostChunkLayout(num_slots=5, num_layers=2, chunk_size=4, row_bytes=64)
    monkeypatch.setattr(host_pool, "register_piece_bytes", lambda granularity: 2 * granularity)
    with HostChunkPool(layout, pin=True) as pool:
        assert pool.pinned
        base, slot = pool.buffer.data_ptr(), layout.slot_bytes
        assert cudart.calls == [
            ("register", base, 2 * slot),
            ("register", base + 2 * slot, 2 * slot),
            ("register", base + 4 * slot, slot),
        ]
    assert [c for c in cudart.calls if c[0] == "unregister"] == [
        ("unregister", base + 4 * slot, 0),
        ("unregister", base + 2 * slot, 0),
        ("unregister", base, 0),
    ]
    assert cudart.registered == {}


def test_a_pool_that_cannot_be_pinned_is_refused_and_leaves_no_segment(monkeypatch):
    recorder = RecordingCudart(fail_at=0)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: recorder)
    layout = HostChunkLayout(num_slots=2, num_layers=1, chunk_size=4, row_bytes=8)
    with pytest.raises(HostPoolError, match="cudaHostRegister failed"):
        HostChunkPool(layout, pin=True, shm_name="pcr-host-pinfail")
    assert not os.path.exists(os.path.join(host_pool.SHM_DIR, "pcr-host-pinfail"))
    assert not os.path.exists(os.path.join(host_pool.SHM_DIR, "pcr-host-pinfail.lock"))


def test_a_default_container_shm_is_refused_before_allocating_naming_the_fix(monkeypatch):
    monkeypatch.setattr(host_pool, "shm_free_bytes", lambda: 64 << 20)  # docker's default /dev/shm
    big = HostChunkLayout(num_slots=1, num_layers=1, chunk_size=1, row_bytes=(65 << 20) // 2)
    created = []
    monkeypatch.setattr(
        host_pool.shared_memory,
        "SharedMemory",
        lambda *a, **k: created.append(k) or pytest.fail("allocated despite the check"),
    )
    with pytest.raises(HostPoolError, match=r"64 MiB /dev/shm by default.*docker run --shm-size=2g.*--ipc=host"):
        HostChunkPool(big, pin=False)
    assert created == []
