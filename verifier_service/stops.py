"""Where a completion ends: eos tokens, the token budget, stop sequences; and text deltas."""

from __future__ import annotations

from dataclasses import dataclass, field

REPLACEMENT = "\ufffd"  # an incomplete UTF-8 sequence decodes to this: hold it back


@dataclass
class Completion:
    """The tokens and text sent to the client so far, and why the completion ended."""

    max_new_tokens: int
    eos_token_ids: frozenset[int]
    stop_sequences: tuple[str, ...]
    tokenizer: object | None
    token_ids: list[int] = field(default_factory=list)
    text: str = ""  # text sent so far
    finish_reason: str | None = None
    # Decoding is incremental: tokens before _stable_count decode to _stable_text and are
    # never decoded again (byte-level BPE decodes a suffix independently once its text is
    # complete, i.e. ends on a whole character).
    _stable_count: int = 0
    _stable_text: str = ""

    def _decode(self, extra: list[int]) -> str:
        """Text of token_ids + extra, decoding only what follows the stable prefix."""
        return self._stable_text + self.tokenizer.decode(self.token_ids[self._stable_count:] + extra)

    def extend(self, emitted: list[int]) -> tuple[list[int], str]:
        """Take a round's emitted tokens; returns (tokens to send, text delta)."""
        sent: list[int] = []
        for token in emitted:
            if token in self.eos_token_ids:
                self.finish_reason = "stop"
                break
            sent.append(token)
            if len(self.token_ids) + len(sent) >= self.max_new_tokens:
                self.finish_reason = "length"
                break
        if self.tokenizer is None:
            self.token_ids += sent
            return sent, ""
        if self.stop_sequences:
            sent = self._cut_at_stop(sent)
        self.token_ids += sent
        full = self._decode([])
        if not full.endswith(REPLACEMENT):
            self._stable_count, self._stable_text = len(self.token_ids), full
        if self.finish_reason == "stop_sequence":
            full = self._before_stop(full)
            self.finish_reason = "stop"
        elif self.finish_reason is None:
            full = full.rstrip(REPLACEMENT)  # wait for the rest of the character
            full = full[: len(full) - self._stop_prefix_length(full)]  # it may become a stop
        delta = full[len(self.text):] if full.startswith(self.text) else ""
        self.text += delta
        return sent, delta

    def _stop_prefix_length(self, text: str) -> int:
        """Length of the longest end of `text` that begins a stop sequence (held back)."""
        for length in range(min(len(text), max((len(x) for x in self.stop_sequences), default=0)), 0, -1):
            if any(stop.startswith(text[-length:]) for stop in self.stop_sequences):
                return length
        return 0

    def _before_stop(self, text: str) -> str:
        cut = min((text.find(s) for s in self.stop_sequences if s in text), default=len(text))
        return text[:cut]

    def _cut_at_stop(self, sent: list[int]) -> list[int]:
        for n in range(1, len(sent) + 1):
            text = self._decode(sent[:n])
            if any(s in text for s in self.stop_sequences):
                self.finish_reason = "stop_sequence"
                return sent[:n]
        return sent
