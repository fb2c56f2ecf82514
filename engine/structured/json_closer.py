"""Closing a JSON reply before its token budget runs out, so that a constrained reply is valid JSON
even when the model would ramble past max_tokens (a small model in a free string or an open object).

A grammar mask keeps every token legal, but legal is not finished: a reply cut by max_tokens does not
parse. So while a JSON-constrained sequence nears the end of its budget, the closer plays the reply
forward on a copy of its matcher, cheapest continuation first (end the string, close the innermost
object or array, the shortest value the schema allows, llguidance's forced tokens for required keys),
and when that path plus CLOSE_SLACK tokens no longer fits in the budget it forces the path token by
token. The reply keeps everything the model wrote and ends as soon as the schema allows. A play-forward
costs 0.2-3 ms on the shipped tokenizer; it runs at the first step, then a quarter of the way to the
commit point each time (about 20 times for a 256-token budget), and no more once committed.

Only JSON constraints (json_schema, json_object, tools) are closed: for them the tokens' bytes say
where a string or a container ends. A regex or grammar may still be cut at max_tokens."""

import llguidance
import torch

CLOSE_SLACK = 16  # tokens kept spare when committing: one free token can open a nested required object
MAX_PATH = 512  # a closing path longer than this counts as none (a schema no budget can close)
_BITS = torch.arange(32, dtype=torch.int32)


class JsonCursor:
    """Where a compact JSON text stands: inside a string (after a backslash?), and the open containers."""

    __slots__ = ("in_string", "escaped", "stack")

    def __init__(self) -> None:
        self.in_string, self.escaped, self.stack = False, False, []

    def copy(self) -> "JsonCursor":
        cursor = JsonCursor()
        cursor.in_string, cursor.escaped, cursor.stack = self.in_string, self.escaped, list(self.stack)
        return cursor

    def feed(self, data: bytes) -> None:
        for byte in data:  # UTF-8 continuation bytes are never ASCII: byte-wise is exact
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif byte == 0x5C:  # backslash
                    self.escaped = True
                elif byte == 0x22:
                    self.in_string = False
            elif byte == 0x22:
                self.in_string = True
            elif byte in (0x7B, 0x5B):  # { [
                self.stack.append(byte)
            elif byte in (0x7D, 0x5D) and self.stack:
                self.stack.pop()

    def preferences(self) -> tuple[bytes, ...]:
        """Single characters that end the reply soonest from here, best first."""
        if self.in_string:
            return (b"n", b'"') if self.escaped else (b'"', b"1", b"a")
        close = b"}" if self.stack and self.stack[-1] == 0x7B else b"]"
        # a value where one is due: the shortest ones ("" 1 0 null), a container last
        return (close, b",", b":", b" ", b'"', b"1", b"0", b"n", b"t", b"f", b"-", b"[", b"{")


class TokenTable:
    """A tokenizer's single-byte tokens and token lengths, built once per engine (~0.1 s per 100k tokens)."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, eos_token_ids: frozenset[int]) -> None:
        self.bytes = [tokenizer.decode_bytes([i]) for i in range(tokenizer.vocab_size)]
        special = [tokenizer.is_special_token(i) for i in range(tokenizer.vocab_size)]
        self.single: dict[bytes, int] = {}
        for i, data in enumerate(self.bytes):
            if len(data) == 1 and not special[i]:
                self.single.setdefault(data, i)
        # fallback choice: the shortest allowed token; special tokens last
        self.length = torch.tensor(
            [1 << 20 if s else len(b) for s, b in zip(special, self.bytes, strict=True)], dtype=torch.int32
        )
        self.eos = min(eos_token_ids) if eos_token_ids else tokenizer.eos_token
        self._mask = torch.empty((tokenizer.vocab_size + 31) // 32, dtype=torch.int32)

    def closing_path(self, matcher: llguidance.LLMatcher, cursor: JsonCursor, limit: int) -> list[int] | None:
        """The tokens that end the reply from matcher's state, cheapest first; None past `limit` tokens."""
        m, c, path = matcher.deep_copy(), cursor.copy(), []
        while len(path) < limit:
            if m.is_stopped():
                return path
            forced = m.compute_ff_tokens()  # a required key, the rest of an enum's only match
            if forced:
                if not m.consume_tokens(forced):
                    return None
                path += forced
                for token in forced:
                    c.feed(self.bytes[token])
                continue
            if m.is_accepting():  # complete (a top-level value that could go on): end it
                return path + [self.eos]
            token = next(
                (
                    t
                    for t in (self.single.get(b) for b in c.preferences())
                    if t is not None and m.validate_tokens([t]) == 1
                ),
                None,
            )
            if token is None:
                token = self._shortest_allowed(m)
            if token is None or not m.consume_token(token):
                return None
            path.append(token)
            c.feed(self.bytes[token])
        return None

    def _shortest_allowed(self, matcher: llguidance.LLMatcher) -> int | None:
        mask = self._mask
        matcher.unsafe_compute_mask_ptr(mask.data_ptr(), mask.numel() * mask.element_size())
        allowed = ((mask[:, None] >> _BITS) & 1).flatten()[: self.length.numel()].bool()
        if not bool(allowed.any()):
            return None
        return int(self.length.masked_fill(~allowed, 1 << 30).argmin())


class JsonCloser:
    """One sequence's closing state: its cursor, and once committed, the path it is forced along."""

    def __init__(self, table: TokenTable) -> None:
        self.table, self.cursor, self.plan = table, JsonCursor(), []
        self.check_at: int | None = None  # the budget at or below which to play forward again

    def fork(self) -> "JsonCloser":
        twin = JsonCloser(self.table)
        twin.cursor, twin.plan, twin.check_at = self.cursor.copy(), list(self.plan), self.check_at
        return twin

    def accept(self, token_id: int) -> None:
        self.cursor.feed(self.table.bytes[token_id])
        if self.plan:
            if self.plan[0] == token_id:
                del self.plan[0]
            else:  # not the path's token (never, while the mask forces it): play forward again
                self.plan, self.check_at = [], None

    def forced(self, matcher: llguidance.LLMatcher, budget: int) -> int | None:
        """The token this step must take to close the reply within `budget` tokens (this one included)."""
        if not self.plan and (self.check_at is None or budget <= self.check_at):
            path = self.table.closing_path(matcher, self.cursor, MAX_PATH)
            length = MAX_PATH if path is None else len(path)
            if length + CLOSE_SLACK >= budget:
                self.plan = path or []
                self.check_at = 0
            else:  # look again a quarter of the way to the commit point: the path grows as the reply opens things
                self.check_at = budget - max(1, (budget - length - CLOSE_SLACK) // 4)
        return self.plan[0] if self.plan else None
