"""examples/gutenberg_docs.py: documents are whole paragraphs, in order, and keep every paragraph of the text."""

import importlib.util
import random
from pathlib import Path

_PATH = Path(__file__).resolve().parents[2] / "examples" / "gutenberg_docs.py"
_SPEC = importlib.util.spec_from_file_location("gutenberg_docs", _PATH)
gutenberg_docs = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(gutenberg_docs)


def test_documents_cut_only_at_blank_lines_and_keep_every_paragraph():
    paragraphs = [f"paragraph {i} " + "word " * (i % 7 * 40) for i in range(200)]
    text = "\n\n".join(paragraphs)
    docs = gutenberg_docs.documents(text, random.Random(0), shortest=200, longest=2000)
    assert 1 < len(docs) < len(paragraphs)
    assert [part for doc in docs for part in doc.split("\n\n")] == [p.strip() for p in paragraphs]
    assert all(len(doc) >= 200 for doc in docs[:-1])  # each reached its target before it closed
