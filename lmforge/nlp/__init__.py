"""Classical NLP toolkit: bigram LM, metrics, edit distance, PMI, TF-IDF, BM25, RRF, TextRank;
each name is imported from its module (lmforge.nlp.bm25, ...)."""
