"""Which tokens of a decode-first batch the fused prologue runs, when one half is switched off.

``FUSEMLA_FUSED_DECODE`` / ``FUSEMLA_FUSED_PREFILL`` (or a layer's config) may hand one half of a
batch back to the caller's other path (the reference in :class:`fusemla.MLAAttention`, vLLM's
own RoPE and cache write in the vLLM plugin). :func:`split_halves` is the one place that cuts
the batch: the fused launch covers one contiguous span (decode tokens first, so a span is never
split), and every token is in exactly one span, so each is rotated once and written once.
Plain Python, no torch: both callers use it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Span:
    """Tokens ``[lo, hi)`` of the batch, the first ``num_decode_tokens`` of them decode."""

    lo: int
    hi: int
    num_decode_tokens: int
    fused: bool  # True: fusemla's prologue; False: the caller's other path

    def __len__(self) -> int:
        return self.hi - self.lo


@dataclass(frozen=True)
class HalfSplit:
    """The spans of one batch (in batch order, none empty) and who runs each half."""

    spans: tuple[Span, ...]
    decode_fused: bool  # the decode tokens (if any) run fused
    prefill_fused: bool  # the prefill tokens (if any) run fused

    @property
    def fused(self) -> Span | None:
        """The fused launch's span (at most one), or None."""
        return next((s for s in self.spans if s.fused), None)


def split_halves(N: int, D: int, fused_decode: bool, fused_prefill: bool) -> HalfSplit:
    """Cut ``N`` tokens (the first ``D`` decode) into the fused span and the other path's.

    Both halves the same way: one span over the whole batch. Otherwise the decode span
    ``[0, D)`` and the prefill span ``[D, N)``, each run by its own half's path.
    """
    if not 0 <= D <= N:
        raise ValueError(f"split_halves: expected 0 <= D <= N, got D={D}, N={N}")
    if fused_decode == fused_prefill:
        spans = (Span(0, N, D, fused_decode),) if N > 0 else ()
    else:
        spans = tuple(
            s for s in (Span(0, D, D, fused_decode), Span(D, N, 0, fused_prefill)) if len(s) > 0
        )
    return HalfSplit(spans, decode_fused=fused_decode, prefill_fused=fused_prefill)
