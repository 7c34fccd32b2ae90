"""Accepted tokens -> committed ids and printable text, with every stop where plain decoding has it.

Plain and speculative decoding both push their emitted tokens through a TextStream, in order, so that
EOS, stop strings and `max_new_tokens` end a generation at the same token whichever way it was
decoded (a round may accept several tokens; whatever stop comes first among them wins). The shape is
that of Hugging Face's stopping criteria plus its text streamer, or onnxruntime-genai's tokenizer stream:

- EOS ends the output before it (EOS itself is not part of the output);
- a stop string ends it after the token that completes it (as plain decoding would have generated that
  token); the stop string stays in the text, so that the text is always the decoding of the ids;
- text is handed out only where it can no longer change: bytes that may still become a stop string are
  held back, and so is a character whose UTF-8 bytes are not complete yet; `finish` hands out the rest
  (an incomplete character at the very end becomes U+FFFD, as in `bytes.decode(errors="replace")`).

So `"".join(pieces) == vocab.ids_bytes(ids).decode("utf-8", errors="replace")` for every generation.
"""

from __future__ import annotations

import codecs

from edge_sd.vocab import Vocab


class TextStream:
    def __init__(self, vocab: Vocab, max_new_tokens: int, stops: tuple[bytes, ...] = ()):
        self.vocab = vocab
        self.max_new_tokens = max_new_tokens
        self.stops = tuple(s for s in stops if s)
        self.eos = set(vocab.eos_ids)
        self.ids: list[int] = []
        self.generated = b""  # bytes of `ids`: the committed text the drafter is synced to
        self.reason = ""  # why the output ended: eos | stop | max_new_tokens | context ("" while going)
        self._longest_stop = max((len(s) for s in self.stops), default=0)
        self._handed = 0  # bytes of `generated` passed to the decoder
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    @property
    def done(self) -> bool:
        return bool(self.reason)

    @property
    def remaining(self) -> int:
        """Tokens that may still be emitted."""
        return self.max_new_tokens - len(self.ids)

    def push(self, tokens: list[int]) -> tuple[list[int], str]:
        """Commit `tokens` in order up to the first stop; returns (the ids committed, new printable text)."""
        kept: list[int] = []
        for t in tokens:
            if self.reason:
                break
            if t in self.eos:
                self.reason = "eos"
                break
            before = len(self.generated)
            self.generated += self.vocab.token_bytes[t] or b""
            self.ids.append(t)
            kept.append(t)
            if self.stops and self._stop_in(before):
                self.reason = "stop"
            elif len(self.ids) >= self.max_new_tokens:
                self.reason = "max_new_tokens"
        return kept, self._text()

    def finish(self, reason: str) -> str:
        """End the output (unless it has ended already) and return the text still held back."""
        self.reason = self.reason or reason
        return self._text()

    def _stop_in(self, before: int) -> bool:
        """Whether the bytes added after `before` complete a stop string."""
        since = max(0, before - self._longest_stop + 1)
        return any(self.generated.find(s, since) >= 0 for s in self.stops)

    def _text(self) -> str:
        # While going, hold back what may still be the start of a stop string; the decoder itself
        # holds back an incomplete character until its last byte arrives (or the end).
        upto = len(self.generated) if self.reason else max(self._handed,
                                                           len(self.generated) - max(0, self._longest_stop - 1))
        chunk = self.generated[self._handed : upto]
        self._handed = upto
        return self._decoder.decode(chunk, final=bool(self.reason))
