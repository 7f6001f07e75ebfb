//! Tokenized documents, stored flat: every sentence's ids in one buffer, with sentence and
//! document boundaries as offsets. A shard of a million sentences is three allocations instead
//! of a million, and instance building reads neighbouring sentences from neighbouring memory.

/// Item `i` of a list stored as end offsets: `ends[i - 1]..ends[i]` (from 0 for the first).
pub(crate) fn span(ends: &[usize], i: usize) -> std::ops::Range<usize> {
    (if i == 0 { 0 } else { ends[i - 1] })..ends[i]
}

/// Tokenized documents (sentences of vocabulary ids), in order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Corpus {
    ids: Vec<u32>,
    /// End of each sentence in `ids`.
    sentence_ends: Vec<usize>,
    /// End of each document in `sentence_ends`.
    document_ends: Vec<usize>,
}

/// One document of a [`Corpus`]: its sentences.
#[derive(Debug, Clone, Copy)]
pub struct DocumentRef<'a> {
    corpus: &'a Corpus,
    /// Its sentences: indices into the corpus's sentence list.
    first: usize,
    end: usize,
}

impl Corpus {
    /// Documents held.
    pub fn len(&self) -> usize {
        self.document_ends.len()
    }

    /// Whether there is no document.
    pub fn is_empty(&self) -> bool {
        self.document_ends.is_empty()
    }

    /// Sentences in all documents.
    pub fn sentences(&self) -> usize {
        self.sentence_ends.len()
    }

    /// Tokens in all documents.
    pub fn tokens(&self) -> usize {
        self.ids.len()
    }

    /// Every sentence's ids, one after the other.
    pub fn ids(&self) -> &[u32] {
        &self.ids
    }

    /// Document `i`.
    pub fn document(&self, i: usize) -> DocumentRef<'_> {
        let sentences = span(&self.document_ends, i);
        DocumentRef {
            corpus: self,
            first: sentences.start,
            end: sentences.end,
        }
    }

    /// Reserves room for `tokens`, `sentences` and `documents` more.
    pub fn reserve(&mut self, tokens: usize, sentences: usize, documents: usize) {
        self.ids.reserve_exact(tokens);
        self.sentence_ends.reserve_exact(sentences);
        self.document_ends.reserve_exact(documents);
    }

    /// Appends a sentence to the document being built (see [`Corpus::end_document`]); empty
    /// sentences are dropped, as Google's script drops them.
    pub fn push_sentence(&mut self, ids: &[u32]) {
        if !ids.is_empty() {
            self.ids.extend_from_slice(ids);
            self.sentence_ends.push(self.ids.len());
        }
    }

    /// Closes the document made of the sentences pushed since the last one; a document without
    /// sentences is dropped.
    pub fn end_document(&mut self) {
        let sentences = self.sentence_ends.len();
        if sentences > self.document_ends.last().copied().unwrap_or(0) {
            self.document_ends.push(sentences);
        }
    }

    /// A corpus of documents given as lists of sentences.
    pub fn from_documents<D, S>(documents: D) -> Self
    where
        D: IntoIterator,
        D::Item: IntoIterator<Item = S>,
        S: AsRef<[u32]>,
    {
        let mut corpus = Corpus::default();
        for document in documents {
            for sentence in document {
                corpus.push_sentence(sentence.as_ref());
            }
            corpus.end_document();
        }
        corpus
    }

    /// The documents as lists of sentences (for tests and inspection).
    pub fn to_documents(&self) -> Vec<Vec<Vec<u32>>> {
        (0..self.len())
            .map(|d| {
                let document = self.document(d);
                (0..document.len())
                    .map(|s| document.sentence(s).to_vec())
                    .collect()
            })
            .collect()
    }
}

impl<'a> DocumentRef<'a> {
    /// Sentences in the document (at least one).
    pub fn len(&self) -> usize {
        self.end - self.first
    }

    /// Whether the document has no sentence (never, for a document of a [`Corpus`]).
    pub fn is_empty(&self) -> bool {
        self.end == self.first
    }

    /// Sentence `i` of the document.
    pub fn sentence(&self, i: usize) -> &'a [u32] {
        &self.corpus.ids[self.sentence_range(i)]
    }

    /// Where sentence `i` of the document is in [`Corpus::ids`].
    pub fn sentence_range(&self, i: usize) -> std::ops::Range<usize> {
        span(&self.corpus.sentence_ends, self.first + i)
    }

    /// Where sentences `first..end` of the document are in [`Corpus::ids`] (they are
    /// contiguous there).
    pub fn sentences_range(&self, first: usize, end: usize) -> std::ops::Range<usize> {
        debug_assert!(first < end && end <= self.len());
        self.sentence_range(first).start..self.sentence_range(end - 1).end
    }

    /// Tokens in the document.
    pub fn tokens(&self) -> usize {
        let ends = &self.corpus.sentence_ends;
        ends[self.end - 1] - span(ends, self.first).start
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn documents_round_trip() {
        let docs = vec![
            vec![vec![1, 2], vec![], vec![3]],
            vec![vec![]],
            vec![vec![4, 5, 6]],
        ];
        let corpus = Corpus::from_documents(docs.clone());
        // Empty sentences and documents left without sentences are dropped.
        let expected = vec![vec![vec![1, 2], vec![3]], vec![vec![4, 5, 6]]];
        assert_eq!(corpus.to_documents(), expected);
        assert_eq!(
            (corpus.len(), corpus.sentences(), corpus.tokens()),
            (2, 3, 6)
        );
        assert_eq!(corpus.document(0).tokens(), 3);
        assert_eq!(corpus.document(1).sentence(0), [4, 5, 6]);
        assert_eq!(corpus.document(0).sentences_range(0, 2), 0..3);
        assert_eq!(
            corpus.ids()[corpus.document(1).sentence_range(0)],
            [4, 5, 6]
        );
    }
}
