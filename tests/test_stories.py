import random
import re

import pytest

from lm.demo.stories import SEPARATOR, article, generate_story, main, make_cast, say, write_corpus

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
        # in lower case but for a capital that starts a name or sentence, and "I" and "A" (mutation: a
        # line of dialogue or a place said in capitals, and a verb shouted as "SAID", survived)
        words = re.findall(r"[A-Za-z]+(?:'[A-Za-z]+)*", story)
        assert [w for w in words if not re.fullmatch(r"[A-Z]?[a-z]+(?:'[a-z]+)*|I(?:'[a-z]+)?|A", w)] == [], story


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
    assert set(stats) == {"synthetic", "generator", "seed", "stories", "bytes", "distinct_words"}
    assert (stats["synthetic"], stats["generator"], stats["seed"]) == (True, "lm.demo.stories", 3)
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


def test_command_line(tmp_path, capsys, monkeypatch):
    out = tmp_path / "s.txt"
    assert main(["--bytes", "5000", "--out", str(out), "--seed", "7"]) == 0
    assert out.stat().st_size >= 5000
    assert "synthetic" in capsys.readouterr().out
    write_corpus(tmp_path / "t.txt", 5000, seed=7)
    assert out.read_text() == (tmp_path / "t.txt").read_text()
    monkeypatch.setenv("COLUMNS", "100")  # the help is wrapped to the terminal's width
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    shown = capsys.readouterr().out
    assert shown.startswith("usage: python -m lm.demo.stories [-h] [--bytes N] --out FILE [--overwrite] "
                            "[--seed SEED]\n")
    assert "\n  --bytes N    write at least this many bytes, a whole number (default 2000000)\n" in shown


def test_command_line_says_one_story_in_the_singular(tmp_path, capsys):
    assert main(["--bytes", "100", "--out", str(tmp_path / "s.txt")]) == 0
    assert capsys.readouterr().out.startswith("wrote 1 synthetic story, ")  # not "1 synthetic stories"


PROG = "python -m lm.demo.stories"


def _refused(argv: list[str], capsys) -> str:
    """The one line of a refused command (exit 2), with nothing on stdout and no traceback."""
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.splitlines()) == 1, captured
    return captured.err.strip()


def test_command_line_never_replaces_a_file_that_is_not_its_corpus(tmp_path, monkeypatch, capsys):
    """`--out precious.txt` replaced the file, rc 0: there was no --overwrite. A file that is not a
    corpus of this command is refused even with --overwrite."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "precious.txt").write_text("precious\n")
    for extra in ([], ["--overwrite"]):
        assert _refused(["--bytes", "1000", "--out", "precious.txt", *extra], capsys) == (
            f"{PROG}: error: --out: 'precious.txt' exists and is not a corpus this command wrote (text ending in "
            "<|endoftext|>); refusing to replace it")
    assert (tmp_path / "precious.txt").read_text() == "precious\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["precious.txt"]


def test_command_line_replaces_its_own_corpus_only_with_overwrite(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["--bytes", "2000", "--out", "s.txt", "--seed", "1"]) == 0
    first = (tmp_path / "s.txt").read_bytes()
    capsys.readouterr()
    assert _refused(["--bytes", "3000", "--out", "s.txt"], capsys) == (
        f"{PROG}: error: --out: 's.txt' exists; pass --overwrite to replace it")
    assert (tmp_path / "s.txt").read_bytes() == first
    assert main(["--bytes", "3000", "--out", "s.txt", "--seed", "2", "--overwrite"]) == 0
    assert (tmp_path / "s.txt").read_bytes() != first and (tmp_path / "s.txt").stat().st_size >= 3000
    assert main(["--bytes", "0", "--out", "empty.txt"]) == 0  # an empty corpus, which --overwrite replaces too
    assert main(["--bytes", "100", "--out", "empty.txt", "--overwrite"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.txt", "s.txt"]


@pytest.mark.parametrize("extra, message", [
    (["--bytes", "-5"], "--bytes: must be a whole number >= 0, got -5"),  # had been num_bytes's traceback
    (["--seed", "-1"], "--seed: must be a whole number in [0, 2**64-1], got -1"),  # as `lm demo --seed -1`
    (["--seed", str(2**64)], f"--seed: must be a whole number in [0, 2**64-1], got {2**64}"),
])
def test_command_line_bad_numbers_are_one_line(tmp_path, monkeypatch, capsys, extra, message):
    monkeypatch.chdir(tmp_path)
    assert _refused(["--out", "s.txt", "--bytes", "100", *extra], capsys) == f"{PROG}: error: {message}"
    assert list(tmp_path.iterdir()) == []


def test_command_line_bad_out_is_one_line(tmp_path, monkeypatch, capsys):
    """`--out .` was a traceback (OSError: [Errno 16] Device or resource busy: '.')."""
    import os

    monkeypatch.chdir(tmp_path)
    cases = [(".", "--out: '.' is a folder; give a file name"), ("", "--out: must not be empty")]
    if os.path.isdir("/proc/self"):
        cases.append(("/proc/x", "--out: '/proc/x' cannot be written: No such file or directory"))
    for out, message in cases:
        assert _refused(["--bytes", "100", "--out", out], capsys) == f"{PROG}: error: {message}"
    assert list(tmp_path.iterdir()) == []


def test_command_line_a_failed_write_is_one_line_and_leaves_nothing(tmp_path, monkeypatch, capsys):
    import errno
    import os

    def busy(src, dst):
        raise OSError(errno.EBUSY, os.strerror(errno.EBUSY), str(dst))

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(os, "replace", busy)
    assert _refused(["--bytes", "100", "--out", "s.txt"], capsys) == (
        f"{PROG}: error: --out: 's.txt' cannot be written: Device or resource busy")
    assert list(tmp_path.iterdir()) == []


def test_command_line_help_gives_the_default_as_bytes_takes_it(capsys):
    """--help said "(default 2e6)", which --bytes refuses ("invalid int value: '2e6'")."""
    with pytest.raises(SystemExit):
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default 2000000)" in text and "2e6" not in text and "--overwrite" in text


def test_a_longer_text_file_of_the_users_is_never_replaced_even_with_overwrite(tmp_path, monkeypatch, capsys):
    """A mutation (is_corpus no longer asks that the file end with the separator): the only test's
    file, "precious\\n", is shorter than the separator, so the size check refused it alone. Any
    longer UTF-8 note was then taken for a corpus and replaced by --overwrite."""
    monkeypatch.chdir(tmp_path)
    notes = "My notes for the talk on Thursday: bring the slides and the demo laptop.\n"
    (tmp_path / "notes.txt").write_text(notes)
    assert main(["--bytes", "1000", "--out", "notes.txt", "--overwrite"]) == 2
    assert capsys.readouterr().err == (f"{PROG}: error: --out: 'notes.txt' exists and is not a corpus this command "
                                       "wrote (text ending in <|endoftext|>); refusing to replace it\n")
    assert (tmp_path / "notes.txt").read_text() == notes


def test_write_corpus_stops_at_the_first_story_that_reaches_the_size(tmp_path):
    """A mutation (`size < num_bytes` read as `<=`): one story too many when a story ends exactly at
    the size, and a story for --bytes 0, whose empty file is_corpus documents. The stories are those
    of generate_story from random.Random(seed), each followed by SEPARATOR."""
    rng = random.Random(5)
    first = generate_story(rng) + SEPARATOR
    second = generate_story(rng) + SEPARATOR
    size = len(first.encode())
    for num_bytes, want in ((0, ""), (1, first), (size, first), (size + 1, first + second)):
        stats = write_corpus(tmp_path / "c.txt", num_bytes, seed=5)
        assert (tmp_path / "c.txt").read_text(encoding="utf-8") == want, num_bytes
        assert stats["bytes"] == len(want.encode()) and stats["stories"] == want.count(SEPARATOR)


def test_a_hero_and_a_friend_never_share_a_name():
    """A mutation (the friend drawn from every name, the hero's too): "Lily saw a girl ... My name is
    Lily." No test looked at the cast."""
    rng = random.Random(0)
    casts = [make_cast(rng) for _ in range(3000)]
    for hero, friend, _parent in casts:
        assert hero.name != friend.name
    # and each is a girl or a boy (a she or a he), whichever the other is (mutation: the friend a girl
    # whenever the hero was a child, survived)
    children = {(hero.kind, friend.kind) for hero, friend, _ in casts if hero.kind in ("girl", "boy")}
    assert children == {("girl", "girl"), ("girl", "boy"), ("boy", "girl"), ("boy", "boy")}
    assert all(c.female == (c.kind == "girl") for hero, friend, _ in casts for c in (hero, friend)
               if c.kind in ("girl", "boy"))
    animals = {(hero.female, friend.female) for hero, friend, _ in casts if hero.kind not in ("girl", "boy")}
    assert animals == {(True, True), (True, False), (False, True), (False, False)}
