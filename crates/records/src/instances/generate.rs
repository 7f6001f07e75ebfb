//! Making one document's instances: `create_instances_from_document`, against [`Draws`] so
//! that both modes run the same code.

use crate::corpus::{Corpus, DocumentRef};
use crate::draws::Draws;
use crate::masking::{MaskScratch, VocabIds};

use super::InstanceOptions;
use super::columns::InstanceColumns;

/// Buffers reused from one instance to the next.
#[derive(Default)]
pub(super) struct Scratch {
    /// The instance being masked: `[CLS] A [SEP] B [SEP]`.
    ids: Vec<u32>,
    mask: MaskScratch,
}

/// A corpus's documents in a shuffled order.
pub(super) struct ShuffledDocuments<'a> {
    corpus: &'a Corpus,
    order: Vec<u32>,
}

impl<'a> ShuffledDocuments<'a> {
    /// Shuffling the order draws what shuffling the script's list of documents draws.
    pub(super) fn new<R: Draws>(corpus: &'a Corpus, rng: &mut R) -> Self {
        let mut order: Vec<u32> = (0..corpus.len() as u32).collect();
        rng.shuffle(&mut order);
        ShuffledDocuments { corpus, order }
    }

    pub(super) fn len(&self) -> usize {
        self.order.len()
    }

    pub(super) fn get(&self, index: usize) -> DocumentRef<'a> {
        self.corpus.document(self.order[index] as usize)
    }
}

/// The instances of document `document_index` (one pass), appended to `out`.
pub(super) fn instances_from_document<R: Draws>(
    documents: &ShuffledDocuments<'_>,
    document_index: usize,
    vocab: &VocabIds,
    options: &InstanceOptions,
    rng: &mut R,
    out: &mut InstanceColumns,
    scratch: &mut Scratch,
) {
    let source = documents.corpus.ids();
    let document = documents.get(document_index);
    let max_num_tokens = options.max_seq_length - 3;
    let mut target_seq_length = max_num_tokens;
    if rng.random() < options.short_seq_prob {
        target_seq_length = rng.randint(2, max_num_tokens);
    }
    // The current chunk: sentences `chunk_start..chunk_start + chunk_len` of the document.
    // Sentences are contiguous in the corpus, so segments A and B are token ranges of it.
    let mut chunk_start = 0;
    let mut chunk_len = 0;
    let mut length = 0;
    let mut i = 0usize;
    while i < document.len() {
        if chunk_len == 0 {
            chunk_start = i;
        }
        chunk_len += 1;
        length += document.sentence_range(i).len();
        if i == document.len() - 1 || length >= target_seq_length {
            let a_end = if chunk_len >= 2 {
                rng.randint(1, chunk_len - 1)
            } else {
                1
            };
            let a_range = document.sentences_range(chunk_start, chunk_start + a_end);
            let is_random_next = chunk_len == 1 || rng.random() < 0.5;
            let b_range = if is_random_next {
                let target_b_length = target_seq_length.saturating_sub(a_range.len());
                let mut random_index = document_index;
                for _ in 0..10 {
                    random_index = rng.randint(0, documents.len() - 1);
                    if random_index != document_index {
                        break;
                    }
                }
                let random_document = documents.get(random_index);
                let start = rng.randint(0, random_document.len() - 1);
                let mut end = start;
                let mut b_len = 0;
                while end < random_document.len() {
                    b_len += random_document.sentence_range(end).len();
                    end += 1;
                    if b_len >= target_b_length {
                        break;
                    }
                }
                // Put the unused segments back.
                i -= chunk_len - a_end;
                random_document.sentences_range(start, end)
            } else {
                document.sentences_range(chunk_start + a_end, chunk_start + chunk_len)
            };
            let (a, b) = rng.truncate_pair(a_range.len(), b_range.len(), max_num_tokens);
            let a = a_range.start + a.start..a_range.start + a.end;
            let b = b_range.start + b.start..b_range.start + b.end;
            let first_segment_len = a.len() + 2;
            let len = a.len() + b.len() + 3;
            let mask_seed = rng.deferred_mask_seed();
            if mask_seed.is_none() {
                // The script masks here, between this pair's draws and the next one's.
                let ids = &mut scratch.ids;
                ids.clear();
                ids.push(vocab.cls);
                ids.extend_from_slice(&source[a.clone()]);
                ids.push(vocab.sep);
                ids.extend_from_slice(&source[b.clone()]);
                ids.push(vocab.sep);
                out.mask_and_store(ids, &options.masking(), vocab, rng, &mut scratch.mask);
            }
            out.end_instance([a, b], first_segment_len, is_random_next, len, mask_seed);
            chunk_len = 0;
            length = 0;
        }
        i += 1;
    }
}
