import random
import re

import pytest

from lm.demo.stories import SEPARATOR, article, generate_story, main, say, write_corpus

WORD = re.compile(r"[a-z]+(?:'[a-z]+)?")


def stories(seed: int, n: int) -> list[str]:
    rng = random.Random(seed)
    return [generate_story(rng) for _ in range(n)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("stories") / "corpus.txt"
    stats = write_corpus(path, 1_000_000, seed=3)
    return path, stats, path.read_text(encoding="utf-8")


def test_deterministic_for_a_seed_and_different_across_seeds():
    assert stories(0, 30) == stories(0, 30)
    assert stories(0, 30) != stories(1, 30)
    assert len(set(stories(0, 200))) == 200


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_story_is_well_formed(seed):
    for story in stories(seed, 300):
        assert story.strip() == story and story
        assert story[0].isupper(), story
        assert re.search(r'[.!?]"?$', story), story
        assert "{" not in story and "}" not in story, story
        assert "<|endoftext|>" not in story
        assert "  " not in story and " ." not in story and " ," not in story, story
        for paragraph in story.split("\n\n"):
            assert paragraph.count('"') % 2 == 0, paragraph
            for sentence in re.split(r"(?<=[.!?]) ", paragraph):
                assert sentence.lstrip('"')[:1].isupper() or sentence[:1].isdigit(), (sentence, story)
        assert 80 <= len(story.split()) <= 250, story


def test_article_follows_the_sound():
    assert [article(w) for w in ["apple", "ball", "old hat", "umbrella", "unicorn", "egg", "red kite"]] == [
        "an", "a", "an", "an", "a", "an", "a"]


def test_dialogue_punctuation():
    lines = {say(random.Random(s), "Tom", "I am hungry.") for s in range(50)}
    assert lines == {'Tom said, "I am hungry."', '"I am hungry," said Tom.', '"I am hungry," Tom said.'}
    assert {say(random.Random(s), "she", "Where is it?", "asked") for s in range(50)} == {
        'She asked, "Where is it?"', '"Where is it?" she asked.'}


def test_write_corpus(corpus):
    path, stats, text = corpus
    assert stats["synthetic"] is True
    assert stats["bytes"] == path.stat().st_size >= 1_000_000
    assert text.endswith(SEPARATOR) and not text.startswith(SEPARATOR.strip())
    assert text.count("<|endoftext|>") == stats["stories"] > 500
    parts = text.split(SEPARATOR)
    assert parts[-1] == "" and all(parts[:-1])
    assert [p for p in path.parent.iterdir()] == [path]  # written atomically: no temporary file left


def test_corpus_grammar_spot_checks(corpus):
    _, _, text = corpus
    assert not re.findall(r"\b[Aa] (?!uni|use|one)[aeiou]\w*", text)[:5]  # "a apple"
    assert not re.findall(r"\b[Aa]n (?!hour|honest)[b-df-hj-np-tv-z]\w*", text)[:5]  # "an ball"
    assert not re.findall(r"\b(?:said|asked|shouted|cried|whispered) (?:he|she|they)\b", text)[:5]
    assert not re.search(r"\b(?:He|She) (?:were)\b|\bThey was\b", text)


def test_vocabulary_is_neither_trivial_nor_unlearnable(corpus):
    _, stats, text = corpus
    words = set(WORD.findall(text.replace("<|endoftext|>", "").lower()))
    assert stats["distinct_words"] == len(words)
    assert 400 <= len(words) <= 5000


def test_command_line(tmp_path, capsys):
    out = tmp_path / "s.txt"
    assert main(["--bytes", "5000", "--out", str(out), "--seed", "7"]) == 0
    assert out.stat().st_size >= 5000
    assert "synthetic" in capsys.readouterr().out
    write_corpus(tmp_path / "t.txt", 5000, seed=7)
    assert out.read_text() == (tmp_path / "t.txt").read_text()
