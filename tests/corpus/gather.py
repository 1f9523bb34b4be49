"""Rebuild the estimation corpus from text found on this machine (run once; the output is committed).

    python tests/corpus/gather.py

Kinds: English (rendered man pages and package docs), code (Python standard library), Chinese
(zh_CN/zh_TW man pages), JSON (data files shipped by installed packages), other languages (European,
Cyrillic, Japanese, Korean man pages and vim's translation catalogs). Each kind is split by source
file into `train/` (fitting the shipped calibrations) and `heldout/` (the tests), so no source file
feeds both. Sources are walked in sorted order, so the corpus is the same on every run of a machine.
"""

from __future__ import annotations

import gettext
import gzip
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

HERE = Path(__file__).resolve().parent
MAN = Path("/usr/share/man")
STDLIB = Path(os.__file__).parent
TRAIN_BYTES = 220_000
HELDOUT_BYTES = 170_000
# No single source file may fill a split: a kind should read like many documents.
FILE_BYTES = 40_000
OTHER_LANGUAGES = ("de", "fr", "ru", "ja", "ko", "pl", "uk", "es", "it", "pt_BR", "cs", "tr")


def render_man(path: Path) -> str:
    """A man page as a reader sees it: groff output without overstrike or colour escapes."""
    source = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    rendered = subprocess.run(
        ["groff", "-man", "-Tutf8", "-P-cbou", "-Kutf8"],
        input=source,
        capture_output=True,
        check=False,
        env={**os.environ, "MANWIDTH": "80"},
    )
    return rendered.stdout.decode("utf-8", "replace")


def man_pages(*languages: str) -> Iterator[str]:
    for language in languages:
        base = MAN / language if language else MAN
        for path in sorted(base.glob("man[1-8]/*")):
            if path.is_file():
                yield render_man(path)


def english() -> Iterator[str]:
    yield from man_pages("")


def code() -> Iterator[str]:
    for path in sorted(STDLIB.glob("*.py")):
        yield path.read_text("utf-8", "replace")


def chinese() -> Iterator[str]:
    yield from catalogs("zh")
    yield from man_pages("zh_CN", "zh_TW")


def json_documents() -> Iterator[str]:
    roots = [STDLIB.parent / "site-packages", Path(sys.prefix) / "lib"]
    seen: set[str] = set()
    for root in roots:
        for path in sorted(root.rglob("*.json")):
            if path.name in seen or not 2_000 < path.stat().st_size < 60_000 or "mistral" in str(path):
                continue
            seen.add(path.name)
            try:
                document = json.loads(path.read_text("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError):
                continue
            # Request bodies carry JSON both pretty-printed and compact; both splits get both forms.
            compact = (len(seen) // 2) % 2 == 0
            yield json.dumps(document, ensure_ascii=False, indent=None if compact else 2)


def catalogs(prefix: str = "") -> Iterator[str]:
    for path in sorted(Path("/usr/share/vim").rglob("*.mo")):
        language = path.parent.parent.name
        if language.startswith("zh") != (prefix == "zh"):
            continue
        with path.open("rb") as handle:
            try:
                catalog = gettext.GNUTranslations(handle)
            except (OSError, UnicodeDecodeError):
                continue
        messages = [value for key, value in catalog._catalog.items() if key and isinstance(value, str)]
        yield "\n".join(messages)


def other_languages() -> Iterator[str]:
    pages = [man_pages(language) for language in OTHER_LANGUAGES]
    sources = [*pages, catalogs()]
    # Interleave the languages so both splits hold every script.
    while sources:
        for source in list(sources):
            text = next(source, None)
            if text is None:
                sources.remove(source)
            else:
                yield text


def split(texts: Iterator[str], name: str) -> None:
    """Alternate whole source files between the splits until each holds its byte budget."""
    budgets = {"train": TRAIN_BYTES, "heldout": HELDOUT_BYTES}
    parts: dict[str, list[str]] = {"train": [], "heldout": []}
    sizes = dict.fromkeys(budgets, 0)
    turn = 0
    for raw in texts:
        text = raw.strip()
        if len(text) < 200:
            continue
        open_splits = [s for s in budgets if sizes[s] < budgets[s]]
        if not open_splits:
            break
        target = open_splits[turn % len(open_splits)]
        turn += 1
        encoded = text.encode("utf-8")[: min(FILE_BYTES, budgets[target] - sizes[target])].decode(
            "utf-8", "ignore"
        )
        parts[target].append(encoded)
        sizes[target] += len(encoded.encode("utf-8"))
    for target, texts_of_split in parts.items():
        out = HERE / target / f"{name}.txt"
        out.parent.mkdir(exist_ok=True)
        out.write_text("\n\n".join(texts_of_split) + "\n", "utf-8")
        print(f"{out.relative_to(HERE)}: {sizes[target]} bytes from {len(texts_of_split)} files")


def main() -> None:
    split(english(), "english")
    split(code(), "code")
    split(chinese(), "chinese")
    split(json_documents(), "json")
    split(other_languages(), "other")


if __name__ == "__main__":
    main()
