"""Word error rate: word-level edit distance over the number of reference words."""

from __future__ import annotations

import re


def normalize(text: str) -> list[str]:
    """Lower case words; punctuation and case are no recognition errors."""
    return re.sub(r"[^a-z0-9' ]", " ", text.lower()).split()


def edit_distance(reference: list[str], hypothesis: list[str]) -> int:
    """Substitutions, deletions and insertions that turn `reference` into `hypothesis`."""
    row = list(range(len(hypothesis) + 1))
    for i, ref_word in enumerate(reference, 1):
        diagonal, row[0] = row[0], i
        for j, hyp_word in enumerate(hypothesis, 1):
            diagonal, row[j] = (
                row[j],
                min(row[j] + 1, row[j - 1] + 1, diagonal + (ref_word != hyp_word)),
            )
    return row[-1]


def word_error_rate(references: list[str], hypotheses: list[str]) -> float:
    """Errors summed over all utterances over all reference words, as corpus WER is counted."""
    pairs = [(normalize(r), normalize(h)) for r, h in zip(references, hypotheses, strict=True)]
    return sum(edit_distance(r, h) for r, h in pairs) / sum(len(r) for r, _ in pairs)
