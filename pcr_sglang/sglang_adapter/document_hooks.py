"""Documents sent as text: the hooks that let the OpenAI API, ``/generate``, the Engine and
the DSL send documents as text, rendered and marked in the tokenizer process
(``reuse/chat``, ``reuse/doc_requests``), and report reused document tokens apart from
exact prefix hits (``reuse/usage``)."""

from __future__ import annotations

from typing import Any

from pcr_sglang.reuse import chat, doc_requests, usage
from pcr_sglang.sglang_adapter.prefix_cache import pcr_cache_of


def register(HookRegistry: Any, HookType: Any) -> None:
    """Documents sent as text (``reuse/chat``, ``reuse/doc_requests``, ``reuse/usage``): the
    OpenAI API's ``documents`` field, ``/generate`` and the Engine with text plus documents,
    rendered and marked in the tokenizer process; reused document tokens reported apart
    from exact prefix hits; ``--pcr-doc-format`` checked at startup."""
    openai = "sglang.srt.entrypoints.openai"
    for serving in ("serving_chat.OpenAIServingChat", "serving_completions.OpenAIServingCompletion"):
        HookRegistry.register(f"{openai}.{serving}.handle_request", chat.handle_request, HookType.AROUND)
    HookRegistry.register(
        f"{openai}.serving_chat.OpenAIServingChat._convert_to_internal_request",
        chat.convert_chat_request,
        HookType.AROUND,
    )
    HookRegistry.register(
        f"{openai}.serving_chat.OpenAIServingChat._render_and_encode_chat_template",
        chat.render_chat_template,
        HookType.AROUND,
    )
    manager = "sglang.srt.managers.tokenizer_manager.TokenizerManager"
    HookRegistry.register(f"{manager}.generate_request", doc_requests.generate_request, HookType.AROUND)
    HookRegistry.register(f"{manager}._tokenize_one_request", doc_requests.tokenize_with_documents, HookType.AROUND)
    HookRegistry.register(f"{manager}._validate_one_request", doc_requests.refuse_unrendered, HookType.AFTER)
    for method in ("generate", "async_generate"):
        HookRegistry.register(
            f"sglang.srt.entrypoints.engine.Engine.{method}", doc_requests.engine_generate, HookType.AROUND
        )
    HookRegistry.register(
        "sglang.srt.managers.schedule_batch.ScheduleBatch.prepare_for_extend", note_reused_documents, HookType.AFTER
    )
    HookRegistry.register(
        "sglang.srt.managers.scheduler_components.output_streamer.SchedulerOutputStreamer.get_cached_tokens_details",
        usage.split_cached_details,
        HookType.AFTER,
    )
    HookRegistry.register(
        "sglang.srt.server_args.ServerArgs.resolve_once", doc_requests.check_format_flag, HookType.AFTER
    )


def note_reused_documents(result: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
    """After SGLang prepares an extend batch: each request's reused document tokens, noted
    for its ``cached_tokens_details`` (``reuse/usage``)."""
    cache = pcr_cache_of(batch)
    if cache is not None:
        usage.note_reused_documents(batch.reqs, cache.scheduler.docs)
    return result
