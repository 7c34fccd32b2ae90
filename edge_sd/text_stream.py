"""Accepted tokens -> committed ids and printable text, with every stop where plain decoding has it.

Plain and speculative decoding both push their emitted tokens through a TextStream, in order, so that
EOS, stop strings and `max_new_tokens` end a generation at the same token whichever way it was
decoded (a round may accept several tokens; whatever stop comes first among them wins). The shape is
that of Hugging Face's stopping criteria plus its text streamer, or onnxruntime-genai's tokenizer stream:

- EOS ends the output before it (EOS itself is not part of the output);
- a stop string ends it after the token that completes it (plain decoding generated that token, so
  the ids keep it); the text ends where the stop string begins, as OpenAI's API, vLLM and llama.cpp's
  server return it (`include_stop` keeps the stop string, and nothing of the token after it);
- text is handed out only where it can no longer change: bytes that may still become a stop string are
  held back, and so is a character whose UTF-8 bytes are not complete yet; `finish` hands out the rest
  (an incomplete character at the very end becomes U+FFFD, as in `bytes.decode(errors="replace")`).

So the pieces always add up to the text, and the text is the decoding of the ids' bytes cut at the
stop string: `vocab.ids_bytes(ids)[:text_bytes].decode("utf-8", errors="replace")`.
"""

from __future__ import annotations

import codecs

from edge_sd.vocab import Vocab


class TextStream:
    def __init__(self, vocab: Vocab, max_new_tokens: int, stops: tuple[bytes, ...] = (),
                 include_stop: bool = False):
        self.vocab = vocab
        self.include_stop = include_stop
        self.max_new_tokens = max_new_tokens
        self.stops = tuple(s for s in stops if s)
        self.eos = set(vocab.eos_ids)
        self.ids: list[int] = []
        self.generated = b""  # bytes of `ids`: the committed text the drafter is synced to
        self.reason = ""  # why the output ended: eos | stop | max_new_tokens | context ("" while going)
        self._longest_stop = max((len(s) for s in self.stops), default=0)
        self._handed = 0  # bytes of `generated` passed to the decoder
        self.text_bytes: int | None = None  # where the text ends in `generated` (None: at its end)
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
        """Whether the bytes added after `before` complete a stop string; if so, the text ends where the
        first of them begins (or ends, with include_stop)."""
        since = max(0, before - self._longest_stop + 1)
        found = [(at, at + len(s)) for s in self.stops if (at := self.generated.find(s, since)) >= 0]
        if found:
            start, end = min(found)
            self.text_bytes = end if self.include_stop else start
        return bool(found)

    def _text(self) -> str:
        # While going, hold back what may still be the start of a stop string; the decoder itself
        # holds back an incomplete character until its last byte arrives (or the end).
        if self.reason:
            upto = len(self.generated) if self.text_bytes is None else self.text_bytes
        else:
            upto = max(self._handed, len(self.generated) - max(0, self._longest_stop - 1))
        chunk = self.generated[self._handed : upto]
        self._handed = upto
        return self._decoder.decode(chunk, final=bool(self.reason))
