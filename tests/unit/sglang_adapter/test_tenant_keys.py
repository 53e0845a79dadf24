"""Keys no client can collide (review N1): SGLang's real ``Req`` through PCR's real cache.

SGLang 0.5.23 builds ``req.extra_key`` as the client's ``extra_key`` with the LoRA id
appended and no separator, and ``extra_key`` is a client field. A client *without* an
adapter that sends ``extra_key=<an adapter's id>`` gets exactly the string that adapter's
requests get; before PCR keyed the adapter apart, its base-model KV was then served to
the adapter's requests (and written through to SSD and the fleet under their keys).
"""

from __future__ import annotations

import random
from array import array
from dataclasses import dataclass
from typing import Optional

import pytest

pytest.importorskip("sglang")

from sglang.srt.lora.lora_registry import LoRARef  # noqa: E402
from sglang.srt.managers.schedule_batch import Req  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402

from pcr_sglang.core.keys import RequestTenant, root_key  # noqa: E402
from pcr_sglang.req import request_tenant  # noqa: E402
from tests.unit.adapter_harness import CHUNK, make  # noqa: E402,F401
from tests.unit.sglang_adapter.test_decode_offloads import Batch, RunningReq  # noqa: E402

ADAPTER = LoRARef.deterministic_id("sql", "/adapters/sql")  # what --lora-paths sql=/adapters/sql gets


def sglang_req(rid: str, tokens: list[int], **kwargs) -> Req:
    return Req(rid, "", array("q", tokens), SamplingParams(), **kwargs)


@dataclass
class LoraRunningReq(RunningReq):
    lora_id: Optional[str] = None


def as_running(req: Req) -> LoraRunningReq:
    """The batch harness's request with SGLang's own ``extra_key`` and ``lora_id``."""
    return LoraRunningReq(
        req.rid,
        array("q", req.origin_input_ids),
        extra_key=req.extra_key,
        cache_salt=req.cache_salt,
        lora_id=req.lora_id,
    )


def test_sglang_concatenates_and_pcr_keys_the_adapter_apart():
    tokens = list(range(10, 10 + 4 * CHUNK))
    victim = sglang_req("victim", tokens, lora_id=ADAPTER)
    attacker = sglang_req("attacker", tokens, extra_key=ADAPTER)
    assert victim.extra_key == attacker.extra_key == ADAPTER  # SGLang's keys collide
    assert request_tenant(victim) == RequestTenant(extra_key=None, cache_salt=None, lora_id=ADAPTER)
    assert request_tenant(attacker) == RequestTenant(extra_key=ADAPTER, cache_salt=None, lora_id=None)
    both = sglang_req("both", tokens, extra_key="team-a", lora_id=ADAPTER)
    assert both.extra_key == "team-a" + ADAPTER
    assert request_tenant(both) == RequestTenant(extra_key="team-a", cache_salt=None, lora_id=ADAPTER)
    digest = bytes(16)
    roots = {
        root_key(digest, *(t.extra_key, t.cache_salt, t.lora_id))
        for t in map(request_tenant, (victim, attacker, both, sglang_req("base", tokens)))
    }
    assert len(roots) == 4


def test_a_request_without_the_adapter_shares_nothing_with_the_adapters_requests(make):
    """The review's repro, through the admission and checkpoint SGLang drives: the
    attacker's KV is cached; the adapter's request then matches none of it (red before:
    all 4 chunks), while the attacker's own repeat still hits and, the other way round,
    the adapter's KV is never served to a request without it."""
    h = make(host_slots=8, pool=256)
    batch = Batch(h)
    rng = random.Random(7)
    tokens = [rng.randrange(10, 1000) for _ in range(4 * CHUNK + 1)]
    attacker = sglang_req("attacker", tokens, extra_key=ADAPTER)
    batch.finish(batch.start("attacker", tokens, as_running(attacker)))
    again = as_running(sglang_req("again", tokens, extra_key=ADAPTER))
    assert h.admit(again)[0] == 4 * CHUNK  # the attacker's own chains are cached
    h.cache.on_release(again, checkpointed=False)
    victim = as_running(sglang_req("victim", tokens, lora_id=ADAPTER))
    assert h.admit(victim) == (0, 0)
    h.cache.on_release(victim, checkpointed=False)
    other = [rng.randrange(10, 1000) for _ in range(4 * CHUNK + 1)]
    batch.finish(batch.start("adapter", other, as_running(sglang_req("adapter", other, lora_id=ADAPTER))))
    assert h.admit(as_running(sglang_req("probe", other, extra_key=ADAPTER))) == (0, 0)
    assert h.admit(as_running(sglang_req("same-adapter", other, lora_id=ADAPTER)))[0] == 4 * CHUNK
