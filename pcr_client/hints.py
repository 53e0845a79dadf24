"""The client's side of KV hints: the ``kv_hints`` field that asks the server to prefetch
the chains of a prompt it will be sent soon (the server's side, the book of live hints and
the payload's parser, is :mod:`pcr_sglang.core.hints`)::

    requests.post(url + "/generate", json={
        "text": final_prompt, "sampling_params": {"max_new_tokens": 1},
        "kv_hints": hint_envelope({"hint_only": True, "ttl_s": 15}, uuid.uuid4().hex)})

The payload's fields: ``hint_only`` (finish the carrying request without computing
anything; default true), ``ttl_s``, ``group`` (the candidates of one final prompt share
one) and ``rank`` (lower first within a group).
"""

from __future__ import annotations

from typing import Any

from pcr_wire import HINT_ACTION, HINT_ACTION_VERSION


def hint_envelope(payload: dict[str, Any], message_id: str, version: str = HINT_ACTION_VERSION) -> dict[str, Any]:
    """The ``kv_hints`` field of a request carrying one ``pcr.lookahead_prefetch`` action
    (SGLang's ``KvHintsEnvelope`` as JSON)."""
    return {
        "protocol_version": "1",
        "message_id": message_id,
        "actions": [
            {"action_id": "lookahead", "action_type": HINT_ACTION, "action_version": version, "payload": payload}
        ],
    }
