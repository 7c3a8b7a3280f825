"""The text the tokenizer benchmarks encode: Python's documentation, the standard library's
sources and a multilingual block, the same on every run and machine (nothing downloaded)."""

from __future__ import annotations

import glob
import os
import pydoc_data.topics
from pathlib import Path

MULTILINGUAL = (
    "Le vif renard brun saute par-dessus le chien paresseux. Der schnelle braune Fuchs springt. "
    "Быстрая бурая лиса прыгает через ленивую собаку. 素早い茶色の狐がのろまな犬を飛び越える。"
    "敏捷的棕色狐狸跳过了懒狗。 빠른 갈색 여우가 게으른 개를 뛰어넘는다. "
    "الثعلب البني السريع يقفز فوق الكلب الكسول. 🦊🐕 naïve café résumé coöperate x\u0301\n"
)


def corpus(megabytes: float) -> list[str]:
    """Documents of varied text, about `megabytes` of UTF-8 in all, the same on every run."""
    docs = [pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics)]
    docs += [MULTILINGUAL * 40] * 20
    for path in sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py"))):
        docs.append(Path(path).read_text("utf-8", errors="replace"))
    out, size = [], 0
    for doc in docs:
        out.append(doc)
        size += len(doc.encode("utf-8"))
        if size >= megabytes * 1e6:
            break
    return out
