r"""JSON strings kept JSON: xgrammar 0.2.9 lowers a string with `minLength`/`maxLength` to a bounded
repetition over `[^"\\\r\n]` (for `maxLength` 1 an optional one), which admits the control characters
U+0000-U+001F that JSON forbids unescaped (mlc-ai/xgrammar#800, fixes open, none released): a
constrained output such as `"\x15MMMMMM,"` ended by EOS and did not parse. Its negated string classes
also admit the UTF-8 forms of UTF-16 surrogates (U+D800-U+DFFF), which UTF-8 forbids: they detokenize
as three U+FFFD each, so a bounded string came out longer than its `maxLength`, and any string as
other text than its tokens. Until a fixed release, every string character class of a compiled
schema's grammar is narrowed to `[^\0-\x1f"\\\uD800-\uDFFF]` and the grammar re-parsed. Escapes stay
unreachable in bounded strings, as in 0.2.9: fewer strings, every one of them valid JSON and UTF-8,
counted in characters as JSON Schema counts.
"""

from __future__ import annotations

import xgrammar as xgr

# As xgrammar 0.2.9 prints a bounded string's character and an unbounded string's unescaped one.
STRING_CLASSES = (r'[^\"\\\r\n]', r'[^\0-\x1f\"\\\r\n]')
JSON_STRING_CLASS = r'[^\0-\x1f\"\\\uD800-\uDFFF]'


def json_safe_strings(grammar: xgr.Grammar) -> xgr.Grammar:
    """`grammar` (from a JSON schema) with every string's unescaped characters limited to those JSON
    and UTF-8 allow; the same grammar object when it has none to narrow."""
    text = str(grammar)
    fixed = _replace_classes(text, STRING_CLASSES, JSON_STRING_CLASS)
    return xgr.Grammar.from_ebnf(fixed, root_rule_name="root") if fixed != text else grammar


def _replace_classes(ebnf: str, old: tuple[str, ...], new: str) -> str:
    """`ebnf` with each character class spelled exactly as one of `old` replaced by `new`; quoted
    literals (and so a Regex's text) are copied untouched, whatever they spell."""
    out, i = [], 0
    while i < len(ebnf):
        ch = ebnf[i]
        if ch in '"[':
            close = '"' if ch == '"' else "]"
            j = i + 1
            while j < len(ebnf) and ebnf[j] != close:
                j += 2 if ebnf[j] == "\\" else 1
            token = ebnf[i:j + 1]
            out.append(new if token in old else token)
            i = j + 1
        else:
            out.append(ch)
            i += 1
    return "".join(out)
