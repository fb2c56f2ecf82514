"""Incremental detokenization that never emits a broken UTF-8 character, with stop strings.

A byte-level BPE token can end in the middle of a multi-byte character; decoding it alone gives
U+FFFD. We decode a small window (prefix_offset..end) and only take the text past read_offset once
it no longer ends in U+FFFD, as TGI and vLLM do.
"""

PROMPT_CONTEXT_TOKENS = 5  # prompt tokens kept as decoding context (leading-space rules)


class IncrementalDetokenizer:
    def __init__(
        self, tokenizer, prompt_token_ids: list[int], stop: list[str], skip_special_tokens: bool = True
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = stop
        self.tokens = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)
        self.text = ""  # the output text so far (cut at a stop string once one matched)
        self.hold = max((len(s) for s in stop), default=1) - 1  # chars a partial stop string may span

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=self.skip_special_tokens)

    def add_token(self, token_id: int) -> str | None:
        """Decode one more token; return the stop string it completed, if any."""
        self.tokens.append(token_id)
        prefix_text = self._decode(self.tokens[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.tokens[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return None  # an incomplete character: wait for the next token
        searched_from = max(len(self.text) - self.hold, 0)
        self.text += new_text[len(prefix_text) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
        return self._match_stop(searched_from)

    def _match_stop(self, start: int) -> str | None:
        best: tuple[int, str] | None = None
        for stop in self.stop:
            at = self.text.find(stop, start)
            if at != -1 and (best is None or at < best[0]):
                best = (at, stop)
        if best is None:
            return None
        self.text = self.text[: best[0]]
        return best[1]

    def readable_length(self, finished: bool) -> int:
        """Chars of text safe to hand out: all when finished, else all but a possible partial stop."""
        return len(self.text) if finished or not self.stop else max(len(self.text) - self.hold, 0)
