import pytest

from tests.transcription.wer import edit_distance, normalize, word_error_rate


def test_edit_distance_counts_substitutions_deletions_and_insertions():
    assert edit_distance("a b c".split(), "a b c".split()) == 0
    assert edit_distance("a b c".split(), "a x c".split()) == 1
    assert edit_distance("a b c".split(), "a c".split()) == 1
    assert edit_distance("a b c".split(), "a b c d e".split()) == 2
    assert edit_distance("a b".split(), []) == 2


def test_corpus_wer_sums_errors_over_all_reference_words():
    assert normalize("Turn off the lights, please.") == ["turn", "off", "the", "lights", "please"]
    assert word_error_rate(["one two three four", "five"], ["One two three four.", "six"]) == (
        pytest.approx(1 / 5)
    )
