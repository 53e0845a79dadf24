"""How a numeric PCR flag declares the values it allows, beside SGLang's ``Arg``.

Its own module because every group of flag declarations (``flags_cache``,
``flags_documents``, ``flags``) puts one in its annotations, and ``config.py`` reads it;
like them it is imported while SGLang assembles ``ServerArgs``, so it imports nothing of
the package.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Range:
    """A numeric flag's allowed values, beside its ``Arg`` in the annotation: at least ``ge``
    (or more than ``gt``), at most ``le``; ``unit`` names what it counts in messages
    ("a number of GB >= 0"). ``PCRConfig.validate`` checks every flag that has one, and the
    type its annotation gives (an int flag takes no bool or float); msgspec and argparse
    ignore it."""

    ge: Optional[float] = None
    gt: Optional[float] = None
    le: Optional[float] = None
    unit: str = ""
