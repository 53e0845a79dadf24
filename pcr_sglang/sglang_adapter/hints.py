"""KV hints on the scheduler side: the loop's collaborator for ``pcr.lookahead_prefetch``.

It registers a hint's chains (with the keys it is handed) in the scheduler's
:class:`~pcr_sglang.core.hints.HintBook`, keeps the clock hints live by (the one the TP
ranks agree on), and with ``--pcr-hint-to-device`` promotes hinted chunks into free device
slots. The request field's hooks (validation at the HTTP door, a hint-only request finished
at the queue) are in :mod:`pcr_sglang.sglang_adapter.kv_hints`, named after that field; the
decisions are the cache state's and the hint book's, in :mod:`pcr_sglang.core.hints` (this
module translates SGLang's requests for it: the mirror convention of ``core/X.py`` and
``sglang_adapter/X.py``).
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Callable, Optional

from pcr_sglang.core.hints import Hint, HintBook, HintPayload, hint_tenant
from pcr_sglang.core.residency import CacheState
from pcr_sglang.req import PcrReq, request_tenant
from pcr_sglang.reuse.disabled import NoDocReuse
from pcr_sglang.reuse.seam import SchedulerDocReuse
from pcr_sglang.sglang_adapter.executor import EffectsExecutor
from pcr_sglang.sglang_adapter.request_keys import RequestKeys
from pcr_sglang.sglang_adapter.tp_group import TpGroup


class KvHints:
    """The live KV hints of one scheduler (a :class:`~pcr_sglang.core.hints.HintBook`), the
    clock they live by, and their promotion to the device.

    Hints live by the clock the TP ranks agree on (the earliest rank's), so that they
    register, hit the rate limit and expire in the same step on every rank: each step's
    agreement hands it in (:meth:`agreed`), and a registration agrees on one of its own.
    """

    def __init__(
        self,
        state: CacheState,
        book: HintBook,
        keys: RequestKeys,
        executor: EffectsExecutor,
        tp: Optional[TpGroup],
        *,
        promote: bool,
        free_floor_tokens: int,
    ):
        self.state = state
        self.book = book
        self.keys = keys
        self.executor = executor
        self.tp = tp
        self.docs: SchedulerDocReuse = NoDocReuse()  # DocReuse, with --pcr-doc-reuse
        self.clock: Callable[[], float] = time.monotonic  # this rank's (a test may replace it)
        self.now = 0.0  # the last agreed clock, in seconds
        self.promote = promote  # --pcr-hint-to-device
        self.free_floor_tokens = free_floor_tokens  # promotion leaves this much of the pool free

    def clock_ms(self) -> int:
        return int(self.clock() * 1000)

    def agreed(self, clock_ms: int) -> None:
        """The step's agreement set the clock: hints past their TTL end now (here, not
        only when reads are planned: hints end while the I/O is down too)."""
        self.now = max(self.now, clock_ms / 1000)
        if len(self.book):
            self.book.expire(self.now)

    def expire_unagreed(self) -> None:
        """The ranks stopped agreeing (nothing is read for hints any more): they still end,
        by this rank's clock."""
        if len(self.book):
            self.book.expire(self.clock())

    def add(self, req: PcrReq, payload: HintPayload) -> bool:
        """Register ``req``'s prompt as a hint: its chains are read ahead while the hint
        lives (see :mod:`pcr_sglang.core.hints`). False when it was not registered (no SSD
        tier, hints off, or over the rate). Under TP every rank registers the same request
        here (SGLang hands each rank the same requests in the same order), so the clock it
        is registered at is agreed by a collective of its own."""
        if not self.state.ssd_enabled or self.state.config.hint_budget_chunks <= 0:
            return False
        tokens = req.origin_input_ids
        # What the final request will match: all but its last token (always computed).
        keys = self.keys.of_tokens(tokens[: max(len(tokens) - 1, 0)], request_tenant(req))
        clock_ms = self.clock_ms()
        if self.tp is not None:
            clock_ms = self.tp.reduce_min([clock_ms])[0]
        now = self.now = max(self.now, clock_ms / 1000)
        tenant = hint_tenant(req.cache_salt, req.extra_key)
        if not self.book.register(req.rid, keys, payload, now, tenant=tenant):
            return False
        if payload.hint_only:
            # A hint marking documents also reads each one's canonical chain (none without
            # document reuse): the final request reuses them in whatever order it puts them.
            # One group with the prompt's own hint, so they end together. They count against
            # the tenant's live hints (never another tenant's), and past the first 16 they
            # take rate tokens.
            doc_payload = replace(payload, group=payload.group or f"pcr-hint:{req.rid}")
            # mutant: hint-only-request-skips-document-chains
            self.book.register_documents(req.rid, self.docs.canonical_chain_keys(req), doc_payload, now, tenant)
            self.docs.release(req.rid)  # the hint-only request never reaches admission
        return True

    def live(self) -> tuple[Hint, ...]:
        """The live hints, in reading order (this step's agreement expired the old ones):
        the cache state keeps their chains matched from step to step."""
        return self.book.live()

    def promote_hinted(self) -> None:
        """``--pcr-hint-to-device``: the host-resident run that continues each live hint's
        device prefix is loaded into free device slots now, while at least half the pool
        stays free, newest hint first; never by evicting anything. The final request then
        finds it on the device (on a GPU its PCIe copy is meant to have left the request's
        path: not measured yet)."""
        engine, allocator, chunk = self.executor.engine, self.executor.allocator, self.executor.chunk
        chains = self.state.hint_chains.tracked()  # the live hints', synced by this step's plan
        if engine is None or not any(chain.nodes for chain in chains):
            return
        for chain in chains:
            fits = (allocator.available_size() - self.free_floor_tokens) // chunk
            nodes = self.state.hint_promotable(chain, fits)
            if not nodes:
                continue
            slots = self.executor.load_into_free_slots(nodes)
            if slots is not None:
                self.state.promote(nodes, slots)
        if engine.pending_loads:
            # CPU: copies wait for the next forward's layer hooks; there may be none for a
            # while, and an I/O order for these host slots waits for them: copy now.
            engine.fence_before_reuse()
