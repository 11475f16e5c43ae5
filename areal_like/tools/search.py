"""`search`: BM25 retrieval over a local corpus (a parquet file with columns `id`, `text`).

The index is built once, when the tool is created (at config load, so a missing file or column fails
the run at start, not at the first call); queries then run in a thread, so a large corpus never
blocks the rollout worker's event loop. No network, no model: a fixed, reproducible retriever for
search-R1-style agentic RLVR.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from typing import Any

from areal_like.tools.base import Tool, ToolResult

REQUIRED_COLUMNS = ("id", "text")


@dataclass(frozen=True)
class SearchToolConfig:
    corpus: str
    top_k: int = 3
    max_passage_chars: int = 500

    def __post_init__(self) -> None:
        if not self.corpus:
            raise ValueError("corpus must name a parquet file with columns id, text")
        if self.top_k <= 0:
            raise ValueError(f"top_k={self.top_k} must be > 0")
        if self.max_passage_chars <= 0:
            raise ValueError(f"max_passage_chars={self.max_passage_chars} must be > 0")


def load_corpus(path: str) -> tuple[list[str], list[str]]:
    """(ids, texts) from the parquet file; errors name the file and the columns it needs."""
    import pyarrow.parquet as pq

    if not os.path.isfile(path):
        raise ValueError(f"corpus={path!r} does not exist (relative paths are read from {os.getcwd()}): "
                         f"point it at a parquet file with columns {', '.join(REQUIRED_COLUMNS)}")
    try:
        schema = pq.read_schema(path)
    except Exception as e:  # pyarrow raises several kinds for a file that is not parquet
        raise ValueError(f"corpus={path!r} is not a readable parquet file ({type(e).__name__}: {e})") from None
    missing = [c for c in REQUIRED_COLUMNS if c not in schema.names]
    if missing:
        raise ValueError(f"corpus={path!r} lacks column(s) {', '.join(missing)}: it needs columns "
                         f"{', '.join(REQUIRED_COLUMNS)} (found: {', '.join(schema.names) or 'none'})")
    table = pq.read_table(path, columns=list(REQUIRED_COLUMNS))
    ids = ["" if v is None else str(v) for v in table.column("id").to_pylist()]
    texts = ["" if v is None else str(v) for v in table.column("text").to_pylist()]
    if not texts:
        raise ValueError(f"corpus={path!r} has no rows")
    return ids, texts


class SearchTool(Tool):
    Config = SearchToolConfig
    required_arguments = ("query",)
    call_timeout_s = 30.0
    default_schema = {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the knowledge base and return the most relevant passages for a query.",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string", "description": "What to search for (keywords)."}},
                "required": ["query"],
            },
        },
    }

    def __init__(self, config: SearchToolConfig, tool_schema: dict | None = None):
        super().__init__(config, tool_schema)
        import bm25s  # here, not at module import: only configs with a search tool pay for it

        self.cfg = config
        self._ids, self._texts = load_corpus(config.corpus)
        self._bm25s = bm25s
        self._retriever = bm25s.BM25()
        self._retriever.index(self._tokenize(self._texts), show_progress=False)
        self.output_chars = config.top_k * (config.max_passage_chars + 64) + 64

    def _tokenize(self, texts: list[str]) -> list[list[str]]:
        # the same tokenizer for corpus and queries; words the corpus lacks simply score nothing
        return self._bm25s.tokenize(texts, stopwords="en", return_ids=False, show_progress=False)

    def search(self, query: str, top_k: int | None = None) -> list[tuple[str, str, float]]:
        """[(id, text, score)], best first, only passages sharing a word with the query."""
        tokens = self._tokenize([query])
        if not tokens or not tokens[0]:
            return []
        k = min(top_k or self.cfg.top_k, len(self._texts))
        docs, scores = self._retriever.retrieve(tokens, k=k, show_progress=False)  # n_threads=0: inline
        return [(self._ids[int(d)], self._texts[int(d)], float(s)) for d, s in zip(docs[0], scores[0]) if s > 0]

    async def execute(self, arguments: dict, **tools_kwargs: Any) -> ToolResult:
        query = str(arguments["query"]).strip()
        if not query:
            return ToolResult("Error: the query is empty: write a few keywords", error="bad_arguments")
        hits = await asyncio.to_thread(self.search, query)
        if not hits:
            return ToolResult(f"No results for {query!r}: try other keywords.", metrics={"hits": 0.0})
        limit = self.cfg.max_passage_chars
        lines = []
        for n, (doc_id, text, _score) in enumerate(hits, 1):
            text = " ".join(text.split())
            if len(text) > limit:
                text = text[:limit].rstrip() + "…"
            lines.append(f"Doc {n} (id={doc_id}): {text}")
        return ToolResult("\n".join(lines), metrics={"hits": float(len(hits))})
