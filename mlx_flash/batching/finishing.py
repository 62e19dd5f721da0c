"""The token-finishing rules, written once: one sequence's text as its tokens arrive, and whether and
why it has finished. The single-sequence loop (`Engine.stream_tokens`), the throughput mode, the
server's continuous batch and a pipeline's calls all make text with it, so a sequence's text is the
same whichever of them ran it.

The rules: an end-of-sequence token finishes with "stop" (its text is not shown); a stop string
finishes with "stop" and the text is cut where it starts; the last token of the budget finishes
with "length". A stream shows only text that cannot still turn out to start a stop string.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..sampling import partial_stop


@dataclass
class TextStream:
    detok: object  # the tokenizer's StreamDecoder, started on the prompt
    text: str = ""
    finish_reason: str | None = None  # "stop" (EOS or a stop string) or "length" once finished
    ended_on_eos: bool = False
    emitted: int = 0  # characters of text handed out by delta()

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def add(self, token: int, eos_ids, stops, last: bool) -> None:
        """Account for the next token; `last`: it is the final one the token budget allows."""
        if token in eos_ids:
            self.text += self.detok.finalize()
            self.finish_reason, self.ended_on_eos = "stop", True
        else:
            self.text += self.detok.add_token(token)
        # a stop string may end in text the EOS flushed: looked for either way
        hits = [i for i in (self.text.find(s) for s in stops) if i >= 0]
        if hits:
            self.text, self.finish_reason = self.text[: min(hits)], "stop"
        elif self.finish_reason is None and last:
            self.text += self.detok.finalize()
            self.finish_reason = "length"

    def delta(self, stops) -> str:
        """The text made since the last delta, less a tail that may still turn out to start a stop
        string (all of it once finished): what a stream shows after each token."""
        safe = len(self.text) if self.done else len(self.text) - partial_stop(self.text, list(stops))
        out = self.text[self.emitted : safe]
        self.emitted = max(self.emitted, safe)
        return out
