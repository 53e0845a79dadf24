"""Questions that test document reuse, from the shipped Wikipedia corpus, split by article.

Every question is about a document that is *not* first in its prompt (the first document's
KV is exact in every reuse mode, so a question about it tests nothing):

- ``lead``: "What is <title>?", scored against the article's lead sentence (F1, ROUGE-L,
  teacher-forced NLL of the sentence).
- ``needle``: a short fact planted in the document (a five-digit number or a person's
  name), asked for by name, scored by exact match (the answer contains the value).
- ``two_hop``: one document names a person, another says where that person was born; the
  question needs both. Scored by exact match of the city.

The split is by article (a stable hash of the title): the tuning (:mod:`.train`) draws
only ``train`` articles, the benchmark only ``test`` ones, so no test article is seen in
training. Planted values are drawn per question from a seeded RNG.
"""

from __future__ import annotations

import hashlib
import itertools
import random
import re
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Sequence

from pcr_client.prompt import DocPrompt, build_doc_prompt
from pcr_tools.data import Article, load_wiki_articles
from pcr_tools.workload import SYSTEM_PROMPT

Split = Literal["train", "test"]
KINDS = ("lead", "needle", "two_hop")
TEST_SHARE_PERCENT = 20
MAX_DOC_CHARS = 420  # about 100 tokens: the lead paragraph
MIN_DOC_CHARS = 120

_FIRST_NAMES = (
    "Amara",
    "Bohdan",
    "Carmen",
    "Dmitri",
    "Elif",
    "Farid",
    "Greta",
    "Hiroshi",
    "Ines",
    "Jonas",
    "Keziah",
    "Lorenzo",
    "Marisol",
    "Nikolai",
    "Oona",
    "Priya",
    "Quentin",
    "Rosalind",
    "Soren",
    "Thandiwe",
    "Ulrich",
    "Valentina",
    "Wendell",
    "Ximena",
    "Yusuf",
    "Zofia",
)
_LAST_NAMES = (
    "Abernathy",
    "Balogun",
    "Castellano",
    "Drummond",
    "Eriksen",
    "Fairweather",
    "Gallagher",
    "Halvorsen",
    "Iwasaki",
    "Jablonski",
    "Kowalczyk",
    "Lindqvist",
    "Montgomery",
    "Nakagawa",
    "Okonkwo",
    "Pemberton",
    "Quiroga",
    "Rasmussen",
    "Szabo",
    "Thornbury",
    "Underwood",
    "Vasquez",
    "Whitlock",
    "Yamamoto",
    "Zielinski",
)
_CITIES = (
    "Tromso",
    "Valparaiso",
    "Ljubljana",
    "Mombasa",
    "Winnipeg",
    "Tbilisi",
    "Cartagena",
    "Hobart",
    "Kraków",
    "Porto Alegre",
    "Bergen",
    "Nagasaki",
    "Adelaide",
    "Marrakesh",
    "Tallinn",
    "Cusco",
    "Halifax",
    "Dunedin",
    "Zanzibar",
    "Salzburg",
)
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def article_split(title: str) -> Split:
    """``test`` for a stable ``TEST_SHARE_PERCENT`` of titles, ``train`` for the rest."""
    digest = hashlib.blake2b(title.encode("utf-8"), digest_size=8).digest()
    return "test" if int.from_bytes(digest, "big") % 100 < TEST_SHARE_PERCENT else "train"


def lead_sentence(text: str) -> str:
    return _SENTENCE_END.split(text.strip(), maxsplit=1)[0]


def document_text(article: Article, max_chars: int = MAX_DOC_CHARS) -> str:
    """The article's first sentences, up to ``max_chars`` (at least the lead sentence)."""
    sentences = _SENTENCE_END.split(article.text.strip())
    kept = [sentences[0]]
    for sentence in sentences[1:]:
        if len(" ".join(kept + [sentence])) > max_chars:
            break
        kept.append(sentence)
    return " ".join(kept)


def split_articles(split: Split) -> list[Article]:
    """The split's articles long enough to ask about, in corpus order."""
    return [
        a for a in load_wiki_articles() if article_split(a.title) == split and len(document_text(a)) >= MIN_DOC_CHARS
    ]


@dataclass(frozen=True)
class Question:
    """One prompt's content: documents in prompt order, the question, the gold answer, and
    which documents it is about (``targets``: indices into ``documents``)."""

    kind: str
    documents: tuple[str, ...]
    question: str
    gold: str
    targets: tuple[int, ...]
    titles: tuple[str, ...] = field(default=())

    def prompt(self, tokenizer: Any, system: str = SYSTEM_PROMPT) -> DocPrompt:
        return build_doc_prompt(tokenizer, system, list(self.documents), self.question)

    def shuffled(self, rng: random.Random) -> "Question":
        """The same question with the documents in another order that keeps every target
        off the first position (the noise floor: full prefill when only the order moves)."""
        identity = tuple(range(len(self.documents)))
        valid = [
            order
            for order in itertools.permutations(identity)
            if order != identity and all(order.index(t) != 0 for t in self.targets)
        ]
        if not valid:
            raise ValueError(f"no other order of {len(identity)} documents keeps targets {self.targets} off the first")
        order = list(rng.choice(valid))
        return Question(
            self.kind,
            tuple(self.documents[i] for i in order),
            self.question,
            self.gold,
            tuple(order.index(t) for t in self.targets),
            tuple(self.titles[i] for i in order) if self.titles else (),
        )


def _doc(article: Article, planted: Optional[str] = None) -> str:
    text = document_text(article)
    if planted:
        lead, _, rest = text.partition(". ")
        text = f"{lead}. {planted} {rest}".strip() if rest else f"{text} {planted}"
    return f"{article.title}:\n{text}"


def _name(rng: random.Random) -> str:
    return f"{rng.choice(_FIRST_NAMES)} {rng.choice(_LAST_NAMES)}"


def make_question(
    kind: str, articles: Sequence[Article], rng: random.Random, *, documents: int = 3, allow_first: bool = False
) -> Question:
    """One question of ``kind`` over ``documents`` distinct articles drawn from ``articles``.
    Targets are never first unless ``allow_first`` (training may ask about any position)."""
    if kind not in KINDS:
        raise ValueError(f"unknown question kind {kind!r}: one of {', '.join(KINDS)}")
    if documents < (3 if kind == "two_hop" else 2):
        raise ValueError(f"a {kind} question needs more documents than {documents}")
    picked = rng.sample(list(articles), documents)
    positions = list(range(documents)) if allow_first else list(range(1, documents))
    if kind == "two_hop":
        first, second = rng.sample(positions, 2)
        person, city = _name(rng), rng.choice(_CITIES)
        subject = picked[first].title
        texts = [_doc(a) for a in picked]
        texts[first] = _doc(picked[first], f"The {subject} archive was founded by {person}.")
        texts[second] = _doc(picked[second], f"{person} was born in {city}.")
        question = f"In which city was the founder of the {subject} archive born?"
        return Question(kind, tuple(texts), question, city, (first, second), tuple(a.title for a in picked))
    target = rng.choice(positions)
    subject = picked[target].title
    texts = [_doc(a) for a in picked]
    if kind == "lead":
        return Question(
            kind,
            tuple(texts),
            f"What is {subject}?",
            lead_sentence(picked[target].text),
            (target,),
            tuple(a.title for a in picked),
        )
    if rng.random() < 0.5:
        value = f"{rng.randrange(10000, 100000)}"
        fact, question = f"The registry number of {subject} is {value}.", f"What is the registry number of {subject}?"
    else:
        value = _name(rng)
        fact, question = f"The curator of {subject} is {value}.", f"Who is the curator of {subject}?"
    texts[target] = _doc(picked[target], fact)
    return Question(kind, tuple(texts), question, value, (target,), tuple(a.title for a in picked))


def question_set(
    split: Split, count: int, seed: int, *, kinds: Sequence[str] = KINDS, documents: int = 3, allow_first: bool = False
) -> list[Question]:
    """``count`` questions over ``split``'s articles, the kinds in turn, reproducible from ``seed``."""
    rng = random.Random(f"{split}:{seed}")
    articles = split_articles(split)
    return [
        make_question(kinds[i % len(kinds)], articles, rng, documents=documents, allow_first=allow_first)
        for i in range(count)
    ]
