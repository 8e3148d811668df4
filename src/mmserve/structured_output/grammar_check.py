"""Which rules of a grammar can never finish: the check that refuses `root ::= root` and its kin.

A rule is productive when some alternative derives a finite string; a rule reachable from `root`
that is not productive is a dead end (`root ::= "a" x | "b"` with `x ::= x` lets a request emit
"a" and then no token at all). No useful grammar has one, so the front end refuses them up front.

This reads xgrammar's serialized grammar (every JSON schema, regex and EBNF spec becomes one): a
flat array of expressions `[type, length, data...]`. Only the serialization version checked here
is read; for any other, or any expression type not listed, the answer errs on "productive", so
an unknown format never refuses a grammar.
"""

from __future__ import annotations

import json

import xgrammar as xgr

KNOWN_VERSION = "v18"   # xgrammar 0.2.x
BYTES, CHAR_CLASS, CHAR_CLASS_STAR, EMPTY, RULE_REF, SEQUENCE, CHOICES, TAG_DISPATCH, REPEAT = range(9)
MAX_CODEPOINT = 0x10FFFF


def dead_rules(grammar: xgr.Grammar) -> list[str]:
    """Names of the rules reachable from the root that can never finish, the root first if it is one
    (empty: none, or a format this does not read)."""
    data = json.loads(grammar.serialize_json())
    if data.get("__VERSION__") != KNOWN_VERSION:
        return []
    flat, starts = data["grammar_expr_data"], data["grammar_expr_indptr"]
    exprs = [flat[s:s + 2 + flat[s + 1]] for s in starts]
    bodies = [rule[1] for rule in data["rules"]]
    productive = [False] * len(bodies)
    changed = True
    while changed:   # least fixed point: a rule is productive once one alternative is
        changed = False
        for r, body in enumerate(bodies):
            if not productive[r] and _productive(exprs, body, productive):
                productive[r] = changed = True
    root = data["root_rule_id"]
    reachable = _reachable(exprs, bodies, root)
    return [data["rules"][r][0] for r in sorted(reachable, key=lambda r: (r != root, r)) if not productive[r]]


def _productive(exprs: list[list[int]], e: int, rules: list[bool]) -> bool:
    kind, _, *args = exprs[e]
    if kind == CHAR_CLASS:
        return _class_nonempty(args)
    if kind == RULE_REF:
        return rules[args[0]]
    if kind == SEQUENCE:
        return all(_productive(exprs, child, rules) for child in args)
    if kind == CHOICES:
        return any(_productive(exprs, child, rules) for child in args)
    if kind == REPEAT:   # [rule, min, max]
        return args[1] == 0 or rules[args[0]]
    return True   # bytes, empty, a starred class, tag dispatch, anything newer


def _class_nonempty(args: list[int]) -> bool:
    negated, ranges = args[0], sorted(zip(args[1::2], args[2::2], strict=True))
    if not negated:
        return any(lo <= hi for lo, hi in ranges)
    covered = -1   # the class is empty when its excluded ranges cover every code point
    for lo, hi in ranges:
        if lo > covered + 1:
            return True
        covered = max(covered, hi)
    return covered < MAX_CODEPOINT


def _reachable(exprs: list[list[int]], bodies: list[int], root: int) -> set[int]:
    seen, todo = {root}, [root]
    while todo:
        stack = [bodies[todo.pop()]]
        while stack:
            kind, _, *args = exprs[stack.pop()]
            refs = args[:1] if kind in (RULE_REF, REPEAT) else []
            if kind in (SEQUENCE, CHOICES):
                stack += args
            for r in refs:
                if r not in seen:
                    seen.add(r)
                    todo.append(r)
    return seen
