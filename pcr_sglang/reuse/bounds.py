"""The document-reuse request contract: what a request may ask for in its
``sampling_params.custom_params`` (its documents' bounds, the mode, K and R, blend's
anchors and selector), how it is parsed and checked, and what the server's modes need.

Pure and torch-free, so the HTTP side, the hook table (``plugin.py``) and the planner share
one definition of every name (the two the client library writes too are :mod:`pcr_wire`'s).
:func:`parse_doc_bounds` is the one parser of ``pcr_doc_bounds``; :mod:`pcr_sglang.reuse.plan`
plans over its spans.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

# Re-exported (``X as X``): the wing names the request fields and the default selector from here.
from pcr_sglang.req import PcrReq
from pcr_sglang.reuse.selectors import DEFAULT_SELECTOR as DEFAULT_SELECTOR
from pcr_sglang.reuse.selectors import SELECTORS
from pcr_wire import DOC_BOUNDS_PARAM as DOC_BOUNDS_PARAM
from pcr_wire import DOC_MODE_PARAM as DOC_MODE_PARAM

if TYPE_CHECKING:
    from pcr_sglang.reuse.gate import CalibrationGate

CUSTOM_PARAMS_FIELD = "sampling_params.custom_params"
RECOMPUTE_TOKENS_PARAM = "pcr_doc_recompute_tokens"
RECOMPUTE_RATIO_PARAM = "pcr_doc_recompute_ratio"
# ``blend``: the first N tokens of each re-placed document always recomputed, inside the R
# budget; the rest of the budget by the selector (with deviation: the "hybrid" selector).
ANCHOR_TOKENS_PARAM = "pcr_doc_anchor_tokens"
# ``blend``: what ranks the re-placed tokens, one of ``SELECTORS`` (reuse/selectors.py).
SELECTOR_PARAM = "pcr_doc_selector"
# The question selectors: where the question ends (a token offset; default: the end of the
# input). A client that teacher-forces an answer after the prompt sets it to the prompt's
# length, so the selection sees the question alone, as it does when the answer is generated.
QUESTION_END_PARAM = "pcr_doc_question_end"
CANONICAL_PARAM = "pcr_canonical_doc"
# ``True``: warm this request's documents before it, whatever the server's warm-up policy
# (what ``python -m pcr_tools.precompute`` sends: a precomputed document is seen once).
WARM_NOW_PARAM = "pcr_doc_warm"

SERVER_MODES = ("concat", "lego", "blend")
RECOMPUTE_MODES = ("lego", "blend")
# ``reorder`` (reuse/reorder.py): the documents served in an order the server served them in
# before, in the tokenizer process; the scheduler then serves the request exactly.
REORDER_MODE = "reorder"
# The modes that are exact: no document KV re-placed, so the scheduler does no document
# reuse for them and a calibration never refuses them. The one definition (the gate,
# the settings and the server's startup checks read it).
EXACT_MODES = ("off", REORDER_MODE)
# What a marked request may ask for in ``custom_params["pcr_doc_reuse"]`` (default: the server's).
REQUEST_MODES = (*EXACT_MODES, *SERVER_MODES)


class DocBoundsError(ValueError):
    """A request's ``pcr_doc_bounds`` cannot describe its tokens (or it asks for an unknown mode)."""


@dataclass(frozen=True)
class DocLimits:
    """What one request may ask of document reuse (``--pcr-doc-max-documents``,
    ``--pcr-doc-min-tokens``). Every marked document costs work whatever its length: its
    canonical chain is hashed and matched (every scheduler step while the request waits),
    stored padded to whole chunks, and warmed by a prefill of the leading tokens plus
    itself. So both the count and a floor on the length are bounded."""

    max_documents: int
    min_tokens: int


def doc_params(custom_params: Any) -> Optional[dict[str, Any]]:
    """A request's ``custom_params`` as the dict PCR reads (None when absent or empty).
    SGLang declares it a dict but does not check; anything else is refused, naming the
    field, before a ``pcr_*`` key is looked up in it (``"pcr_doc_bounds" in "xpcr_doc_boundsx"``
    is a substring test, not a key lookup)."""
    if custom_params is None:
        return None
    if not isinstance(custom_params, dict):
        raise DocBoundsError(
            f"{CUSTOM_PARAMS_FIELD} must be an object of named parameters, got {type(custom_params).__name__}"
        )
    return custom_params or None


@dataclass(frozen=True)
class Recompute:
    """How a request's re-placed documents are repaired: ``concat`` not at all, ``lego`` the
    first ``tokens`` of each document, ``blend`` a ``ratio`` share of their tokens (with
    ``anchor_tokens``: each document's first ones among them, the rest by ``selector``)."""

    mode: str = "concat"
    tokens: int = 0
    ratio: float = 0.0
    anchor_tokens: int = 0
    selector: str = DEFAULT_SELECTOR
    question_end: Optional[int] = None  # per request (QUESTION_END_PARAM); None: the input's end
    # The server's only (reuse.settings): with --pcr-doc-reuse-calibration, what a request may ask for.
    gate: Optional["CalibrationGate"] = field(default=None, compare=False, repr=False)

    @property
    def recomputes(self) -> bool:
        return (self.mode == "lego" and self.tokens > 0) or (self.mode == "blend" and self.ratio > 0)


def request_mode(custom_params: Any, server_mode: str = "concat") -> str:
    """The document-reuse mode a request's ``custom_params`` ask for (default: the server's).
    Recompute modes need a server started in one (its attention computes permuted rows)."""
    custom_params = doc_params(custom_params) or {}
    mode: str = custom_params.get(DOC_MODE_PARAM, server_mode)
    if mode not in REQUEST_MODES:
        raise DocBoundsError(f"{DOC_MODE_PARAM} must be one of {', '.join(map(repr, REQUEST_MODES))}, got {mode!r}")
    if mode in RECOMPUTE_MODES and server_mode not in RECOMPUTE_MODES:
        raise DocBoundsError(
            f"{DOC_MODE_PARAM}={mode!r} recomputes tokens: this server runs --pcr-doc-reuse "
            f"{server_mode}; start it with --pcr-doc-reuse lego or blend"
        )
    return mode


def request_recompute(custom_params: Any, server: Recompute) -> Optional[Recompute]:
    """The request's mode and its K or R (``pcr_doc_recompute_tokens`` / ``_ratio`` override
    the server's), or None for an exact mode (``off``, ``reorder``). Raises :class:`DocBoundsError` for bad values, and
    for settings outside the server's calibration (``server.gate``; unless it only warns)."""
    custom_params = doc_params(custom_params) or {}
    mode = request_mode(custom_params, server.mode)
    # mutant: reorder-not-exact-in-the-scheduler
    if mode in EXACT_MODES:
        return None  # served exactly (reorder's order is chosen in the tokenizer process)
    tokens = custom_params.get(RECOMPUTE_TOKENS_PARAM, server.tokens)
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
        raise DocBoundsError(f"{RECOMPUTE_TOKENS_PARAM} must be an integer >= 0, got {tokens!r}")
    ratio = custom_params.get(RECOMPUTE_RATIO_PARAM, server.ratio)
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0.0 <= ratio <= 1.0:
        raise DocBoundsError(f"{RECOMPUTE_RATIO_PARAM} must be a number in [0, 1], got {ratio!r}")
    anchors = custom_params.get(ANCHOR_TOKENS_PARAM, server.anchor_tokens)
    if isinstance(anchors, bool) or not isinstance(anchors, int) or anchors < 0:
        raise DocBoundsError(f"{ANCHOR_TOKENS_PARAM} must be an integer >= 0, got {anchors!r}")
    selector = custom_params.get(SELECTOR_PARAM, server.selector)
    if selector not in SELECTORS:
        raise DocBoundsError(f"{SELECTOR_PARAM} must be one of {', '.join(map(repr, SELECTORS))}, got {selector!r}")
    question_end = custom_params.get(QUESTION_END_PARAM)
    if question_end is not None and (
        isinstance(question_end, bool) or not isinstance(question_end, int) or question_end < 1
    ):
        raise DocBoundsError(f"{QUESTION_END_PARAM} must be a positive token offset, got {question_end!r}")
    asked = Recompute(mode, int(tokens), float(ratio), int(anchors), selector, question_end)
    # mutant: calibration-gate-judges-the-server-mode-only
    if server.gate is not None:
        server.gate.check(asked)
    return asked


def request_warm_now(custom_params: Any) -> bool:
    """Whether the request asks for its documents to be warmed now (``pcr_doc_warm``)."""
    value = (doc_params(custom_params) or {}).get(WARM_NOW_PARAM, False)
    if not isinstance(value, bool):
        raise DocBoundsError(f"{WARM_NOW_PARAM} must be true or false, got {value!r}")
    return value


@dataclass(frozen=True)
class DocSpan:
    """Document ``index`` covers request tokens ``[start, end)``."""

    index: int
    start: int
    end: int

    @property
    def length(self) -> int:
        return self.end - self.start


def parse_doc_bounds(raw: object, num_tokens: int, limits: Optional[DocLimits] = None) -> tuple[DocSpan, ...]:
    """Validate ``[s0, e0, s1, e1, ...]`` (flat token offsets into the prompt).

    Documents must be non-empty, sorted, non-overlapping, inside the prompt, and the first
    must not start at 0 (there is always a BOS or template before it; ``S`` may be empty
    only if the model has no BOS, which we do not assume); with ``limits`` (the server's),
    at most ``max_documents`` of them, each of at least ``min_tokens``. Raises
    :class:`DocBoundsError` naming the problem (and the flag of a limit), which the server
    returns as HTTP 400.
    """
    if not isinstance(raw, (list, tuple)):
        raise DocBoundsError(
            f"{DOC_BOUNDS_PARAM} must be a flat list of token offsets [s0, e0, s1, e1, ...], got {type(raw).__name__}"
        )
    if len(raw) == 0 or len(raw) % 2:
        raise DocBoundsError(f"{DOC_BOUNDS_PARAM} must hold pairs of offsets [start, end), got {len(raw)} values")
    if limits is not None and len(raw) // 2 > limits.max_documents:
        raise DocBoundsError(
            f"{DOC_BOUNDS_PARAM} marks {len(raw) // 2} documents; this server takes at most "
            f"{limits.max_documents} per request (--pcr-doc-max-documents)"
        )
    values: list[int] = []
    for value in raw:
        if isinstance(value, bool) or not isinstance(value, int):
            raise DocBoundsError(f"{DOC_BOUNDS_PARAM} offsets must be integers, got {value!r}")
        values.append(value)
    spans: list[DocSpan] = []
    previous_end = 0
    for i in range(0, len(values), 2):
        start, end = values[i], values[i + 1]
        doc = i // 2
        if start < 0 or end > num_tokens:
            raise DocBoundsError(
                f"{DOC_BOUNDS_PARAM}: document {doc} [{start}, {end}) is outside the prompt's {num_tokens} tokens"
            )
        if end <= start:
            raise DocBoundsError(f"{DOC_BOUNDS_PARAM}: document {doc} [{start}, {end}) is empty or reversed")
        if start < previous_end:
            raise DocBoundsError(
                f"{DOC_BOUNDS_PARAM}: document {doc} starts at {start}, before the previous "
                f"document ends ({previous_end}): bounds must be sorted and not overlap"
            )
        if doc == 0 and start == 0:
            raise DocBoundsError(
                f"{DOC_BOUNDS_PARAM}: the first document starts at token 0; the tokens before "
                "it (BOS, system prompt) are what every document's KV is computed behind"
            )
        spans.append(DocSpan(doc, start, end))
        previous_end = end
    short = next((span for span in spans if span.length < limits.min_tokens), None) if limits is not None else None
    if short is not None and limits is not None:  # after the format: a malformed list is named as such first
        raise DocBoundsError(
            f"{DOC_BOUNDS_PARAM}: document {short.index} [{short.start}, {short.end}) has "
            f"{short.length} tokens; this server takes documents of at least {limits.min_tokens} "
            "(--pcr-doc-min-tokens)"
        )
    return tuple(spans)


# The attention backends that take a position-causal mask over a permuted row (the
# recompute modes, and concat computing a gap in place): reuse.rows carries them.
RECOMPUTE_ATTENTION_BACKENDS = ("torch_native", "triton")


def request_doc_reuse(
    req: PcrReq, num_tokens: int, server: Recompute, limits: Optional[DocLimits] = None
) -> Optional[tuple[tuple[DocSpan, ...], Recompute]]:
    """The documents ``req`` marked and how it wants them repaired, or None (not asking,
    or asking for ``off``, or document reuse stopped by the calibration gate). Raises
    :class:`DocBoundsError` for bounds that do not fit its tokens or the server's
    ``limits``, a mode or K/R the server cannot serve or its calibration refuses, or
    ``custom_params`` that are not a dict (the tokenizer refuses all of these first). The
    scheduler asks once per request: what a warning gate lets through is counted here."""
    params = doc_params(getattr(getattr(req, "sampling_params", None), "custom_params", None))
    if not params or DOC_BOUNDS_PARAM not in params:
        return None
    if server.gate is not None and server.gate.stopped:
        return None  # served exactly, as with document reuse off
    recompute = request_recompute(params, server)
    if recompute is None:
        return None
    spans = parse_doc_bounds(params[DOC_BOUNDS_PARAM], num_tokens, limits)
    if server.gate is not None:
        server.gate.check(recompute, record=True)
    return spans, recompute


def is_canonical_request(req: PcrReq) -> bool:
    params = getattr(getattr(req, "sampling_params", None), "custom_params", None)
    return isinstance(params, dict) and bool(params.get(CANONICAL_PARAM))
