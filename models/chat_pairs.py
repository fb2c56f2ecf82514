"""Instruction/answer pairs made from Python source: "Write a function that <its docstring's first line>" -> the function.

Every function (methods too, dedented) without decorators whose docstring opens with a capitalised line of
3-16 words gives one pair: the line, its first word put in the third person ("Return the lines" -> "returns
the lines"), becomes the request; the function without its docstring, if that still parses and has a body,
becomes the answer. Functions over MAX_ANSWER_CHARS are left out: a model this small is meant to learn
short, complete answers that end. A file gives at most MAX_PAIRS_PER_FILE pairs, its top-level functions first.
"""

import ast
import re
import textwrap

MAX_ANSWER_CHARS = 300
MAX_PAIRS_PER_FILE = 20  # tkinter alone would give 400 look-alike `self.tk.call(self._w, ...)` methods
# first words of docstrings that describe rather than command ("The ...", "Helper for ...")
NOT_VERBS = {
    "a",
    "an",
    "the",
    "this",
    "these",
    "if",
    "in",
    "for",
    "helper",
    "internal",
    "private",
    "like",
    "same",
    "used",
    "called",
    "given",
    "when",
    "see",
    "deprecated",
    "utility",
    "function",
    "method",
    "note",
    "wrapper",
}


def third_person(verb: str) -> str:
    """ "Return" -> "returns", "Fetch" -> "fetches", "Copy" -> "copies"; a word already ending in s is kept."""
    word = verb.lower()
    if word.endswith("s") and not word.endswith("ss"):
        return word
    if re.search(r"(ss|sh|ch|x|z|o)$", word):
        return word + "es"
    if re.search(r"[^aeiou]y$", word):
        return word[:-1] + "ies"
    return word + "s"


def function_pairs(source: str) -> list[tuple[str, str]]:
    """(request, answer) for each usable function of one source file; [] when it does not parse."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    lines = source.splitlines()
    pairs = []
    for node in ast.walk(tree):  # breadth first: top-level functions, then methods
        if len(pairs) == MAX_PAIRS_PER_FILE:
            break
        if not isinstance(node, ast.FunctionDef) or node.decorator_list or len(node.body) < 2:
            continue
        docstring = ast.get_docstring(node)
        if not docstring:
            continue
        words = docstring.strip().splitlines()[0].strip().rstrip(".").split()
        if not 3 <= len(words) <= 16 or not words[0].isalpha() or not words[0][0].isupper():
            continue
        if words[0].lower() in NOT_VERBS:
            continue
        doc_node = node.body[0]
        kept = lines[node.lineno - 1 : doc_node.lineno - 1] + lines[doc_node.end_lineno : node.end_lineno]
        answer = textwrap.dedent("\n".join(kept)).rstrip()
        if len(answer) > MAX_ANSWER_CHARS:
            continue
        try:
            ast.parse(answer)
        except SyntaxError:  # e.g. a one-line def whose docstring shared its line
            continue
        pairs.append(("Write a function that " + " ".join([third_person(words[0]), *words[1:]]), answer))
    return pairs


def defines_function(text: str) -> bool:
    """Whether text parses as Python (ast.parse) and defines a function: what the chat check counts."""
    try:
        return any(isinstance(node, ast.FunctionDef) for node in ast.walk(ast.parse(text)))
    except SyntaxError:
        return False
