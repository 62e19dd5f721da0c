"""Wikitext cleaning and the corpus lookup (fetching itself runs in CI via tools/fetch_data.py)."""

import pytest

from mlx_flash.calibrate.corpora import corpus_path, wiki_articles, wikitext_to_plain
from mlx_flash.errors import ModelNotFoundError


def test_wikitext_to_plain():
    raw = (
        "'''Anarchism''' is a [[political philosophy|philosophy]]{{sfn|X|2001}}<ref>cite</ref> that "
        "[[File:a.png|thumb|caption [[x]]]]rejects [[state (polity)|states]].\n== History ==\n* item"
    )
    assert wikitext_to_plain(raw) == "Anarchism is a philosophy that rejects states.\nHistory\nitem"


def test_redirects_and_other_namespaces_are_skipped():
    body = "word " * 60
    xml = (
        f"<page><title>A</title><ns>0</ns><text>{body}</text></page>"
        "<page><title>B</title><ns>0</ns><text>#REDIRECT [[A]]</text></page>"
        f"<page><title>Talk:A</title><ns>1</ns><text>{body}</text></page>"
    )
    assert [t for t, _ in wiki_articles(xml)] == ["A"]


def test_missing_corpus_names_the_fix(tmp_path):
    with pytest.raises(ModelNotFoundError, match="fetch_data.py"):
        corpus_path("wikipedia", str(tmp_path))
