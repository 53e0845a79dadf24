"""Fill a server's cache with the canonical KV of a corpus (TurboRAG's offline phase).

For every document of a JSONL corpus, one request ``S ‖ d`` marking ``d`` as a document
(and asking for it to be warmed now, ``pcr_doc_warm``, whatever the server's
``--pcr-doc-warmup`` policy) goes to a running ``--pcr-doc-reuse`` server: the server computes the document's canonical
KV (``S ‖ d ‖ pad``, see :mod:`pcr_sglang.reuse.plan`) and keeps it in its tiers; with
an SSD tier (write-through) it is on disk once the command returns, so a server started
later on the same store serves these documents from SSD without ever having seen them in
traffic. ``S`` is what :func:`~pcr_client.prompt.build_doc_prompt` puts before the
documents for the given system prompt, so the traffic must be built the same way (same
system prompt, same document format).

Usage::

    python -m pcr_tools.precompute --url http://127.0.0.1:30000 --model-path MODEL \\
        --corpus docs.jsonl --system "You are a helpful assistant." \\
        --doc-format "Document ({title}):\\n{text}\\n\\n"

Each JSONL line is an object; ``--doc-format`` is filled from its fields (default: its
``text`` as ``build_doc_prompt`` formats a document). Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence

import requests

from pcr_client.prompt import DEFAULT_DOC_FORMAT, build_doc_prompt

logger = logging.getLogger(__name__)


@dataclass
class PrecomputeResult:
    documents: int
    tokens: int
    failed: int
    seconds: float


def document_warmup(leading: Sequence[int], document: Sequence[int]) -> tuple[list[int], list[int]]:
    """``(input_ids, bounds)`` of one document's warm-up request: ``S ‖ d``, ``d`` marked."""
    return list(leading) + list(document), [len(leading), len(leading) + len(document)]


def document_requests(tokenizer: Any, system: str, documents: Iterable[str]) -> list[tuple[list[int], list[int]]]:
    """The warm-up request of each document, with ``S`` as ``build_doc_prompt`` makes it."""
    out = []
    for text in documents:
        prompt = build_doc_prompt(tokenizer, system, [text], "", doc_format="{doc}", question_format="")
        start, end = prompt.doc_bounds
        out.append(document_warmup(prompt.input_ids[:start], prompt.input_ids[start:end]))
    return out


def precompute(
    url: str,
    prompts: Sequence[tuple[list[int], list[int]]],
    concurrency: int = 4,
    progress: Optional[Callable[[int, int], None]] = None,
    timeout_s: float = 600.0,
) -> PrecomputeResult:
    """Send every warm-up request (``concurrency`` at a time); count what failed."""
    session = requests.Session()
    done = failed = 0
    start = time.perf_counter()

    def one(prompt: tuple[list[int], list[int]]) -> bool:
        ids, bounds = prompt
        payload = {
            "input_ids": ids,
            "sampling_params": {
                "max_new_tokens": 0,
                "temperature": 0.0,
                "custom_params": {"pcr_doc_bounds": bounds, "pcr_doc_warm": True},
            },
        }
        try:
            response = session.post(f"{url}/generate", json=payload, timeout=timeout_s)
        except requests.RequestException as e:
            logger.warning("a document's warm-up failed: %s", e)
            return False
        if response.status_code != 200:
            logger.warning("a document's warm-up failed (%s): %s", response.status_code, response.text[:200])
            return False
        return True

    with ThreadPoolExecutor(max(concurrency, 1)) as pool:
        for ok in pool.map(one, prompts):
            done += 1
            failed += not ok
            if progress is not None:
                progress(done, len(prompts))
    return PrecomputeResult(len(prompts), sum(len(ids) for ids, _ in prompts), failed, time.perf_counter() - start)


def wait_for_ssd_writes(url: str, timeout_s: float = 600.0) -> bool:
    """Poll ``/server_info`` until no SSD write is in flight; False on timeout or without
    an SSD tier."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        info = requests.get(f"{url}/server_info", timeout=30).json()
        states = [s["pcr"] for s in info.get("internal_states") or [] if "pcr" in s]
        if not states or states[0].get("ssd") is None:
            return False
        if all(s["ssd"]["writes_in_flight"] == 0 for s in states):
            return True
        time.sleep(0.5)
    return False


def read_corpus(path: Path, doc_format: str) -> list[str]:
    texts = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                texts.append(doc_format.format_map(record) if isinstance(record, dict) else str(record))
            except (json.JSONDecodeError, KeyError) as e:
                raise SystemExit(f"{path}:{number}: {e!r} (each line: a JSON object with the --doc-format fields)")
    return texts


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pcr_tools.precompute", description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True, help="the running server (started with --pcr-doc-reuse)")
    parser.add_argument("--model-path", required=True, help="its model (for the tokenizer and chat template)")
    parser.add_argument("--corpus", type=Path, required=True, help="JSONL, one document object per line")
    parser.add_argument("--system", default="", help="the system prompt the traffic uses")
    parser.add_argument(
        "--doc-format",
        default=DEFAULT_DOC_FORMAT.replace("{doc}", "{text}"),
        help="how a document appears in a prompt, from its JSON fields (default: %(default)r)",
    )
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--no-wait", action="store_true", help="return before SSD write-back finishes")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model_path)
    prompts = document_requests(tokenizer, args.system, read_corpus(args.corpus, args.doc_format))
    step = max(len(prompts) // 20, 1)

    def progress(done: int, total: int) -> None:
        if done % step == 0 or done == total:
            print(f"precompute: {done}/{total} documents", file=sys.stderr, flush=True)

    result = precompute(args.url, prompts, args.concurrency, progress)
    on_disk = False if args.no_wait else wait_for_ssd_writes(args.url)
    print(
        f"precomputed {result.documents - result.failed}/{result.documents} documents ({result.tokens} prompt "
        f"tokens) in {result.seconds:.1f} s; {'on the SSD tier' if on_disk else 'not known to be on SSD'}"
    )
    return 1 if result.failed else 0


if __name__ == "__main__":
    sys.exit(main())
