"""SGLang's own server test kits (``sglang.test.kits``, ``sglang.test.test_programs``),
run unchanged against a baseline SGLang server (its radix cache) and a PCR server with
every tier on (a ~3,000-token device pool, a small host tier and an SSD tier).

SGLang checks any cache it serves with these kits; running them here keeps "every kit
that passes on the baseline passes with PCR" true as both move. Each kit is parametrized
over the two servers, which start once for the module. Both serve SmolLM2-135M-Instruct
(the tiny random model of the other modules cannot answer the kits' questions).

Scaling, so the module fits the suite: only the kits' own knobs are turned (request
counts, token counts, the data a kit reads from a local file instead of downloading it);
a kit's assertions are never changed. Kits and kit methods that fail on the baseline too
are ``xfail`` with their reason (``run=False`` where running them would cost more than the
module's whole budget), so the report lists them; docs/testing.md has the table.

Whole-token hit counts: PCR caches whole chunks (``--pcr-chunk-size``), so a hit is
rounded down to a chunk, as SGLang's cache rounds it down to a page. The cache-hit kit
aligns its expected hits to the server's page size; against PCR it is given the chunk
size in its place (``test_cache_hit_multiturn``), which asserts the whole-chunk rounding
explicitly. The multi-turn KL kit needs a hit past the first turn's prompt and one token
only, which its 24 new tokens give at chunk size 16 whatever the rounding.
"""

from __future__ import annotations

import json
import logging
import random
import unittest
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import requests

from pcr_tools.launcher import ServerProcess
from tests.e2e.helpers import serving

logger = logging.getLogger(__name__)

pytestmark = pytest.mark.e2e

PCR_CHUNK_SIZE = 16
_SHARED = ("--context-length", "2048", "--log-level", "warning", "--sleep-on-idle")
BASELINE_ARGS = (*_SHARED, "--max-total-tokens", "24000", "--enable-streaming-session")
PCR_ARGS = (
    *_SHARED,
    "--max-total-tokens",
    "3000",
    "--enable-pcr",
    "--pcr-debug-checks",
    "--pcr-chunk-size",
    str(PCR_CHUNK_SIZE),
    "--pcr-dram-gb",
    "0.2",
    "--pcr-ssd-gb",
    "1",
    "--pcr-ssd-reserve-gb",
    "0",
)
SERVERS = ("baseline", "pcr")


@dataclass(frozen=True)
class KitServer:
    """What a kit reads off its test class: the server's URL, process and model."""

    name: str
    server: ServerProcess
    model: str

    @property
    def base_url(self) -> str:
        return self.server.base_url


class _Process:
    """The ``self.process`` of SGLang's test classes: the kits ask only ``poll()``."""

    def __init__(self, server: ServerProcess):
        self._server = server

    def poll(self) -> int | None:
        proc = self._server._proc
        return None if proc is None else proc.poll()


def kit_case(mixin: type, target: KitServer, **knobs: Any) -> Any:
    """An instance of ``mixin`` mixed into a ``unittest.TestCase`` (for its assert
    methods), set up as SGLang's test classes set it up; ``knobs`` are the kit's own
    class attributes (request and token counts)."""
    attrs = {"base_url": target.base_url, "process": _Process(target.server), "model": target.model, **knobs}

    def flush_cache(cls: type) -> None:
        requests.post(cls.base_url + "/flush_cache", timeout=30).raise_for_status()

    attrs["flush_cache"] = classmethod(flush_cache)
    case_class = type(f"{mixin.__name__}_{target.name}", (mixin, unittest.TestCase), attrs)
    return case_class()  # the method name "runTest" may be absent: unittest allows it


@pytest.fixture(scope="module")
def smollm2() -> str:
    from pcr_tools.models.smollm2 import build_smollm2

    return str(build_smollm2())


@pytest.fixture(scope="module")
def kit_servers(smollm2, tmp_path_factory):
    ssd = tmp_path_factory.mktemp("kits-ssd")
    servers = {
        "baseline": ServerProcess(smollm2, BASELINE_ARGS),
        "pcr": ServerProcess(smollm2, (*PCR_ARGS, "--pcr-ssd-path", str(ssd))),
    }
    with serving(servers) as running:
        yield {name: KitServer(name, running[name], smollm2) for name in SERVERS}


@pytest.fixture(params=SERVERS)
def target(request, kit_servers) -> KitServer:
    return kit_servers[request.param]


def run_kit(mixin: type, method: str, target: KitServer, **knobs: Any) -> None:
    getattr(kit_case(mixin, target, **knobs), method)()


# --- API contract --------------------------------------------------------------------------

API_METHODS = (
    "test_health",
    "test_health_generate",
    "test_get_server_info",
    "test_get_model_info",
    "test_openai_chat_completion",
    "test_openai_completion",
)


@pytest.mark.parametrize("method", API_METHODS)
def test_api_contract(target, method):
    from sglang.test.kits.basic_api_contract_kit import BasicAPIContractMixin

    run_kit(BasicAPIContractMixin, method, target)


# --- Decode correctness --------------------------------------------------------------------

_TOO_SMALL = "SmolLM2-135M answers it wrong on the baseline too (greedy, measured)"


@pytest.mark.parametrize(
    "method",
    [
        "test_capital_france",
        "test_determinism_temp_zero",
        "test_max_token_one",
        "test_ascii_ratio",
        "test_no_repetition_blowup",
        pytest.param("test_basic_math", marks=pytest.mark.xfail(run=False, reason=f"{_TOO_SMALL}: 17*23 -> '17'")),
        pytest.param(
            "test_color_completion",
            marks=pytest.mark.xfail(run=False, reason=f"{_TOO_SMALL}: the third primary colour -> 'green'"),
        ),
    ],
)
def test_decode_correctness(target, method):
    from sglang.test.kits.basic_decode_correctness_kit import BasicDecodeCorrectnessMixin

    run_kit(BasicDecodeCorrectnessMixin, method, target)


# --- Cache kits ----------------------------------------------------------------------------


@pytest.mark.xfail(
    strict=True,
    reason=(
        "the kit expects the 2nd of three prompts sharing a 257-token prefix to hit nothing "
        "(a cache that keeps only branching points, as SGLang's hybrid/mamba caches do); a radix "
        "cache, SGLang's and PCR's alike, hits the shared prefix already on the 2nd"
    ),
)
def test_prefix_cache_branching(target):
    from sglang.test.kits.prefix_cache_branching_kit import PrefixCacheBranchingMixin

    run_kit(PrefixCacheBranchingMixin, "test_prefix_cache_branching", target, cache_chunk_size=1)


def test_radix_cache_server(kit_servers, monkeypatch):
    """The kit's random radix tree, seeded and scaled from 400 nodes of up to 256 unique and
    256 new tokens to 16 of up to 32 (its own parameters), sent as one batch. Against PCR
    only: the kit asserts that the server answers, and its root request decodes 217 tokens
    whatever the tree's size (26 s a server); the baseline passed it when measured."""
    from functools import partial

    from sglang.test.kits import radix_cache_server_kit as kit

    pcr = kit_servers["pcr"]
    random.seed(20261207)
    monkeypatch.setattr(kit, "gen_radix_tree", partial(kit.gen_radix_tree, num_nodes=16, chunk_len=32))
    kit.run_radix_attention_test(pcr.base_url)
    assert _Process(pcr.server).poll() is None, "the PCR server died"


def _sharegpt_file(directory: Path) -> Path:
    """The ShareGPT-shaped file the cache-hit kit samples prompts from (it downloads
    ShareGPT when given none): offline Wikipedia extracts as two-turn conversations."""
    from pcr_tools.data import load_wiki_articles

    articles = [a for a in load_wiki_articles() if len(a.text) > 400][:64]
    path = directory / "sharegpt.json"
    path.write_text(json.dumps([{"conversations": [{"value": a.text}, {"value": a.title}]} for a in articles]))
    return path


def test_cache_hit_multiturn(target, tmp_path, monkeypatch):
    """Multi-turn clients: each round must hit at least the previous round's prompt and
    output, rounded down to a page. Against PCR the rounding is to a whole chunk: the kit
    reads the page size to round with, and is given PCR's chunk size instead."""
    from sglang.test.kits import cache_hit_kit as kit

    if target.name == "pcr":
        monkeypatch.setattr(kit, "_get_page_size", lambda base_url: PCR_CHUNK_SIZE)
    result = kit.run_multiturn_cache_hit_test(
        target.base_url,
        target.model,
        num_clients=2,
        num_rounds=3,
        request_length=128,
        output_length=16,
        dataset_path=str(_sharegpt_file(tmp_path)),
    )
    assert result["rounds"]["round_2"]["cache_hit_rate"] > 0.5, result


KL_SAMPLES = 2
KL_THRESHOLD = 1e-4  # fp32 on CPU: a cache hit changes a logprob by rounding only


@pytest.fixture
def kl_prompts(monkeypatch, tmp_path, smollm2):
    """The KL kit reads LongBench-v2 prompts from its local cache file, downloading them
    when it is absent; the cache file is written here with Wikipedia extracts instead."""
    from sglang.test import kl_test_utils
    from transformers import AutoTokenizer

    from pcr_tools.data import load_wiki_articles

    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    articles = [a for a in load_wiki_articles() if len(a.text) > 1500][:KL_SAMPLES]
    prompts = [tokenizer.encode(a.text)[: 200 + 40 * i] for i, a in enumerate(articles)]
    monkeypatch.setattr(kl_test_utils, "CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(kl_test_utils, "_cached_input_ids", {})
    name = smollm2.replace("/", "_").replace("\\", "_")
    key = f"{name}_{kl_test_utils.DEFAULT_PROMPT_TOKENS}_{kl_test_utils.DEFAULT_NUM_SAMPLES}"
    (tmp_path / f"input_ids_{key}.json").write_text(json.dumps(prompts))
    return prompts


@pytest.mark.parametrize(
    "method",
    ["test_input_output_logprobs_match_prefill_cache_hit", "test_input_output_logprobs_match_decode_cache_hit"],
)
def test_kl_divergence(target, method, kl_prompts):
    """Logprobs of tokens generated on a cache hit (a prefilled prompt; a previous turn's
    prompt and output) against the same tokens prefilled from scratch."""
    from sglang.test.kits.kl_divergence_kit import KLDivergenceMixin

    run_kit(
        KLDivergenceMixin,
        method,
        target,
        kl_div_thres=KL_THRESHOLD,
        kl_div_max_samples=KL_SAMPLES,
        kl_div_prefill_max_new_tokens=24,
        kl_div_decode_max_new_tokens=24,
    )


# --- Request lifecycle ---------------------------------------------------------------------


def test_abort_all(target):
    from sglang.test.kits.abort_timeout_kit import AbortAllMixin

    # max_new_tokens within the 2,048-token context (the kit's 16,000 is refused before it runs).
    run_kit(
        AbortAllMixin,
        "test_abort_all",
        target,
        abort_all_num_requests=8,
        abort_all_max_new_tokens=1500,
        abort_all_sleep=2,
    )


def test_pause_resume_in_place(target):
    from sglang.test.kits.pause_generation_kit import PauseResumeInPlaceMixin

    # ignore_eos: at temperature 0.8 SmolLM2 sometimes ends an essay at once, and the kit
    # asserts every answer is non-empty (it failed so on the baseline).
    run_kit(
        PauseResumeInPlaceMixin,
        "test_pause_resume_in_place",
        target,
        pause_num_requests=4,
        pause_max_new_tokens=64,
        pause_duration=2,
        pause_ignore_eos=True,
    )


# --- Stops and constrained decoding --------------------------------------------------------


@pytest.mark.parametrize(
    "method",
    [
        "test_finish_length",
        "test_finish_stop_eos",
        "test_finish_stop_regex_str",
        pytest.param(
            "test_finish_stop_str",
            marks=pytest.mark.xfail(
                run=False,
                reason=(
                    "the chat half asks for a 3,000-word story and expects a newline within 1,000 tokens: "
                    "SmolLM2 writes none, and the 1,000 tokens take ~100 s a server (baseline, measured)"
                ),
            ),
        ),
    ],
)
def test_matched_stop(target, method):
    from sglang.test.kits.matched_stop_kit import MatchedStopMixin

    run_kit(MatchedStopMixin, method, target)


_JSON_TRUNCATED = (
    "128 new tokens end inside SmolLM2's JSON (an unterminated 'name' string) on the "
    "baseline too; the grammar keeps it valid so far, the kit parses the whole text"
)


@pytest.mark.parametrize(
    "method",
    [
        "test_json_invalid",
        "test_json_openai",
        pytest.param("test_json_generate", marks=pytest.mark.xfail(run=False, reason=_JSON_TRUNCATED)),
        pytest.param("test_mix_json_and_other", marks=pytest.mark.xfail(run=False, reason=_JSON_TRUNCATED)),
    ],
)
def test_json_constrained(target, method):
    from sglang.test.kits.json_constrained_kit import JSONConstrainedMixin

    run_kit(JSONConstrainedMixin, method, target)


@pytest.mark.parametrize(
    "method",
    [
        "test_regex_generate_greeting",
        "test_regex_generate_number",
        "test_regex_generate_date",
        "test_regex_generate_phone",
    ],
)
def test_regex_constrained(target, method):
    from sglang.test.kits.regex_constrained_kit import RegexConstrainedMixin

    run_kit(RegexConstrainedMixin, method, target)


@pytest.mark.parametrize(
    "method",
    [
        "test_ebnf_generate_greeting",
        "test_ebnf_generate_number",
        "test_ebnf_generate_email",
        "test_ebnf_generate_date",
        pytest.param(
            "test_ebnf_generate_complex_json",
            marks=pytest.mark.xfail(
                run=False,
                reason=(
                    "three samples at temperature 0.5, and the grammar admits objects the kit's pattern "
                    "rejects (any of name/age/city, in any order): it fails at random; once, with PCR, on "
                    'the grammar-valid \'{"name":"London","age":25}\''
                ),
            ),
        ),
    ],
)
def test_ebnf_constrained(target, method):
    from sglang.test.kits.ebnf_constrained_kit import EBNFConstrainedMixin

    run_kit(EBNFConstrainedMixin, method, target)


# --- Frontend programs (sglang.test.test_programs) -----------------------------------------


@pytest.fixture
def frontend(target):
    import sglang as sgl

    previous = sgl.global_config.default_backend
    sgl.set_default_backend(sgl.RuntimeEndpoint(target.base_url))
    yield
    sgl.global_config.default_backend = previous


@pytest.mark.parametrize(
    "program,kwargs",
    [
        ("test_select", {"check_answer": False}),
        ("test_tool_use", {}),
        ("test_regex", {}),
        ("test_dtype_gen", {}),
        pytest.param(
            "test_few_shot_qa",
            {},
            marks=pytest.mark.xfail(
                run=False, reason=(f"{_TOO_SMALL}: the capital of the United States -> 'New York'")
            ),
        ),
    ],
)
def test_frontend_program(target, frontend, program, kwargs):
    from sglang.test import test_programs

    getattr(test_programs, program)(**kwargs)


# --- Streaming sessions --------------------------------------------------------------------


@pytest.mark.parametrize(
    "method",
    [
        "test_kv_cache_inheritance",
        pytest.param(
            "test_nth_mid_abort_recovery",
            marks=pytest.mark.xfail(
                run=False,
                reason=(
                    "its second turn asks for 100,000 new tokens, refused beyond the 2,048-token context "
                    "before the abort it tests (baseline, measured)"
                ),
            ),
        ),
    ],
)
def test_streaming_session(target, method, smollm2):
    """SGLang's multi-turn session API. PCR refuses ``--enable-streaming-session`` (its
    sessions keep their KV in UnifiedRadixCache's session slots: docs/testing.md says why
    PCR does not yet); a PCR server answers a streaming ``/open_session`` with SGLang's own
    'relaunch with --enable-streaming-session' error."""
    from sglang.test.kits.streaming_session_kit import StreamingSessionKitMixin
    from transformers import AutoTokenizer

    if target.name == "pcr":
        reply = requests.post(
            target.base_url + "/open_session", json={"capacity_of_str_len": 100, "streaming": True}, timeout=30
        )
        assert "--enable-streaming-session" in reply.text, reply.text
        # Not run: the kit would send this error reply (a JSON object) as its session id,
        # and SGLang 0.5.23's scheduler dies on a session id it cannot hash (TypeError in
        # SessionController.__contains__), as it did here.
        pytest.xfail("PCR refuses --enable-streaming-session (docs/testing.md, Streaming sessions)")
    run_kit(StreamingSessionKitMixin, method, target, tokenizer=AutoTokenizer.from_pretrained(smollm2))


def test_pcr_refuses_streaming_sessions_saying_what_to_do_instead(smollm2):
    """The refusal is resolved before any weight loads, and tells the user the way that
    works with PCR today (each turn sent with its whole history, no session)."""
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args

    load_plugins()
    args = prepare_server_args(
        ["--model-path", smollm2, "--device", "cpu", "--enable-pcr", "--enable-streaming-session"]
    )
    message = "cannot be combined with --enable-streaming-session: .*UnifiedRadixCache.*whole conversation"
    with pytest.raises((ValueError, RuntimeError), match=message):
        args.resolve_once()


def test_pcr_served_the_kits_through_its_tiers(kit_servers):
    """Last in the module: the kits above went through PCR's tiers, not only its device
    pool (3,000 tokens: the kits evict; their ``/flush_cache`` empties the device tree and
    keeps the host and SSD copies, which their next requests hit), and left PCR's bookkeeping
    consistent (``--pcr-debug-checks`` lets this ask for the O(tree) check)."""
    state = kit_servers["pcr"].server.pcr_state(check_invariants=True)
    counters, ssd = state["counters"], state["ssd"]["counters"]
    assert state["forwards"] > 0, "no kit ran against the PCR server in this session (run the whole module)"
    assert state["invariants"]["ok"], state["invariants"]
    assert counters["offloaded_chunks"] > 0 and ssd["written_chunks"] > 0, (counters, ssd)
    assert counters["host_hit_chunks"] + ssd["hit_chunks"] > 0, (counters, ssd)
