"""The training text: the King James Bible from Debian's bible-kjv-text, one chapter a document.

The text comes from the package's `bible` reader (bible-kjv), which prints the compressed data
file as plain text. Each chapter becomes "Book N" on its own line followed by its verses, one a
line, without verse numbers. Every 20th chapter (the 20th, 40th, ...) is held out: the
perplexity figures are measured on those, never trained on.
"""

import re
import subprocess

HELD_OUT_EVERY = 20
_HEADER = re.compile(r"^\S.*\d+$")
_VERSE = re.compile(r"^\s+\d+\s+(.*)$")


class CorpusError(Exception):
    """The corpus could not be read; the message says what to install."""


def read_chapters():
    """Every chapter of the KJV, in order, as text."""
    try:
        out = subprocess.run(
            ["bible", "-l", "100000", "Ge1:1-Re22:21"],
            check=True, capture_output=True, text=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        raise CorpusError(
            f"cannot read the KJV text through `bible` ({e}): install the Debian packages "
            "bible-kjv and bible-kjv-text (apt-get install bible-kjv-text)"
        ) from e
    chapters, title, verses = [], None, []
    for line in out.splitlines():
        if not line.strip():
            continue
        verse = _VERSE.match(line)
        if verse:
            verses.append(verse.group(1).strip())
        elif _HEADER.match(line):
            if title is not None:
                chapters.append(_chapter(title, verses))
            title, verses = line.strip(), []
        elif verses:
            verses[-1] += " " + line.strip()
    if title is not None:
        chapters.append(_chapter(title, verses))
    if len(chapters) != 1189:
        raise CorpusError(f"the KJV text has {len(chapters)} chapters, expected 1189: is bible-kjv-text whole?")
    return chapters


def _chapter(title, verses):
    return title + "\n" + "\n".join(verses) + "\n"


def split(chapters):
    """(train, held_out): lists of chapter texts; every HELD_OUT_EVERY-th chapter is held out."""
    train = [c for i, c in enumerate(chapters) if (i + 1) % HELD_OUT_EVERY]
    held = [c for i, c in enumerate(chapters) if not (i + 1) % HELD_OUT_EVERY]
    return train, held
