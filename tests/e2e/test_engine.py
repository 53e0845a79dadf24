"""sglang.Engine(enable_pcr=True, ...) in-process API, against the radix cache disabled.

The Engine runs in a process of its own: ``Engine.shutdown`` kills every child process of
the process it runs in, which in pytest's would include the session's baseline server."""

from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor

import pytest

from tests.conftest import CHUNK_SIZE
from tests.e2e.helpers import GREEDY

pytestmark = pytest.mark.e2e

ENGINE_KWARGS = dict(
    device="cpu",
    attention_backend="torch_native",
    dtype="float32",
    max_total_tokens=24000,
    context_length=4096,
    log_level="warning",
)


def run_engine(model_path, prompts, documents=None, **kwargs):
    import sglang as sgl

    engine = sgl.Engine(model_path=model_path, **ENGINE_KWARGS, **kwargs)
    try:
        outputs = [engine.generate(input_ids=p, sampling_params=GREEDY) for p in prompts]
        with_documents = documents_job(engine, documents) if documents else None
    finally:
        engine.shutdown()
    return [(o["output_ids"], o["meta_info"]["cached_tokens"]) for o in outputs], with_documents


DOC_TEXT = "Answer from the documents.\n\n{{documents}}Question: Which one?\nAnswer:"


def documents_job(engine, documents):
    """``generate`` and ``async_generate`` with ``documents=``: in the order given, then
    reversed (reused), and the reversed prompt sent as marked token ids; a bad document."""
    import asyncio

    from transformers import AutoTokenizer

    from pcr_client.prompt import build_doc_prompt

    tokenizer = AutoTokenizer.from_pretrained(engine.server_args.model_path)
    first = engine.generate(prompt=DOC_TEXT, sampling_params=GREEDY, documents=documents)
    second = asyncio.get_event_loop().run_until_complete(
        engine.async_generate(prompt=DOC_TEXT, sampling_params=GREEDY, documents=documents[::-1])
    )
    marked = build_doc_prompt(
        tokenizer, "Answer from the documents.", documents[::-1], "Which one?", use_chat_template=False
    )
    ids, bounds = marked.input_ids[1:], [b - 1 for b in marked.doc_bounds]  # the tiny tokenizer adds no BOS
    twin = engine.generate(input_ids=ids, sampling_params={**GREEDY, "custom_params": {"pcr_doc_bounds": bounds}})
    try:
        engine.generate(prompt=DOC_TEXT, sampling_params=GREEDY, documents=[documents[0], ""])
        refused = None
    except ValueError as e:
        refused = str(e)
    return {
        "first": first["output_ids"],
        "second": second["output_ids"],
        "twin": twin["output_ids"],
        "second_cached": second["meta_info"]["cached_tokens"],
        "bounds_end": bounds[-1],
        "prompt_tokens": second["meta_info"]["prompt_tokens"],
        "ids": len(ids),
        "refused": refused,
    }


def test_engine_outputs_equal_baseline(tiny_model, rag_prompt_ids, baseline_outputs):
    """Also documents sent as text through ``generate`` and ``async_generate``: reused in
    another order, answering as the same prompt sent as marked token ids."""
    from pcr_tools.data import load_wiki_articles

    documents = [a.text[:300] for a in load_wiki_articles()[580:583]]
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        pcr, docs = pool.submit(
            run_engine,
            tiny_model,
            rag_prompt_ids,
            documents,
            enable_pcr=True,
            pcr_chunk_size=CHUNK_SIZE,
            pcr_doc_reuse="concat",
            pcr_doc_warmup_after=1,
        ).result()
    assert [ids for ids, _ in pcr] == baseline_outputs  # the baseline server's: no prefix cache
    cached = [c for _, c in pcr]
    assert all(c % CHUNK_SIZE == 0 for c in cached)
    assert sum(cached) > 0
    assert docs["prompt_tokens"] == docs["ids"]
    assert docs["second_cached"] == docs["bounds_end"]  # every document reused in the other order
    assert docs["second"] == docs["twin"]
    assert docs["refused"] is not None and "documents[1] is empty" in docs["refused"]
