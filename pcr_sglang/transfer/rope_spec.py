"""RopeSpec: what rotating a cached K by a position delta needs to know of a model's RoPE.

Kept apart from the rotation (:mod:`pcr_sglang.transfer.rope_shift`: the torch path and
the Triton kernel) because it is plain data with a job of its own: it is built from a live
SGLang module (:mod:`pcr_sglang.reuse.model_rope`), validated, and digested by
:meth:`RopeSpec.signature` for cache keys, none of which needs torch or Triton.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass


@dataclass(frozen=True)
class RopeSpec:
    """What rotating a cached K needs: the head layout, the pairing and the frequencies.

    ``inv_freq[i]`` is the angle per position of pair ``i`` (rad/token), with every
    scaling that multiplies positions already folded in (linear scaling: the base
    frequencies divided by the factor). Pairing: NeoX style rotates ``(i, i + r/2)``,
    GPT-J style ``(2i, 2i + 1)``, for ``i < r/2`` with ``r = rotary_dim``; dims at and
    beyond ``rotary_dim`` carry no position and pass through.

    The constructor normalises ``inv_freq`` to a tuple of floats and validates.
    """

    head_dim: int
    rotary_dim: int
    is_neox_style: bool
    inv_freq: tuple[float, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "inv_freq", tuple(float(f) for f in self.inv_freq))
        self.validate()

    def validate(self) -> None:
        """Raise ValueError (naming the field) if this spec cannot describe a RoPE."""
        if not isinstance(self.head_dim, int) or self.head_dim <= 0:
            raise ValueError(f"RopeSpec.head_dim must be a positive int, got {self.head_dim!r}")
        if not isinstance(self.rotary_dim, int) or self.rotary_dim <= 0:
            raise ValueError(f"RopeSpec.rotary_dim must be a positive int, got {self.rotary_dim!r}")
        if self.rotary_dim % 2:
            raise ValueError(f"RopeSpec.rotary_dim must be even (dims rotate in pairs), got {self.rotary_dim}")
        if self.rotary_dim > self.head_dim:
            raise ValueError(f"RopeSpec.rotary_dim {self.rotary_dim} exceeds head_dim {self.head_dim}")
        if len(self.inv_freq) != self.rotary_dim // 2:
            raise ValueError(
                f"RopeSpec.inv_freq has {len(self.inv_freq)} frequencies; rotary_dim "
                f"{self.rotary_dim} needs {self.rotary_dim // 2}"
            )
        bad = [i for i, f in enumerate(self.inv_freq) if not math.isfinite(f)]
        if bad:
            raise ValueError(f"RopeSpec.inv_freq is not finite at pairs {bad[:8]}")

    @property
    def half(self) -> int:
        return self.rotary_dim // 2

    def signature(self) -> str:
        """A 16-hex-digit digest of every field, stable across processes and machines
        (frequencies hashed by their exact bits), for use in cache keys."""
        text = "rope-v1|%d|%d|%d|%s" % (
            self.head_dim,
            self.rotary_dim,
            int(self.is_neox_style),
            ",".join(f.hex() for f in self.inv_freq),
        )
        return hashlib.sha256(text.encode()).hexdigest()[:16]
