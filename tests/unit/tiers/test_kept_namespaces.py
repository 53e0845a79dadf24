"""The namespaces a server keeps for a rollback, on real store directories: the oldest
purged first, a namespace served again leaves the list, and one another server still
writes in is neither purged nor charged."""

from __future__ import annotations

from pcr_sglang.tiers.kept_namespaces import KeptNamespaces, namespace_bytes
from pcr_sglang.tiers.layout import HostChunkLayout
from pcr_sglang.tiers.ssd_store import ChunkFileStore
from pcr_sglang.tiers.store_dir import list_namespaces

LAYOUT = HostChunkLayout(num_slots=1, num_layers=2, chunk_size=4, row_bytes=32)


def filled(root, n: int, records: int) -> ChunkFileStore:
    store = ChunkFileStore(root, bytes([n]) * 16, LAYOUT, "torch.float32", 1 << 20, low_watermark_bytes=0)
    for i in range(records):
        store.write(i.to_bytes(16, "big"), bytes(16), 1, 4, bytes(LAYOUT.slot_bytes))
    return store


def on_disk(root) -> set[str]:
    return {ns.digest_hex for ns in list_namespaces(root)}


def test_the_oldest_go_first_and_a_rollback_leaves_the_list(tmp_path):
    root = tmp_path / "store"
    stores = [filled(root, n, 2) for n in range(4)]
    for store in stores:
        store.close()  # left: nobody holds their leases
    names = [s.namespace.hex() for s in stores]
    kept = KeptNamespaces(root)
    for name in names[:3]:
        kept.left(name)
    record = stores[0].record_bytes
    assert namespace_bytes(root, names[0]) == 2 * record
    room = kept.make_room(names[3], names[1], keep=2, budget_bytes=1 << 30)  # back to 1, leaving 3
    assert room.purged == [names[0]] and not room.purge_leaving
    assert room.charged_bytes == 4 * record  # 2 and 3
    assert kept.kept == [names[2]] and names[0] not in on_disk(root)
    kept.left(names[3])
    room = kept.make_room(names[1], names[0], keep=1, budget_bytes=1 << 30)
    assert room.purged == [names[2], names[3]] and not room.purge_leaving and room.charged_bytes == 2 * record
    # With room for none (or none within half the budget), the one being left goes as well.
    assert kept.make_room(names[1], names[0], keep=0, budget_bytes=1 << 30).purge_leaving
    assert kept.make_room(names[1], names[0], keep=5, budget_bytes=3 * record).purge_leaving


def test_a_namespace_another_server_writes_in_is_not_purged_nor_charged(tmp_path):
    root = tmp_path / "store"
    peer = filled(root, 1, 3)  # holds its writer lease
    kept = KeptNamespaces(root)
    kept.left(peer.namespace.hex())
    room = kept.make_room(None, (2).to_bytes(16, "big").hex(), keep=0, budget_bytes=1 << 30)
    assert room.purged == [] and room.charged_bytes == 0 and kept.kept == []
    assert peer.namespace.hex() in on_disk(root) and kept.purged == 0
    peer.close()
