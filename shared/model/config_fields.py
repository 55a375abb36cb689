"""Checks and readings of config.json fields that both families' configs share."""

from __future__ import annotations


def require_positive(config: object, names: tuple[str, ...], *, zero_ok: tuple[str, ...] = ()) -> None:
    """ValueError naming the first field of `names` that is not an integer >= 1 (>= 0 for the
    fields in zero_ok); bools are not integers here (json's true would pass as 1)."""
    for name in names:
        value = getattr(config, name)
        low = 0 if name in zero_ok else 1
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            kind = "a non-negative" if low == 0 else "a positive"
            raise ValueError(f"config {name} = {value!r} must be {kind} integer")


def eos_token_ids(raw: dict, fallback: dict | None = None) -> tuple[int, ...]:
    """config.json's eos_token_id (one id or a list; `fallback`'s where `raw` has none) as a tuple."""
    eos = raw.get("eos_token_id", (fallback or {}).get("eos_token_id"))
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (eos,)
