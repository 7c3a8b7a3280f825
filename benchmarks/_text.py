"""What the tokenizer benchmarks share: the text they encode (Python's documentation, the
standard library's sources and a multilingual block, the same on every run and machine, nothing
downloaded) and the loop timing each engine over it."""

from __future__ import annotations

import glob
import os
import pydoc_data.topics
import time
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


def best_pass(make, docs: list[str], repeats: int) -> tuple[float, list]:
    """Best wall time of `repeats` passes over `docs`, each by a fresh encode function `make()`
    (so no pass finds the words of an earlier one cached), and the ids of the last pass."""
    best, ids = float("inf"), None
    for _ in range(repeats):
        fn = make()
        fn(docs[0][:1000])  # first-call costs (thread pools) outside the timing
        start = time.perf_counter()
        ids = [fn(d) for d in docs]
        best = min(best, time.perf_counter() - start)
    return best, ids


def encode_speeds(docs, engines: dict, repeats, rate: str = "mb_per_s", digits: int = 3) -> dict:
    """Each engine's speed over `docs` (engines: name -> `make()` of an encode function) and
    whether its ids equal the first engine's; `repeats(name)` passes each (best kept). `rate` and
    `digits` are the MB/s field's name and rounding, as each results file already has them."""
    nbytes = sum(len(d.encode("utf-8")) for d in docs)
    results, reference = {}, None
    for name, make in engines.items():
        seconds, ids = best_pass(make, docs, repeats(name))
        reference = reference or ids
        results[name] = {
            "seconds": round(seconds, 4),
            rate: round(nbytes / seconds / 1e6, digits),
            "ids_equal_to_first": ids == reference,
        }
        print(f"  {name:45s} {results[name][rate]:9.3f} MB/s  same ids: {ids == reference}")
    tokens = sum(map(len, reference))
    return {"bytes": nbytes, "documents": len(docs), "tokens": tokens, "engines": results}
