"""Structured outputs: what a request constrains its output to (`params`, pure) and the
grammars that enforce it (`grammars`, xgrammar)."""
