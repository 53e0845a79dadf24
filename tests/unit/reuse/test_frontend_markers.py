"""Document markers of the frontend DSL endpoint (pcr_client.frontend): token ids and bounds."""

from __future__ import annotations

import pytest

from pcr_client.frontend import DOC_CLOSE, DOC_OPEN, doc, marked_input, strip_markers


def test_documents_are_tokenized_alone_and_bounded(tokenizer):
    text = "Lead text.\n\n" + doc("First document.\n\n") + doc("Second one.\n\n") + "Question: why?"
    ids, bounds = marked_input(tokenizer, text)
    first = tokenizer.encode("First document.\n\n", add_special_tokens=False)
    second = tokenizer.encode("Second one.\n\n", add_special_tokens=False)
    lead = tokenizer("Lead text.\n\n").input_ids
    assert bounds == [len(lead), len(lead) + len(first), len(lead) + len(first), len(lead) + len(first) + len(second)]
    assert ids[bounds[0] : bounds[1]] == first and ids[bounds[2] : bounds[3]] == second
    assert strip_markers(text) == "Lead text.\n\nFirst document.\n\nSecond one.\n\nQuestion: why?"


def test_unmarked_text_is_left_to_the_server(tokenizer):
    assert marked_input(tokenizer, "no documents here") is None


def test_bad_markers_are_refused(tokenizer):
    with pytest.raises(ValueError, match="unbalanced"):
        marked_input(tokenizer, "lead " + DOC_OPEN + "never closed")
    with pytest.raises(ValueError, match="markers"):
        doc("a document with a " + DOC_CLOSE + " inside")
