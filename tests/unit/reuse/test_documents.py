"""Documents sent as text (``reuse/documents``): parsed, rendered into the chat template or
a text prompt, each tokenized alone and marked, on the tiny model's real tokenizer.

The oracle of the rendering is the client-side builder of the marked-token-id path
(``reuse.prompt.build_doc_prompt``): a chat request with documents must become the very
tokens and bounds a client using it would send.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pcr_client.prompt import DEFAULT_DOC_FORMAT as CLIENT_DOC_FORMAT
from pcr_client.prompt import build_doc_prompt
from pcr_sglang.reuse.bounds import DocLimits, parse_doc_bounds
from pcr_sglang.reuse.documents import (
    DEFAULT_DOC_FORMAT,
    Document,
    DocumentsError,
    MarkingRules,
    check_doc_format,
    doc_format_from_flag,
    mark_text,
    parse_documents,
    render_chat,
    template_takes_documents,
)

CHATML = (Path(__file__).parents[2] / "e2e" / "data" / "chatml.jinja").read_text()
# A RAG template in the style of Hugging Face's (Command-R's document block): a running
# index before each document, then its fields.
RAG_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}\n{% endfor %}"
    "{% if documents %}<|documents|>{% for document in documents %}Document: {{ loop.index0 }}\n"
    "{% for key, value in document.items() %}{{ key }}: {{ value }}\n{% endfor %}\n{% endfor %}{% endif %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
DOCS = [
    "The first document is about cats and their habits in the wild, at night.",
    "A second document: the history of Rome, its emperors and its roads.",
    "Third: how rivers carry sand to the sea, and how deltas grow.",
]
RULES = MarkingRules(limits=DocLimits(max_documents=4, min_tokens=4), context_len=2048)


@pytest.fixture
def chat_tokenizer(tokenizer):
    import copy

    tok = copy.deepcopy(tokenizer)
    tok.chat_template = CHATML
    return tok


def test_the_client_and_the_server_format_agree():
    """One definition (pcr_wire) for the client's prompt builder and the server's renderer;
    the flag's default must be the same text."""
    from pcr_sglang.flags import DEFAULT_DOC_FORMAT as FLAG_DOC_FORMAT

    assert DEFAULT_DOC_FORMAT == CLIENT_DOC_FORMAT == FLAG_DOC_FORMAT


@pytest.mark.parametrize(
    "raw, message",
    [
        ("one document", "must be a list"),
        ([], "is empty"),
        (["a", ""], r"documents\[1\] is empty"),
        (["a", "   "], r"documents\[1\] is empty"),
        (["a", 3], r"documents\[1\] must be a string or"),
        ([{"title": "t"}], r"documents\[0\]\.text must be a string"),
        ([{"text": ""}], r"documents\[0\]\.text is empty"),
        ([{"text": "x", "title": 5}], r"documents\[0\]\.title must be a string"),
        ([{"text": "x", "url": "u"}], r"documents\[0\] has unknown keys \['url'\]"),
        (["a"] * 5, r"holds 5 documents; this server takes at most 4 per request \(--pcr-doc-max-documents\)"),
    ],
)
def test_bad_documents_are_refused_naming_the_field(raw, message):
    with pytest.raises(DocumentsError, match=message):
        parse_documents(raw, RULES.limits)


def test_documents_parse_with_and_without_titles():
    docs = parse_documents(["plain", {"title": "Rome", "text": "roads"}, {"text": "untitled"}])
    assert docs == (Document("plain"), Document("roads", "Rome"), Document("untitled"))
    assert [d.body for d in docs] == ["plain", "Rome\nroads", "untitled"]


def test_chat_documents_become_the_tokens_the_client_builder_sends(chat_tokenizer):
    messages = [
        {"role": "system", "content": "Answer from the documents."},
        {"role": "user", "content": "Which document mentions Rome?"},
    ]
    marked = render_chat(chat_tokenizer, messages, parse_documents(DOCS), RULES, add_generation_prompt=True)
    client = build_doc_prompt(
        chat_tokenizer,
        "Answer from the documents.",
        DOCS,
        "Which document mentions Rome?",
        question_format="{question}",
    )
    assert marked.input_ids == client.input_ids
    assert marked.doc_bounds == client.doc_bounds
    assert len(parse_doc_bounds(marked.doc_bounds, len(marked.input_ids), RULES.limits)) == 3


def test_each_document_is_the_same_tokens_in_any_order_and_conversation(chat_tokenizer):
    """What reuse needs: a document's marked tokens do not depend on what surrounds it."""

    def spans(messages, docs):
        marked = render_chat(chat_tokenizer, messages, parse_documents(docs), RULES, add_generation_prompt=True)
        b = marked.doc_bounds
        return {docs[i // 2]: marked.input_ids[b[i] : b[i + 1]] for i in range(0, len(b), 2)}

    first = spans([{"role": "user", "content": "Q1?"}], DOCS)
    history = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Q2, longer?"},
    ]
    second = spans(history, [DOCS[2], DOCS[0], DOCS[1]])
    assert first == second
    assert all(
        ids == chat_tokenizer.encode(DEFAULT_DOC_FORMAT.format(doc=doc), add_special_tokens=False)
        for doc, ids in first.items()
    )


def test_documents_go_before_the_last_user_message(chat_tokenizer):
    messages = [
        {"role": "user", "content": "earlier"},
        {"role": "assistant", "content": "reply"},
        {"role": "user", "content": "last"},
    ]
    marked = render_chat(chat_tokenizer, messages, parse_documents(DOCS[:1]), RULES, add_generation_prompt=True)
    text = chat_tokenizer.decode(marked.input_ids)
    assert text.index("earlier") < text.index("reply") < text.index("Document: The first") < text.index("last")
    with pytest.raises(DocumentsError, match="before the last user message; the request has none"):
        render_chat(chat_tokenizer, [{"role": "system", "content": "s"}], parse_documents(DOCS[:1]), RULES)


@pytest.mark.parametrize(
    "template, takes",
    [
        (RAG_TEMPLATE, True),
        (CHATML, False),
        # The word in the template's text, not a variable it reads: rendered with the sentinel.
        ("{% for m in messages %}Answer from the documents below. {{ m['content'] }}{% endfor %}", False),
        ("{{ '<|documents|>' }}{% for m in messages %}{{ m['content'] }}{% endfor %}", False),
        # A tag Jinja alone does not know (Hugging Face's {% generation %}): the name in a block.
        ("{% generation %}{% for d in documents %}{{ d.text }}{% endfor %}{% endgeneration %}", True),
        ("{% generation %}the documents{% endgeneration %}", False),
        # A filter Jinja alone does not have (transformers' environment adds some).
        ("{{ messages | tojson_custom }}{% for d in documents %}{{ d.text }}{% endfor %}", True),
        ({"default": CHATML, "rag": RAG_TEMPLATE}, True),
        (None, False),
    ],
)
def test_a_template_takes_documents_when_it_reads_the_variable(template, takes):
    assert template_takes_documents(template) is takes


def test_a_template_that_takes_documents_renders_them_and_only_their_fields_are_marked(tokenizer):
    import copy

    tok = copy.deepcopy(tokenizer)
    tok.chat_template = RAG_TEMPLATE
    assert template_takes_documents(RAG_TEMPLATE) and not template_takes_documents(CHATML)
    docs = parse_documents([{"title": "Cats", "text": DOCS[0]}, DOCS[1]])
    marked = render_chat(tok, [{"role": "user", "content": "Q?"}], docs, RULES, add_generation_prompt=True)
    b = marked.doc_bounds
    # From the title's first character to the text's last: the keys before them are the template's.
    assert tok.decode(marked.input_ids[b[0] : b[1]]) == f"Cats\ntext: {DOCS[0]}"
    assert tok.decode(marked.input_ids[b[2] : b[3]]) == DOCS[1]
    whole = tok.decode(marked.input_ids)
    assert whole.startswith("<|user|>Q?\n<|documents|>Document: 0\n") and "Document: 1\n" in whole
    # The running index stays out of the spans: each document is the same tokens at index 1.
    swapped = render_chat(tok, [{"role": "user", "content": "Q?"}], (docs[1], docs[0]), RULES)
    s = swapped.doc_bounds
    assert swapped.input_ids[s[2] : s[3]] == marked.input_ids[b[0] : b[1]]


def test_text_prompts_take_documents_at_the_placeholder_or_before_the_text(tokenizer):
    docs = parse_documents(DOCS[:2])
    marked = mark_text(tokenizer, "Answer from the documents.\n\n{{documents}}Question: Which?\nAnswer:", docs, RULES)
    # The client builder puts a BOS first; SGLang tokenizes a text prompt with what the
    # tokenizer adds, and this one adds none.
    client = build_doc_prompt(tokenizer, "Answer from the documents.", DOCS[:2], "Which?", use_chat_template=False)
    assert tokenizer.encode("x") == tokenizer.encode("x", add_special_tokens=False)
    assert marked.input_ids == client.input_ids[1:] and marked.doc_bounds == [b - 1 for b in client.doc_bounds]
    # No placeholder, and a tokenizer that puts nothing first: nothing would precede them.
    with pytest.raises(DocumentsError, match="nothing precedes the first document"):
        mark_text(tokenizer, "Question: Which?", docs, RULES)
    with pytest.raises(DocumentsError, match="2 times"):
        mark_text(tokenizer, "{{documents}} and {{documents}}", docs, RULES)


def test_the_limits_of_marked_prompts_apply_naming_the_document(chat_tokenizer):
    messages = [{"role": "user", "content": "Q?"}]
    strict = MarkingRules(limits=DocLimits(max_documents=4, min_tokens=12), context_len=2048)
    with pytest.raises(
        DocumentsError,
        match=r"documents\[1\] is \d+ tokens as rendered; this server takes "
        r"documents of at least 12 \(--pcr-doc-min-tokens\)",
    ):
        render_chat(chat_tokenizer, messages, parse_documents([DOCS[0], "short"]), strict)
    tight = MarkingRules(limits=RULES.limits, context_len=40)
    with pytest.raises(
        DocumentsError,
        match=r"documents: the prompt with its 3 documents is \d+ tokens, over "
        r"the model's context length \(40 tokens\)",
    ):
        render_chat(chat_tokenizer, messages, parse_documents(DOCS), tight)


def test_a_custom_document_format(chat_tokenizer):
    rules = MarkingRules(doc_format=doc_format_from_flag("<doc>{doc}</doc>\\n"), limits=RULES.limits)
    marked = render_chat(chat_tokenizer, [{"role": "user", "content": "Q?"}], parse_documents(DOCS[:1]), rules)
    b = marked.doc_bounds
    assert chat_tokenizer.decode(marked.input_ids[b[0] : b[1]]) == f"<doc>{DOCS[0]}</doc>\n"
    check_doc_format("<doc>{doc}</doc>")
    for bad in ("no field", "{doc} {title}", "{doc", "{}"):
        with pytest.raises(DocumentsError, match="--pcr-doc-format"):
            check_doc_format(bad)


def test_reused_document_tokens_are_reported_apart_from_the_tiers():
    from pcr_sglang.reuse.usage import split_details

    assert split_details({"device": 112, "host": 180}, 180) == {"device": 112, "host": 0, "documents": 180}
    # Where SGLang counted part of them on the device, the rest comes from there; the sum stays.
    assert split_details({"device": 100, "host": 20}, 50) == {"device": 70, "host": 0, "documents": 50}
    assert split_details({"device": 5, "host": 0, "storage_backend": "x"}, 0) == {
        "device": 5,
        "host": 0,
        "storage_backend": "x",
    }
    assert split_details(None, 10) is None


def test_documents_ride_in_custom_params_from_every_entry_point():
    from pcr_sglang.reuse.doc_requests import engine_generate, with_documents

    assert with_documents(None, ["d"]) == {"custom_params": {"pcr_documents": ["d"]}}
    assert with_documents({"temperature": 0, "custom_params": {"pcr_doc_reuse": "concat"}}, ["d"]) == {
        "temperature": 0,
        "custom_params": {"pcr_doc_reuse": "concat", "pcr_documents": ["d"]},
    }
    with pytest.raises(DocumentsError, match="one prompt"):
        with_documents([{}, {}], ["d"])
    with pytest.raises(DocumentsError, match="custom_params must be an object"):
        with_documents({"custom_params": "x"}, ["d"])
    with pytest.raises(DocumentsError, match=r"documents\[0\] is empty"):
        with_documents({}, [""])

    def generate(engine, prompt=None, sampling_params=None, input_ids=None):
        return prompt, sampling_params

    # Engine.generate's sampling_params given by keyword or by position.
    assert engine_generate(generate, None, "q", documents=["d"]) == ("q", {"custom_params": {"pcr_documents": ["d"]}})
    assert engine_generate(generate, None, "q", {"temperature": 0}, documents=["d"]) == (
        "q",
        {"temperature": 0, "custom_params": {"pcr_documents": ["d"]}},
    )
    assert engine_generate(generate, None, "q", {"temperature": 0}) == ("q", {"temperature": 0})
