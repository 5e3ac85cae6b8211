"""Embedded BM25 search over a fixed list of documents (tantivy), built once and cached on disk.

The analyzer follows pyserini's default English analyzer, which WebShop's search engine used:
lowercase, English stop words removed, English (Snowball) stemming. A query is a bag of words (no
query syntax, as pyserini's BagOfWords generator), so any text is a valid query. Scores are
tantivy's BM25 (k1 = 1.2, b = 0.75; pyserini defaults to k1 = 0.9, b = 0.4, which tantivy does
not expose).

Indexes live under `envs.cache.cache_root()`/bm25, in a folder named by a hash of the documents
(and of the tantivy and index versions), built once (see `envs.cache.build_once`).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from envs.cache import build_once, cache_root, content_key

INDEX_VERSION = "tantivy-bm25-v1"  # bump when the schema or analyzer changes
TEXT_FIELD = "text"
ORDINAL_FIELD = "ordinal"
ANALYZER = "bm25_english"


def _analyzer():
    import tantivy

    return (
        tantivy.TextAnalyzerBuilder(tantivy.Tokenizer.simple())
        .filter(tantivy.Filter.remove_long(40))
        .filter(tantivy.Filter.lowercase())
        .filter(tantivy.Filter.stopword("english"))
        .filter(tantivy.Filter.stemmer("english"))
        .build()
    )


def _schema():
    import tantivy

    builder = tantivy.SchemaBuilder()
    builder.add_text_field(TEXT_FIELD, stored=False, tokenizer_name=ANALYZER, index_option="freq")
    builder.add_unsigned_field(ORDINAL_FIELD, stored=True)
    return builder.build()


def _clean(text: str) -> str:
    # lone surrogates and the like cannot cross into Rust; drop them instead of failing
    return text.encode("utf-8", "ignore").decode("utf-8")


class BM25Index:
    """A BM25 index over documents 0..n-1; `search` returns their ordinals, best first."""

    def __init__(self, folder: Path):
        import tantivy

        self._tantivy = tantivy
        self._schema = _schema()
        self._analyzer = _analyzer()
        index = tantivy.Index.open(str(folder))
        index.register_tokenizer(ANALYZER, self._analyzer)
        self._searcher = index.searcher()

    @staticmethod
    def build(folder: Path, documents: Iterable[str]) -> None:
        """Write the index of `documents` (their order gives the ordinals) into the empty `folder`."""
        import tantivy

        index = tantivy.Index(_schema(), path=str(folder))
        index.register_tokenizer(ANALYZER, _analyzer())
        writer = index.writer(heap_size=64_000_000, num_threads=1)  # one segment: stable tie order
        for ordinal, text in enumerate(documents):
            writer.add_document(tantivy.Document(**{TEXT_FIELD: _clean(text), ORDINAL_FIELD: ordinal}))
        writer.commit()
        writer.wait_merging_threads()

    @classmethod
    def cached(cls, name: str, documents: list[str]) -> BM25Index:
        """The index of `documents`, built once under cache_root()/bm25/<name>-<content hash>."""
        import tantivy

        # tantivy's version string names its index format: a new format gets a new folder
        target = cache_root() / "bm25" / f"{name}-{content_key(INDEX_VERSION, tantivy.__version__, *documents)}"
        return cls(build_once(target, lambda folder: cls.build(folder, documents)))

    def terms(self, query: str) -> list[str]:
        """The query's terms after analysis (lowercased, stop words dropped, stemmed)."""
        return self._analyzer.analyze(_clean(query))

    def search(self, query: str, k: int) -> list[int]:
        """Ordinals of the k best documents for the bag of words in `query` (none if no term)."""
        terms = self.terms(query)
        if not terms or k <= 0:
            return []
        tantivy = self._tantivy
        clauses = [(tantivy.Occur.Should, tantivy.Query.term_query(self._schema, TEXT_FIELD, t)) for t in terms]
        hits = self._searcher.search(tantivy.Query.boolean_query(clauses), limit=k).hits
        return [self._searcher.doc(address)[ORDINAL_FIELD][0] for _, address in hits]
